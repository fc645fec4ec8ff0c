"""The remote tier's requests about one chunk object each: a failure is a counted miss.

Each method reads, writes or deletes one object of the tier's namespace through the
`ObjectStore`. A store that fails (`StoreUnavailable`, after its retries) never raises into
the tier's caller: the failure is counted in the tier's counters and the object is served
as a miss, or not written, or not deleted. What a request finds keeps the catalog current:
an object found missing or deleted leaves it, one written enters it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtiers.core.keys import ChunkKey
from kvtiers.core.stats import TierCounters
from kvtiers.tiers._chunk_format import Header, Verdict
from kvtiers.tiers._read_buffers import ReadBuffers
from kvtiers.tiers._remote_access import AccessLog
from kvtiers.tiers._remote_breaker import StoreUnavailable, gather_all
from kvtiers.tiers._remote_catalog import Catalog, object_path
from kvtiers.tiers._remote_codec import ObjectCodec
from kvtiers.tiers._remote_deadline import Stragglers
from kvtiers.tiers._remote_io import ObjectStore
from kvtiers.tiers._remote_layers import LayerPlan, Pieces
from kvtiers.tiers.base import Buffer

__all__ = ["ChunkObjects"]

_HEADERS_KEPT = 4096  # verified headers kept for later waves of layer-wise loads


class ChunkObjects:
    """The chunk objects of one layout's namespace, one request per object.

    Args:
        store: the store the objects live in.
        codec: the objects' format.
        catalog: the objects this process knows of.
        log: this process's access log (a deleted object's records go).
        counters: the tier's counters, where failed requests are counted.
        buffers: the buffers whole objects of a local filesystem are read into.
    """

    def __init__(
        self,
        store: ObjectStore,
        codec: ObjectCodec,
        catalog: Catalog,
        log: AccessLog,
        counters: TierCounters,
        buffers: ReadBuffers,
    ) -> None:
        self._store, self._codec, self._catalog, self._log = store, codec, catalog, log
        self._counters, self._buffers = counters, buffers
        self._put_slots = asyncio.Semaphore(store.options.max_in_flight)  # packed values held
        # NOTE: a dict as a bounded insertion-ordered map: the oldest header goes first.
        self._headers: dict[ChunkKey, Header] = {}
        """Headers verified by recent ranged reads (`read_layers`), oldest first."""
        self.stragglers = Stragglers()
        """Requests a call stopped waiting for (the tier's, shared with its reads)."""

    @property
    def namespace(self) -> str:
        """The path below which this layout's objects live (without the protocol)."""
        return f"{self._store.root}/{self._codec.fingerprint.hex()}"

    async def after_read(
        self,
        keys: Sequence[ChunkKey],
        found: Sequence[tuple[Verdict | None, int]],
        now: float,
        since: int,
        deadline: float = math.inf,
        *,
        tally: bool = True,
    ) -> None:
        """Count a batch's reads, record its hits' recency, delete its bad objects.

        `found` holds each key's verdict (`None`: not read) and object size; `since` is
        the catalog's `changes` when the reads began. The deletes are waited for until
        `deadline` (`time.monotonic()`), then left to run. With `tally` off, hits and
        misses are not counted (a later wave of a layer-wise load).
        """
        counters = self._counters
        hit_keys, hit_sizes, bad = [], [], []
        for key, (verdict, size) in zip(keys, found, strict=True):
            if verdict is Verdict.OK:
                hit_keys.append(key)
                hit_sizes.append(size)
            elif verdict is not None:
                bad.append(key)
                counters.corrupt += verdict in (Verdict.CORRUPT, Verdict.FORGED)
                counters.forged += verdict is Verdict.FORGED
                counters.foreign += verdict is Verdict.FOREIGN
        self._catalog.learn(hit_keys, hit_sizes, now, since)
        if tally:
            counters.hits += len(hit_keys)
            counters.misses += len(keys) - len(hit_keys)
        counters.cold_hits += self._catalog.touch(hit_keys, now)
        self._log.record(hit_keys, now)
        if bad:
            budget = max(0.0, deadline - time.monotonic())
            await self.stragglers.within(budget, [self.delete(bad)], [])

    async def get_layers(
        self,
        keys: Sequence[ChunkKey],
        plan: LayerPlan,
        dsts: Sequence[Buffer],
        clock: Callable[[], float],
        *,
        tally: bool = True,
    ) -> list[bool]:
        """Fill `plan`'s layers of each destination from ranged reads; return the hits.

        Each object is judged as `after_read` says (`clock` gives its time of use).
        """
        deadline = time.monotonic() + self._store.read_timeout
        since = self._catalog.changes
        got, late = await self.stragglers.within(
            self._store.read_timeout, [self.read_layers(key, plan) for key in keys], None
        )
        self._counters.fail(late, timed_out=True)
        found = await gather_all(
            self._codec.deliver_layers(k, g, plan, d)
            for k, g, d in zip(keys, got, dsts, strict=True)
        )
        await self.after_read(keys, found, clock(), since, deadline, tally=tally)
        return [verdict is Verdict.OK for verdict, _ in found]

    async def info(self, key: ChunkKey) -> dict[str, Any] | None | bool:
        """Return the object's details, `None` if it is missing, `False` if unknown."""
        try:
            return await self._store.info(object_path(self.namespace, key))
        except StoreUnavailable as exc:
            self._counters.fail(timed_out=exc.timed_out)
            return False

    async def fetch(
        self, key: ChunkKey, path: str | None = None, ahead: Sequence[str] = ()
    ) -> bytes | memoryview | None:
        """Read one object whole (`ahead`: local objects to hint to the kernel first)."""
        path = path or object_path(self.namespace, key)
        since = self._catalog.changes
        raw: bytes | memoryview | None
        try:
            # NOTE: one byte more than a valid object holds, so a longer one shows as such.
            if self._store.reads_into:
                read = await self._store.read_into(path, self._buffers.take, ahead)
                raw = None if read is None else read[0].data[: read[1]]
            else:
                raw = await self._store.cat(path, self._codec.value_bytes + 1)
        except StoreUnavailable as exc:
            self._counters.fail(timed_out=exc.timed_out)
            return None
        if raw is None:
            self._catalog.learn([key], [None], 0.0, since)
        return raw

    async def read_layers(
        self, key: ChunkKey, plan: LayerPlan
    ) -> Pieces | bytes | memoryview | None:
        """Read one object's layers of `plan`, verified, or else the whole object.

        The whole object is read when the ranges do not verify (it is then judged as `get`
        judges it) or when integrity is on (a tag covers the whole payload). `None`: no
        object, or the store failed.
        """
        if self._codec.auth_key is None:
            known = self._headers.get(key)
            path = object_path(self.namespace, key)
            since = self._catalog.changes
            ranges = list(plan.ranges) if known is None else plan.run_ranges(known)
            try:
                parts = await self._store.cat_ranges(path, ranges)
            except StoreUnavailable as exc:
                self._counters.fail(timed_out=exc.timed_out)
                return None
            if parts is None:
                self._catalog.learn([key], [None], 0.0, since)
                return None
            if known is not None:
                got = None if (p := plan.verify_runs(known, parts)) is None else (known, p)
            else:
                got = plan.verify_all(parts, fingerprint=self._codec.fingerprint, key=key)
            if got is not None:
                self._remember_header(key, got[0])
                return got[1]
            self._headers.pop(key, None)
        return await self.fetch(key)

    def _remember_header(self, key: ChunkKey, header: Header) -> None:
        """Keep a verified header, so the next ranged read of `key` skips it (bounded).

        NOTE: a layer-wise load reads one object in several waves; the first checks the
        header, the others read their layers alone and check them against it. An object
        replaced meanwhile fails that check and is then read whole, so a stale header
        costs one read, never a wrong byte. The waves of one load may still come from
        two valid versions of a replaced object (each layer checked against its own
        version); the chunk is delivered, and promoted, as read.
        """
        self._headers[key] = header
        if len(self._headers) > _HEADERS_KEPT:
            del self._headers[next(iter(self._headers))]

    async def write(self, key: ChunkKey, src: Buffer, now: float) -> bool:
        """Store the chunk `src` under `key`; return whether it was stored.

        A stored object enters the catalog as used at `now`, also if the caller was
        cancelled meanwhile (a started write is finished, not abandoned).
        """
        async with self._put_slots:
            value = await self._codec.offload(self._codec.pack, key, src)

            def stored() -> None:
                self._catalog.add(key, len(value), now)

            try:
                await self._store.write(object_path(self.namespace, key), value, stored)
            except StoreUnavailable as exc:
                self._counters.fail(timed_out=exc.timed_out)
                self._store.counters.dropped_writes += 1
                return False
            return True

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete the objects of `keys`; return, for each, whether the catalog held it."""
        return await gather_all(self._delete_one(key) for key in keys)

    async def _delete_one(self, key: bytes) -> bool:
        try:
            await self._store.rm(object_path(self.namespace, key))
        except StoreUnavailable as exc:
            self._counters.fail(timed_out=exc.timed_out)
            return False
        self._log.forget([key])
        self._headers.pop(key, None)  # type: ignore[call-overload]
        return self._catalog.remove(key)
