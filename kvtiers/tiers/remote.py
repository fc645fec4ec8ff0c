"""The remote tier: one object per chunk in any fsspec store, pooled by every node.

Objects live under `<url>/<layout fingerprint hex>/<key[:2] hex>/<key hex>` and hold a chunk
in the lmdb tier's format (`_chunk_format`) with per-layer checksums added, so that
`get_layers` can read and verify the header and some layers as byte ranges.

Writes are whole or absent for readers: object stores (s3fs, gcsfs, ...) make a PUT visible
at once, complete, and the last of two concurrent PUTs of one key wins; on filesystems
without that (local) the object is written under a temporary name and renamed, which POSIX
makes atomic. Two processes writing one chunk therefore leave one valid object.

Eviction is least recently used by last access, by the tier itself (`manages_eviction`):
no single process sees every read. Each process keeps a catalog of the objects it knows
(filled by a scan: one listing of the namespace plus every process's access log, see
`_remote_catalog`) and evicts from it when a `put` would exceed the capacity. Scans run at
open and then at most every `scan_interval` seconds, from `put` (the background write path,
never a load); a scan also deletes objects idle for longer than `ttl`, and evicts what
other processes' writes pushed over the capacity. A listing alone would only know writes;
a shared index object would need read-modify-write across nodes, which object stores cannot
do safely, so each process writes only its own small access log.

While the store fails, a circuit breaker (`_remote_breaker`, applied by `_remote_io`) turns
every call into misses at once, and `put` drops its chunks (counted); nothing raises into
the caller. While it is merely slow, a read call ends by `read_timeout` with misses for
what has not arrived (`_remote_deadline`); a store out of space declines writes and goes
on serving reads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import re
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError, InvalidInputError
from kvtiers.core.keys import KEY_BYTES, ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import StoreHealth, TierUsage
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers._chunk_format import Verdict
from kvtiers.tiers._integrity import auth_key_from_config
from kvtiers.tiers._read_buffers import ReadBuffers
from kvtiers.tiers._readahead import HINT_AHEAD, HINT_MIN_BYTES, ahead_of
from kvtiers.tiers._remote_breaker import IOCounters, StoreUnavailable, gather_all, health_of
from kvtiers.tiers._remote_catalog import (
    ACCESS_DIR,
    AccessLog,
    Catalog,
    Listing,
    object_path,
    scan,
)
from kvtiers.tiers._remote_deadline import Stragglers
from kvtiers.tiers._remote_io import ObjectStore
from kvtiers.tiers._remote_layers import LayerPlan, Pieces, write_layers
from kvtiers.tiers._remote_options import RemoteOptions
from kvtiers.tiers.base import Buffer, Tier

__all__ = ["RemoteOptions", "RemoteTier"]

logger = logging.getLogger("kvtiers")

_T = TypeVar("_T")
_OFFLOAD_BYTES = 256 * 2**10  # chunks from this size are checked and copied off the loop
_NOT_READ: tuple[Verdict | None, int] = (None, 0)  # the verdict and size of an object not read
_TEMP_AGE = 3600.0  # seconds after which a scan deletes a temporary file left by a crash
_LOG_AGE = 86400.0  # seconds after which a scan deletes another process's idle access log
_LIST_PAGE = 1000  # objects one listing request returns (S3, GCS)


class RemoteTier(Tier):
    """A tier of chunk objects in an fsspec store (S3, GCS, local, memory...), shared by nodes.

    Beyond the contract it offers `get_layers` (ranged reads of some layers) and `scan_now`
    (a scan on demand). `used_bytes` counts whole objects (header and payload), as this
    process knows them (see the module docstring).

    Args:
        config: capacity, eviction (only `"lru"`) and the options of `RemoteOptions`.
        layout: the KV layout of the chunks it holds.

    Raises:
        ConfigError: an option is invalid, the URL's protocol has no backend installed, or
            the capacity cannot hold one chunk.
    """

    kind = "remote"
    shared = True
    manages_eviction = True

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self.options = RemoteOptions.from_config(config)
        ObjectStore.check_protocol(self.options.url, config.where)
        self._fingerprint = layout.fingerprint
        self._auth_key = auth_key_from_config(config)
        self._header_len = fmt.header_bytes(
            self._fingerprint,
            layout.chunk_bytes,
            num_layers=layout.num_layers,
            tagged=self._auth_key is not None,
        )
        self.value_bytes = self._header_len + layout.chunk_bytes
        """Bytes of one stored object (header and payload)."""
        if self.capacity_bytes < self.value_bytes:
            raise ConfigError(
                f"{config.where}.capacity: capacity too small for one chunk; a stored chunk "
                f"takes {self.value_bytes} bytes (header and payload), got {self.capacity_bytes}"
            )
        self.clock: Callable[[], float] = time.time
        """Wall-clock seconds for recency and TTL (shared with other nodes, so not monotonic)."""
        self._store = ObjectStore(self.options, self.name)
        self._catalog = Catalog()
        self._log = AccessLog()
        host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]
        self._writer_id = f"{host}-{os.getpid()}-{secrets.token_hex(4)}"
        self._write_lock = asyncio.Lock()  # one put batch or scan at a time: exact accounting
        self._put_slots = asyncio.Semaphore(self.options.max_in_flight)  # packed values held
        self._cpu: ThreadPoolExecutor | None = None
        self._stragglers = Stragglers()  # reads a call stopped waiting for (read_timeout)
        # whole objects of a local filesystem are read into these (one byte more than a
        # valid object holds, so a longer one shows as such)
        self._buffers = ReadBuffers(self.value_bytes + 1, 2 * self.options.max_in_flight)
        self._next_scan = math.inf

    @property
    def namespace(self) -> str:
        """The path below which this layout's objects live (without the protocol)."""
        return f"{self._store.root}/{self._fingerprint.hex()}"

    @property
    def io_counters(self) -> IOCounters:
        """What the requests to the store went through: retries, timeouts, refusals."""
        return self._store.counters

    def store_health(self) -> StoreHealth:
        # docstring inherited
        return health_of(self._store.breaker, self._store.counters)

    # -- lifecycle ---------------------------------------------------------------------

    async def _open(self) -> None:
        # docstring inherited
        await self._store.open()
        if self.layout.chunk_bytes >= _OFFLOAD_BYTES:
            self._cpu = ThreadPoolExecutor(4, thread_name_prefix=f"kvtiers-remote-{self.name}")
        # NOTE: no retries at open, so an unreachable store delays it by one timeout at most.
        await self._scan(retries=0)

    async def _close(self) -> None:
        # docstring inherited
        try:
            await self._stragglers.drain()
            if self._log.dirty and self._store.available:
                await self._write_log()
        except StoreUnavailable as exc:  # the next scan of another process does without
            logger.warning("kvtiers: remote tier %r: access log not written: %s", self.name, exc)
        finally:
            await self._store.close()
            if self._cpu is not None:
                await asyncio.to_thread(self._cpu.shutdown, wait=True)

    # -- the contract ------------------------------------------------------------------

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        _check_keys(keys)
        if not keys:
            return []
        if not self._store.available:
            self.counters.unavailable += 1
            return [False] * len(keys)
        if self._list_for_contains(len(keys)):
            return await self._contains_by_listing(keys)
        infos, late = await self._stragglers.within(
            self._store.read_timeout, [self._info(key) for key in keys], False
        )
        self.counters.fail(late, timed_out=True)
        now = self.clock()
        for key, info in zip(keys, infos, strict=True):
            if info is None:
                self._catalog.remove(key)
            elif isinstance(info, dict) and key not in self._catalog:
                self._catalog.add(key, int(info.get("size") or self.value_bytes), now)
        return [bool(info) for info in infos]

    def _list_for_contains(self, num_keys: int) -> bool:
        """Return whether one listing answers `num_keys` keys faster than HEAD requests.

        It does on an object store when one listing page (1000 objects) holds every object
        the capacity allows, and the keys need more than one round of requests in flight.
        """
        return (
            self._store.is_object_store
            and self.capacity_bytes // self.value_bytes <= _LIST_PAGE
            and num_keys > self.options.max_in_flight
        )

    async def _contains_by_listing(self, keys: Sequence[ChunkKey]) -> list[bool]:
        try:
            listing = await scan(self._store, self.namespace, logs=False)
        except StoreUnavailable as exc:
            self.counters.fail(timed_out=exc.timed_out)
            return [False] * len(keys)
        now = self.clock()
        for key in keys:
            obj = listing.objects.get(key)
            if obj is None:
                self._catalog.remove(key)
            elif key not in self._catalog:
                self._catalog.add(key, obj.size, now)
        return [key in listing.objects for key in keys]

    async def _info(self, key: ChunkKey) -> dict[str, Any] | None | bool:
        """Return the object's details, `None` if it is missing, `False` if unknown."""
        try:
            return await self._store.info(object_path(self.namespace, key))
        except StoreUnavailable as exc:
            self.counters.fail(timed_out=exc.timed_out)
            return False

    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        _check_keys(keys)
        self._check_buffers(keys, dsts)
        if not keys or not self._store.available:
            self.counters.misses += len(keys)
            self.counters.unavailable += bool(keys)
            return [False] * len(keys)
        deadline = time.monotonic() + self._store.read_timeout

        async def judge(i: int, raw: bytes | memoryview | None) -> tuple[Verdict | None, int]:
            found = await self._judge(keys[i], raw, dsts[i])
            if isinstance(raw, memoryview) and isinstance(raw.obj, np.ndarray):
                self._buffers.give(raw.obj)  # copied out: the buffer is free again
            return found

        # Each object is verified and copied as it arrives, while the others are in flight.
        paths = [object_path(self.namespace, key) for key in keys]
        hint = (
            self._store.reads_into
            and self.value_bytes >= HINT_MIN_BYTES
            and self.options.max_in_flight < HINT_AHEAD
        )
        fetches = [
            self._fetch(key, path, ahead_of(paths, i) if hint else ())
            for i, (key, path) in enumerate(zip(keys, paths, strict=True))
        ]
        found, late = await self._stragglers.as_they_come(
            self._store.read_timeout, fetches, judge, _NOT_READ
        )
        self.counters.fail(late, timed_out=True)
        hits = [verdict is Verdict.OK for verdict, _ in found]
        await self._after_read(keys, found, deadline)
        self.counters.bytes_read += sum(hits) * self.layout.chunk_bytes
        return hits

    async def _judge(
        self, key: ChunkKey, raw: bytes | memoryview | None, dst: Buffer
    ) -> tuple[Verdict | None, int]:
        """Check one object read and copy it into `dst`; its verdict (`None`: none) and size."""
        if raw is None:
            return None, 0
        return await self._offload(self._check_and_copy, key, raw, dst), len(raw)

    async def _fetch(
        self, key: ChunkKey, path: str | None = None, ahead: Sequence[str] = ()
    ) -> bytes | memoryview | None:
        """Read one object whole (`ahead`: local objects to hint to the kernel first)."""
        path = path or object_path(self.namespace, key)
        raw: bytes | memoryview | None
        try:
            # NOTE: one byte more than a valid object holds, so a longer one shows as such.
            if self._store.reads_into:
                read = await self._store.read_into(path, self._buffers.take, ahead)
                raw = None if read is None else read[0].data[: read[1]]
            else:
                raw = await self._store.cat(path, self.value_bytes + 1)
        except StoreUnavailable as exc:
            self.counters.fail(timed_out=exc.timed_out)
            return None
        if raw is None:
            self._catalog.remove(key)
        return raw

    def _check_and_copy(self, key: ChunkKey, raw: bytes | memoryview, dst: Buffer) -> Verdict:
        verdict, payload = self._check(key, raw)
        if payload is not None:  # verified before a byte reaches the destination
            np.copyto(dst, np.frombuffer(payload, np.uint8).reshape(dst.shape))
        return verdict

    async def _after_read(
        self,
        keys: Sequence[ChunkKey],
        found: Sequence[tuple[Verdict | None, int]],
        deadline: float = math.inf,
    ) -> None:
        """Count a batch's reads, record its hits' recency, delete its bad objects.

        The deletes are waited for until `deadline` (`time.monotonic()`), then left to run.
        """
        now = self.clock()
        hit_keys, bad = [], []
        for key, (verdict, size) in zip(keys, found, strict=True):
            if verdict is Verdict.OK:
                hit_keys.append(key)
                if key not in self._catalog:
                    self._catalog.add(key, size, now)
            elif verdict is not None:
                bad.append(key)
                self.counters.corrupt += verdict in (Verdict.CORRUPT, Verdict.FORGED)
                self.counters.forged += verdict is Verdict.FORGED
                self.counters.foreign += verdict is Verdict.FOREIGN
        self.counters.hits += len(hit_keys)
        self.counters.misses += len(keys) - len(hit_keys)
        self._catalog.touch(hit_keys, now)
        self._log.record(hit_keys, now)
        if bad:
            budget = max(0.0, deadline - time.monotonic())
            await self._stragglers.within(budget, [self._delete_objects(bad)], [])

    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        _check_keys(keys)
        self._check_buffers(keys, srcs)
        if not keys:
            return []
        async with self._write_lock:
            if time.monotonic() >= self._next_scan:
                await self._scan()
            if not self._store.available:
                self._store.counters.dropped_writes += len(keys)
                self.counters.declined += len(keys)
                self.counters.unavailable += 1
                return [False] * len(keys)
            return await self._put_batch(keys, srcs)

    async def _put_batch(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        srcs_by_key = dict(zip(keys, srcs, strict=True))
        kept: list[ChunkKey] = []
        new: list[ChunkKey] = []
        held, full = 0, False
        for key in srcs_by_key:
            size = self._catalog.size_of(key)
            if size is None:
                # NOTE: once a chunk does not fit, no deeper chunk is stored without it.
                full = full or held + self.value_bytes > self.capacity_bytes
                if full:
                    continue
                new.append(key)
                size = self.value_bytes
            else:
                kept.append(key)
            held += size
        need = len(new) * self.value_bytes
        victims = self._catalog.victims(need, self.capacity_bytes, keep=set(srcs_by_key))
        await self._evict(victims)
        while new and self._catalog.used_bytes + len(new) * self.value_bytes > self.capacity_bytes:
            new.pop()  # what is left is held by this batch or could not be deleted
        now = self.clock()
        written = await gather_all(self._put_one(k, srcs_by_key[k], now) for k in new)
        stored = [key for key, ok in zip(new, written, strict=True) if ok]
        held_keys = {*kept, *stored}
        held_order = [k for k in srcs_by_key if k in held_keys]  # prefix first
        self._catalog.touch(held_order, now)
        self._log.record(held_order, now)
        self.counters.puts += len(stored)
        self.counters.bytes_written += len(stored) * self.layout.chunk_bytes
        self.counters.declined += len(srcs_by_key) - len(held_keys)
        return [key in held_keys for key in keys]

    async def _put_one(self, key: ChunkKey, src: Buffer, now: float) -> bool:
        async with self._put_slots:
            value = await self._offload(self._pack, key, src)

            def stored() -> None:
                self._catalog.add(key, len(value), now)

            try:
                await self._store.write(object_path(self.namespace, key), value, stored)
            except StoreUnavailable as exc:
                self.counters.fail(timed_out=exc.timed_out)
                self._store.counters.dropped_writes += 1
                return False
            return True

    def _pack(self, key: ChunkKey, src: Buffer) -> bytes:
        payload = np.ascontiguousarray(src).reshape(-1)
        return fmt.pack_value(
            self._fingerprint,
            key,
            payload.data,
            num_layers=self.layout.num_layers,
            auth_key=self._auth_key,
        )

    async def delete(self, keys: Sequence[ChunkKey]) -> None:
        # docstring inherited
        self._ensure_open()
        _check_keys(keys)
        if keys:
            await self._delete_objects(keys)

    async def _delete_objects(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete the objects of `keys`; return, for each, whether the catalog held it."""
        return await gather_all(self._delete_one(key) for key in keys)

    async def _evict(self, victims: Sequence[bytes]) -> None:
        """Delete `victims` to make room, counting and remembering those that went."""
        done = await self._delete_objects(victims)
        gone = [key for key, ok in zip(victims, done, strict=True) if ok]
        self.counters.evictions += len(gone)
        self._note_evicted(gone)

    async def _delete_one(self, key: bytes) -> bool:
        try:
            await self._store.rm(object_path(self.namespace, key))
        except StoreUnavailable as exc:
            self.counters.fail(timed_out=exc.timed_out)
            return False
        self._log.forget([key])
        return self._catalog.remove(key)

    def usage(self) -> TierUsage:
        """Return the capacity and the objects this process knows of (see the class doc)."""
        return TierUsage(self.capacity_bytes, self._catalog.used_bytes, len(self._catalog))

    # -- layer-wise reads --------------------------------------------------------------

    async def get_layers(
        self, keys: Sequence[ChunkKey], layers: Sequence[int], dsts: Sequence[Buffer]
    ) -> list[bool]:
        """Fill only `layers` of each destination, reading them as byte ranges.

        The header and each run of consecutive layers are one range each (`cat_ranges`);
        the header is checked and each layer verified by its own checksum before a byte
        reaches the destination. A chunk whose ranged read does not verify is read whole
        and judged like `get` (a bad object is deleted and counted).

        Args:
            keys: the chunks.
            layers: layer indices, the same for every chunk.
            dsts: full chunk buffers, as for `get`; bytes of other layers are left alone.

        Returns:
            For each key, whether its layers were delivered.

        Raises:
            InvalidInputError: a layer index is out of range or repeated, or a buffer is not
                one chunk.
        """
        self._ensure_open()
        _check_keys(keys)
        self._check_buffers(keys, dsts)
        plan = LayerPlan.make(layers, self.layout, self._header_len)
        if not keys or not self._store.available:
            self.counters.misses += len(keys)
            self.counters.unavailable += bool(keys)
            return [False] * len(keys)
        deadline = time.monotonic() + self._store.read_timeout
        got, late = await self._stragglers.within(
            self._store.read_timeout, [self._read_layers(key, plan) for key in keys], None
        )
        self.counters.fail(late, timed_out=True)
        found = await gather_all(
            self._deliver_layers(k, g, plan, d) for k, g, d in zip(keys, got, dsts, strict=True)
        )
        await self._after_read(keys, found, deadline)
        hits = [verdict is Verdict.OK for verdict, _ in found]
        self.counters.bytes_read += sum(hits) * len(plan.layers) * self.layout.layer_bytes
        return hits

    async def _read_layers(
        self, key: ChunkKey, plan: LayerPlan
    ) -> Pieces | bytes | memoryview | None:
        """Read one object's layers of `plan`, verified, or else the whole object.

        The whole object is read when the ranges do not verify (it is then judged as `get`
        judges it) or when integrity is on (a tag covers the whole payload). `None`: no
        object, or the store failed.
        """
        if self._auth_key is None:
            try:
                parts = await self._store.cat_ranges(
                    object_path(self.namespace, key), list(plan.ranges)
                )
            except StoreUnavailable as exc:
                self.counters.fail(timed_out=exc.timed_out)
                return None
            if parts is None:
                self._catalog.remove(key)
                return None
            pieces = plan.verify(parts, fingerprint=self._fingerprint, key=key)
            if pieces is not None:
                return pieces
        return await self._fetch(key)

    async def _deliver_layers(
        self, key: ChunkKey, got: Pieces | bytes | memoryview | None, plan: LayerPlan, dst: Buffer
    ) -> tuple[Verdict | None, int]:
        """Copy what `_read_layers` returned into `dst`; its verdict and object size."""
        if got is None:
            return None, 0
        if isinstance(got, bytes | memoryview):
            return await self._offload(self._check_and_copy_layers, key, got, plan, dst)
        await self._offload(write_layers, dst, got, self.layout.num_layers)
        return Verdict.OK, self.value_bytes

    def _check(self, key: ChunkKey, raw: bytes | memoryview) -> tuple[Verdict, memoryview | None]:
        return fmt.check_value(
            raw,
            fingerprint=self._fingerprint,
            key=key,
            payload_len=self.layout.chunk_bytes,
            auth_key=self._auth_key,
        )

    def _check_and_copy_layers(
        self, key: ChunkKey, raw: bytes | memoryview, plan: LayerPlan, dst: Buffer
    ) -> tuple[Verdict, int]:
        verdict, payload = self._check(key, raw)
        if payload is not None:
            write_layers(dst, plan.from_payload(payload), self.layout.num_layers)
        return verdict, len(raw)

    # -- scans -------------------------------------------------------------------------

    async def scan_now(self) -> None:
        """Scan the namespace now: refresh usage, expire by TTL, evict over the capacity.

        Also writes this process's access log. A store failure leaves things as they were.
        """
        self._ensure_open()
        async with self._write_lock:
            await self._scan()

    async def _scan(self, retries: int | None = None) -> None:
        interval = self.options.scan_interval * random.uniform(0.9, 1.1)  # nodes drift apart
        self._next_scan = time.monotonic() + interval if interval > 0 else math.inf
        now = self.clock()
        try:
            if self._log.dirty:
                await self._write_log()
            listing = await scan(self._store, self.namespace, self._log, retries=retries)
        except StoreUnavailable as exc:
            logger.warning("kvtiers: remote tier %r: scan skipped: %s", self.name, exc)
            return
        if self.options.ttl is not None:
            self._log.prune(now - self.options.ttl)
        doomed = self._doomed(listing, now)
        if doomed:
            await gather_all(self._rm_quietly(path) for path in doomed)
            expired = [o.key for o in listing.objects.values() if o.path in doomed]
            self.counters.evictions += len(expired)
            self._note_evicted(expired)
            self._log.forget(expired)
        self._catalog.reset(o for o in listing.objects.values() if o.path not in doomed)
        await self._evict(self._catalog.victims(0, self.capacity_bytes, keep=set()))

    def _doomed(self, listing: Listing, now: float) -> set[str]:
        """Return the paths a scan deletes: expired objects, stale temporaries and logs."""
        ttl = self.options.ttl
        doomed = {p for p, t in listing.temps.items() if t < now - _TEMP_AGE}
        own = self._log_path()
        horizon = max(ttl or 0.0, _LOG_AGE)
        doomed.update(p for p, t in listing.access_logs.items() if t < now - horizon and p != own)
        if ttl is not None:
            doomed.update(o.path for o in listing.objects.values() if o.last_access < now - ttl)
        return doomed

    async def _rm_quietly(self, path: str) -> None:
        try:
            await self._store.rm(path)
        except StoreUnavailable as exc:
            self.counters.fail(timed_out=exc.timed_out)

    def _log_path(self) -> str:
        return f"{self.namespace}/{ACCESS_DIR}/{self._writer_id}"

    async def _write_log(self) -> None:
        self._log.dirty = False
        try:
            await self._store.write(self._log_path(), self._log.encode(), lambda: None)
        except BaseException:
            self._log.dirty = True
            raise

    # -- helpers -----------------------------------------------------------------------

    async def _offload(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run CPU work on a chunk (checksum, copy) off the loop when chunks are large.

        On cancellation the work is waited for, so nothing touches a caller's buffer later.
        """
        if self._cpu is None:
            return fn(*args)
        fut = asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait({fut})
            raise


def _check_keys(keys: Sequence[ChunkKey]) -> None:
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidInputError(f"keys[{i}]: expected a {KEY_BYTES}-byte key, got {key!r:.60}")
