"""The remote tier: one object per chunk in any fsspec store, pooled by every node.

Objects live under `<url>/<layout fingerprint hex>/<key[:2] hex>/<key hex>` and hold a chunk
in the lmdb tier's format (`_chunk_format`) with per-layer checksums added, so that
`get_layers` can read and verify the header and some layers as byte ranges.

Writes are whole or absent for readers: object stores (s3fs, gcsfs, ...) make a PUT visible
at once, complete, and the last of two concurrent PUTs of one key wins; on filesystems
without that (local) the object is written under a temporary name and renamed, which POSIX
makes atomic. Two processes writing one chunk therefore leave one valid object.

Eviction is least recently used by last access, by the tier itself (`manages_eviction`): no
single process sees every read. Each process keeps a catalog of the objects it knows
(filled by a scan: one listing of the namespace plus every process's access log, see
`_remote_catalog`, `_remote_access`) and evicts from it when a `put` would exceed the
capacity. Objects written cold (`put_hinted`: no reuse expected) go first, in every
process, until someone reads them, and take room only from other cold objects. Scans run at
open and then at most every `scan_interval` seconds, from `put` (the background write path,
never a load); a scan also deletes objects idle for longer than `ttl`, and evicts what
other processes' writes pushed over the capacity. A listing alone would only know writes; a
shared index object would need read-modify-write across nodes, which object stores cannot
do safely, so each process writes only its own small access log.

While the store fails, a circuit breaker (`_remote_breaker`, applied by `_remote_requests`)
turns every call into misses at once, and `put` drops its chunks (counted); nothing raises
into the caller. While it is merely slow, a read call ends by `read_timeout` with misses for
what has not arrived (`_remote_deadline`); a store out of space declines writes and goes
on serving reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np

from kvtiers.core.config import TierConfig
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import StoreHealth, TierUsage
from kvtiers.tiers import _layout_record as layout_record
from kvtiers.tiers._chunk_format import Verdict
from kvtiers.tiers._pool_guard import check_keys
from kvtiers.tiers._read_buffers import ReadBuffers
from kvtiers.tiers._readahead import HINT_AHEAD, HINT_MIN_BYTES, ahead_of
from kvtiers.tiers._remote_access import AccessLog
from kvtiers.tiers._remote_breaker import IOCounters, StoreUnavailable, gather_all, health_of
from kvtiers.tiers._remote_catalog import Catalog, object_path
from kvtiers.tiers._remote_codec import ObjectCodec
from kvtiers.tiers._remote_io import ObjectStore
from kvtiers.tiers._remote_layers import LayerPlan
from kvtiers.tiers._remote_objects import ChunkObjects
from kvtiers.tiers._remote_options import RemoteOptions
from kvtiers.tiers._remote_scans import Scanner
from kvtiers.tiers.base import Buffer, Tier

__all__ = ["RemoteOptions", "RemoteTier"]

logger = logging.getLogger("kvtiers")

_NOT_READ: tuple[Verdict | None, int] = (None, 0)  # the verdict and size of an object not read
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
        self._codec = ObjectCodec(config, layout)
        self.value_bytes = self._codec.value_bytes
        """Bytes of one stored object (header and payload)."""
        self.clock: Callable[[], float] = time.time
        """Wall-clock seconds for recency and TTL (shared with other nodes, so not monotonic)."""
        self._store = ObjectStore(self.options, self.name)
        self._catalog = Catalog()
        self._log = AccessLog()
        self._write_lock = asyncio.Lock()  # one put batch or scan at a time: exact accounting
        # whole objects of a local filesystem are read into these (one byte more than a
        # valid object holds, so a longer one shows as such)
        self._buffers = ReadBuffers(self.value_bytes + 1, 2 * self.options.max_in_flight)
        self._objects = ChunkObjects(
            self._store, self._codec, self._catalog, self._log, self.counters, self._buffers
        )
        self._stragglers = self._objects.stragglers  # requests a call stopped waiting for
        self._scanner = Scanner(self._store, self._log, self.options, self.counters, self.name)

    @property
    def namespace(self) -> str:
        """The path below which this layout's objects live (without the protocol)."""
        return self._objects.namespace

    def object_files(self, keys: Sequence[ChunkKey]) -> list[str] | None:
        """Return the files of `keys`' objects; `None` unless the store is a local filesystem."""
        if not self._store.local:
            return None
        return [object_path(self.namespace, key) for key in keys]

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
        self._codec.open(self.name)
        # NOTE: no retries at open, so an unreachable store delays it by one timeout at most.
        await self._scan(retries=0)
        await self._note_layout()

    async def _note_layout(self) -> None:
        """Write the namespace's layout record (see `_layout_record`) unless it is there."""
        if not self._store.available:
            return
        path = f"{self.namespace}/{layout_record.REMOTE_NAME}"
        try:
            if await self._store.cat(path) is None:
                await self._store.write(path, layout_record.encode(self.layout), lambda: None)
        except (StoreUnavailable, NotImplementedError, OSError) as exc:  # a label: no harm
            logger.info("kvtiers: remote tier %r: layout record not written: %s", self.name, exc)

    async def _close(self) -> None:
        # docstring inherited
        # NOTE: a scan or put batch in flight ends first: a scan's own log write would
        # otherwise fail on the closed store after this one was skipped as not dirty.
        async with self._write_lock:
            try:
                await self._stragglers.drain()
                if self._log.dirty and self._store.available:
                    await self._scanner.write_log(self.namespace)
            except StoreUnavailable as exc:  # the next scan of another process does without
                logger.warning(
                    "kvtiers: remote tier %r: access log not written: %s", self.name, exc
                )
            finally:
                await self._store.close()
                await self._codec.close()

    # -- the contract ------------------------------------------------------------------

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        check_keys(keys)
        if not keys:
            return []
        if not self._store.available:
            self.counters.unavailable += 1
            return [False] * len(keys)
        if self._list_for_contains(len(keys)):
            return await self._scanner.contains(self.namespace, keys, self._catalog, self.clock)
        since = self._catalog.changes
        infos, late = await self._stragglers.within(
            self._store.read_timeout, [self._objects.info(key) for key in keys], False
        )
        self.counters.fail(late, timed_out=True)
        known = [(key, info) for key, info in zip(keys, infos, strict=True) if info is not False]
        sizes = [
            int(i.get("size") or self.value_bytes) if isinstance(i, dict) else None
            for _, i in known
        ]
        self._catalog.learn([key for key, _ in known], sizes, self.clock(), since)
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

    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        check_keys(keys)
        self._check_buffers(keys, dsts)
        if not keys or not self._store.available:
            self.counters.misses += len(keys)
            self.counters.unavailable += bool(keys)
            return [False] * len(keys)
        deadline = time.monotonic() + self._store.read_timeout
        since = self._catalog.changes

        async def judge(i: int, raw: bytes | memoryview | None) -> tuple[Verdict | None, int]:
            found = await self._codec.judge(keys[i], raw, dsts[i])
            if isinstance(raw, memoryview) and isinstance(raw.obj, np.ndarray):
                self._buffers.give(raw.obj)  # copied out: the buffer is free again
            return found

        # Each object is verified and copied as it arrives, while the others are in flight.
        paths = [object_path(self.namespace, key) for key in keys]
        hint = (
            self._store.local
            and self.value_bytes >= HINT_MIN_BYTES
            and self.options.max_in_flight < HINT_AHEAD
        )
        fetches = [
            self._objects.fetch(key, path, ahead_of(paths, i) if hint else ())
            for i, (key, path) in enumerate(zip(keys, paths, strict=True))
        ]
        found, late = await self._stragglers.as_they_come(
            self._store.read_timeout, fetches, judge, _NOT_READ
        )
        self.counters.fail(late, timed_out=True)
        hits = [verdict is Verdict.OK for verdict, _ in found]
        await self._objects.after_read(keys, found, self.clock(), since, deadline)
        self.counters.bytes_read += sum(hits) * self.layout.chunk_bytes
        return hits

    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        return await self.put_hinted(keys, srcs, ())

    async def put_hinted(
        self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer], cold: Collection[ChunkKey]
    ) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        check_keys(keys)
        self._check_buffers(keys, srcs)
        if not keys:
            return []
        async with self._write_lock:
            if self._scanner.due():
                await self._scan()
            if not self._store.available:
                self._store.counters.dropped_writes += len(keys)
                self.counters.declined += len(keys)
                self.counters.unavailable += 1
                return [False] * len(keys)
            return await self._put_batch(keys, srcs, frozenset(cold))

    async def _put_batch(
        self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer], cold: frozenset[bytes]
    ) -> list[bool]:
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
        # NOTE: a cold object takes room only from free space and other cold objects.
        num_cold = sum(1 for key in new if key in cold)
        need, cold_need = (len(new) - num_cold) * self.value_bytes, num_cold * self.value_bytes
        victims = self._catalog.victims(need, self.capacity_bytes, set(srcs_by_key), cold_need)
        await self._evict(victims)
        while new and self._catalog.used_bytes + len(new) * self.value_bytes > self.capacity_bytes:
            new.pop()  # what is left is held by this batch or could not be deleted
        now = self.clock()
        written = await gather_all(self._objects.write(k, srcs_by_key[k], now) for k in new)
        stored = [key for key, ok in zip(new, written, strict=True) if ok]
        held_keys = {*kept, *stored}
        parked = [k for k in stored if k in cold]  # prefix first, as all orders here
        unparked = held_keys.difference(parked)
        warm = [k for k in srcs_by_key if k in unparked]
        self._catalog.touch(warm, now)
        self._log.record(warm, now)
        self._catalog.park(parked, now)
        self._log.park(parked, now)
        self.counters.puts += len(stored)
        self.counters.bytes_written += len(stored) * self.layout.chunk_bytes
        self.counters.declined += len(srcs_by_key) - len(held_keys)
        self.counters.cold_puts += len(parked)
        return [key in held_keys for key in keys]

    async def delete(self, keys: Sequence[ChunkKey]) -> None:
        # docstring inherited
        self._ensure_open()
        check_keys(keys)
        if keys:
            await self._objects.delete(keys)

    async def _evict(self, victims: Sequence[bytes]) -> None:
        """Delete `victims` to make room, counting and remembering those that went."""
        done = await self._objects.delete(victims)
        gone = [key for key, ok in zip(victims, done, strict=True) if ok]
        self.counters.evictions += len(gone)
        self._note_evicted(gone)

    def usage(self) -> TierUsage:
        """Return the capacity and the objects this process knows of (see the class doc)."""
        return TierUsage(self.capacity_bytes, self._catalog.used_bytes, len(self._catalog))

    # -- layer-wise reads --------------------------------------------------------------

    @property
    def layer_reads(self) -> bool:
        """Whether `get_layers` reads byte ranges (`layer_reads`; never with integrity)."""
        wanted = self.options.layer_reads
        return (self._store.local if wanted is None else wanted) and self._codec.auth_key is None

    def explain_lines(self) -> list[str]:
        """Return what `kvtiers explain` shows of this tier beyond its config."""
        why = "the option" if self.options.layer_reads is not None else "the default here"
        state = "on: layer-wise loads read waves of layers" if self.layer_reads else "off"
        return [f"  layer reads {state} ({why}; see layer_reads)"]

    async def get_layers(
        self,
        keys: Sequence[ChunkKey],
        layers: Sequence[int],
        dsts: Sequence[Buffer],
        *,
        tally: bool = True,
    ) -> list[bool]:
        """Fill only `layers` of each destination, reading them as byte ranges.

        The header and each run of consecutive layers are one range each (`cat_ranges`);
        the header is checked and each layer verified by its own checksum before a byte
        reaches the destination. A chunk whose ranged read does not verify is read whole
        and judged like `get` (a bad object is deleted and counted). Arguments as for
        `Tier.get_layers`.
        """
        self._ensure_open()
        check_keys(keys)
        self._check_buffers(keys, dsts)
        plan = LayerPlan.make(layers, self.layout, self._codec.header_len)
        if not keys or not self._store.available:
            self.counters.misses += len(keys)
            self.counters.unavailable += bool(keys)
            return [False] * len(keys)
        hits = await self._objects.get_layers(keys, plan, dsts, self.clock, tally=tally)
        self.counters.bytes_read += sum(hits) * len(plan.layers) * self.layout.layer_bytes
        return hits

    # -- scans -------------------------------------------------------------------------

    async def scan_now(self) -> None:
        """Scan the namespace now: refresh usage, expire by TTL, evict over the capacity.

        Also writes this process's access log. A store failure leaves things as they were.
        """
        self._ensure_open()
        async with self._write_lock:
            await self._scan()

    async def discard_access_log(self) -> bool:
        """Forget what this process read and wrote, and delete its access log.

        For a visit that must leave no trace in the pool (`kvtiers bench`, its own chunks
        deleted): the log is otherwise written at close. Other processes' logs stay.
        Returns `False` when the store failed (the log then goes once idle for a day).
        """
        self._ensure_open()
        async with self._write_lock:
            return await self._scanner.discard_log(self.namespace)

    async def _scan(self, retries: int | None = None) -> None:
        now, since = self.clock(), self._catalog.changes
        sweep = await self._scanner.sweep(self.namespace, now, retries=retries)
        if sweep is None:
            return  # the store failed (logged): things stay as they were
        self.counters.evictions += len(sweep.expired)
        self._note_evicted(sweep.expired)
        self._catalog.reset(sweep.kept, since)
        await self._evict(self._catalog.victims(0, self.capacity_bytes, keep=set()))
