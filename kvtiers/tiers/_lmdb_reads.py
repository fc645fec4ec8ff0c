"""Reading values out of the lmdb tier's map: whole chunks, or some layers of each.

A value is verified whole before a byte of it reaches the caller's buffer (its payload's
checksum, and its integrity tag when that is on); a read of some layers then copies only
those. py-lmdb faults in every page of a value it returns, so reading some layers saves a
copy, not a read from the disk: the tier does not declare `layer_reads`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import lmdb

from kvtiers.core.errors import CacheStateError, TierIOError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierUsage
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers import _lmdb_format as lmdb_format
from kvtiers.tiers._cancellation import wait_out
from kvtiers.tiers._layers import layer_pieces, write_layers
from kvtiers.tiers._lmdb_format import Databases
from kvtiers.tiers._lmdb_gate import MapGate
from kvtiers.tiers.base import Buffer

__all__ = [
    "ValueReader",
    "keys_present",
    "keys_present_now",
    "read_parts",
    "run_jobs",
    "usage_now",
]

_T = TypeVar("_T")

SPLIT_MIN_VALUE = 256 << 10
"""Values smaller than this are read in one part, however many there are (see `read_parts`)."""
SPLIT_PART_BYTES = 4 << 20
"""A part of a split batch carries at least this many bytes, whatever its values' size."""
_PART_AT = (448 << 10, 6 << 20)
"""At 448 KiB a value, a part carries at least 6 MiB; four times that at half the size."""


def part_bytes(value_bytes: int) -> int:
    """Return the fewest bytes a part of a batch of `value_bytes` values carries."""
    at_value, at_bytes = _PART_AT
    return max(SPLIT_PART_BYTES, at_bytes * at_value * at_value // max(1, value_bytes) ** 2)


def read_parts(num_values: int, value_bytes: int, most: int) -> int:
    """Return how many parts to split a read of `num_values` values of `value_bytes` into.

    NOTE: a part is a job of the tier's thread pool. Verifying and copying a value frees
    the interpreter lock only for its bytes (hashing, `memcpy`); the Python work around each
    value holds it, so two parts take turns on the lock for that work, and each part pays a
    thread's wake-up. A second part pays off only for large values (less lock per byte) in
    large batches (the wake-up spread over more bytes), hence a part size that shrinks with
    the square of the value size (`part_bytes`). On a 2-vCPU VM (warm map, one part's time
    over two parts', medians of 25): 512 of 64 KiB 0.69, 192 of 128 KiB 0.72, 128 of 256 KiB
    0.99 (kept whole below 256 KiB); 64 of 320 KiB 1.00, 96 of them 1.17; 32 of 384 KiB
    0.95, 64 of them 1.09-1.19; 24 of 448 KiB 1.00, 32 of them 1.08; 16 of 512 KiB 0.85,
    32 of them 1.12; 8 of 768 KiB 0.88, 16 of them 1.20; 16 of 4 MiB 1.52. Cold reads
    gained nothing from more parts.

    Args:
        num_values: values in the batch.
        value_bytes: bytes of each value's payload.
        most: the most parts (the pool's threads, at most one per core).
    """
    if value_bytes < SPLIT_MIN_VALUE:
        return 1
    return max(1, min(most, num_values, num_values * value_bytes // part_bytes(value_bytes)))


async def run_jobs(
    pool: ThreadPoolExecutor | None,
    jobs: Sequence[Callable[[threading.Event], _T]],
    name: str,
    path: str,
) -> list[_T]:
    """Run the blocking `jobs` of tier `name` in `pool` and return their results.

    On cancellation, tell the jobs to stop (a write transaction then aborts) and wait for
    them before re-raising, so no thread still touches the caller's buffers afterwards.
    An `lmdb.Error` becomes a `TierIOError` naming the tier and its path.
    """
    loop, cancel = asyncio.get_running_loop(), threading.Event()
    try:
        futs = [loop.run_in_executor(pool, job, cancel) for job in jobs]
    except RuntimeError as exc:  # the pool was shut down by a concurrent close
        raise CacheStateError(f"tier {name!r} is closed") from exc
    try:
        results = await asyncio.shield(asyncio.gather(*futs, return_exceptions=True))
    except asyncio.CancelledError:
        cancel.set()
        await wait_out(futs)
        raise
    for result in results:
        if isinstance(result, lmdb.Error):
            raise TierIOError(f"{name}: lmdb at {path!r}: {result}") from result
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]  # no exceptions left


def keys_present(txn: lmdb.Transaction[memoryview], keys: Sequence[ChunkKey]) -> list[bool]:
    """Return, per key, whether the transaction's database holds it."""
    return [txn.get(key) is not None for key in keys]


def keys_present_now(
    gate: MapGate, db: lmdb._Database, keys: Sequence[ChunkKey]
) -> list[bool] | None:
    """`keys_present` on the caller's thread; `None` if that could block, or failed.

    NOTE: for the event loop. A few lookups in a table of a few bytes a key (its pages in
    the page cache once used) take microseconds, where a round trip to the tier's thread
    pool took 250 us on a 2-vCPU VM. A transaction that would wait for a remap, or an
    error, is `None`: the pool then answers, or raises the `TierIOError`.
    """
    try:
        with gate.try_read(db) as txn:
            return None if txn is None else keys_present(txn, keys)
    except lmdb.Error:
        return None


def usage_now(gate: MapGate, dbs: Databases, capacity_bytes: int) -> TierUsage | None:
    """Return what the map holds now; `None` if the environment cannot tell (closing, failing).

    NOTE: a read transaction takes no lock and only reads mapped pages, so this runs on the
    caller's thread, the event loop included.
    """
    try:
        with gate.begin() as txn:
            used = lmdb_format.read_used_bytes(txn, dbs)
            entries = txn.stat(dbs.chunks)["entries"]
    except lmdb.Error:
        return None
    return TierUsage(capacity_bytes, used, entries)


class ValueReader:
    """Verify values of one layout and copy them into chunk buffers.

    Args:
        layout: the layout of the chunks.
        auth_key: the integrity secret values must be tagged under; `None` when off.
    """

    def __init__(self, layout: KVLayout, auth_key: bytes | None) -> None:
        self.layout, self.auth_key = layout, auth_key
        # NOTE: the layout computes these on each access (the fingerprint hashes its
        # fields: 4 us); a read checks each value against them.
        self._fingerprint, self._payload_len = layout.fingerprint, layout.chunk_bytes

    def read_batch(
        self,
        txn: lmdb.Transaction[memoryview],
        keys: Sequence[ChunkKey],
        dsts: Sequence[Buffer],
        layers: Sequence[int] | None,
        cancel: threading.Event,
    ) -> tuple[list[bool], list[ChunkKey]]:
        """Read `keys` (all their layers, or `layers`) in `txn` into `dsts`.

        Returns:
            Per key whether it was delivered, and the keys whose values failed a check.
        """
        hits, bad = [False] * len(keys), list[ChunkKey]()
        for i, key in enumerate(keys):
            raw = None if cancel.is_set() else txn.get(key)
            if raw is None:
                continue
            if layers is None:
                verdict = self.whole(key, raw, dsts[i])
            else:
                verdict = self.layers(key, raw, dsts[i], layers)
            if verdict is fmt.Verdict.OK:
                hits[i] = True
            else:
                bad.append(key)
        return hits, bad

    def whole(self, key: bytes, raw: fmt.Bytes, dst: Buffer) -> fmt.Verdict:
        """Verify `raw` and copy its payload into `dst` when it is `Verdict.OK`."""
        return fmt.check_into(
            raw,
            dst,
            fingerprint=self._fingerprint,
            key=key,
            payload_len=self._payload_len,
            auth_key=self.auth_key,
        )

    def layers(self, key: bytes, raw: fmt.Bytes, dst: Buffer, wanted: Sequence[int]) -> fmt.Verdict:
        """Verify `raw` whole and copy its layers `wanted` into `dst` (the rest left alone)."""
        verdict, payload = self._check(key, raw)
        if payload is not None:
            pieces = layer_pieces(payload, wanted, self.layout.layer_bytes)
            write_layers(dst, pieces, self.layout.num_layers)
        return verdict

    def _check(self, key: bytes, raw: fmt.Bytes) -> tuple[fmt.Verdict, memoryview | None]:
        return fmt.check_value(
            raw,
            fingerprint=self._fingerprint,
            key=key,
            payload_len=self._payload_len,
            auth_key=self.auth_key,
        )
