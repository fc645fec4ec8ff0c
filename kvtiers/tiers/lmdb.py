"""The lmdb tier: chunks in one LMDB environment shared by processes."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import lmdb

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import CacheStateError, TierIOError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierUsage
from kvtiers.tiers import _lmdb_format as fmt
from kvtiers.tiers._cancellation import wait_out
from kvtiers.tiers._chunk_format import count_verdicts
from kvtiers.tiers._integrity import auth_key_from_config
from kvtiers.tiers._layers import check_layers
from kvtiers.tiers._lmdb_format import Databases, Writer
from kvtiers.tiers._lmdb_gate import MapGate, map_size_over, reader_pins_pages
from kvtiers.tiers._lmdb_health import WriteHealth
from kvtiers.tiers._lmdb_options import LMDBOptions, MapSizes, open_env, writemap_hint
from kvtiers.tiers._lmdb_reads import (
    ValueReader,
    keys_present,
    keys_present_now,
    read_parts,
    run_jobs,
    usage_now,
)
from kvtiers.tiers._lmdb_txns import WriteTransactions
from kvtiers.tiers._lmdb_writes import Stored, ValuePacker, store_new
from kvtiers.tiers.base import Buffer, Tier, check_keys

__all__ = ["LMDBOptions", "LMDBTier"]

_T = TypeVar("_T")
_INLINE_KEYS = 64  # a `contains` of this many keys at most runs on the event loop
logger = logging.getLogger("kvtiers")


class LMDBTier(Tier):
    """A tier in one LMDB environment on local disk, shared by processes.

    Several processes may open the same `path` at once; LMDB's locks serialize their writers.
    Because no single process's policy sees every entry, the tier evicts by capacity itself,
    least recently used first, with a chain's deepest chunk before its prefix. LMDB calls that
    can block run in a pool of `read_threads` threads; a batch of large values is read in
    parts across it, and a batch's writes are one transaction, all or nothing.

    `used_bytes` counts whole stored values (header and payload), so it matches the disk.

    Args:
        config: capacity, eviction (only `"lru"`) and the options of `LMDBOptions`.
        layout: the KV layout of the chunks it holds.

    Raises:
        ConfigError: an option is invalid, or the capacity cannot hold one chunk.
    """

    kind = "lmdb"
    shared = True
    manages_eviction = True

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self.options = LMDBOptions.from_config(config)
        self._fingerprint = layout.fingerprint
        self._auth_key = auth_key_from_config(config)
        self._reader = ValueReader(layout, self._auth_key)
        sizes = MapSizes.of(config, self.options, layout, tagged=self._auth_key is not None)
        self._value_len, self.map_size = sizes.value_len, sizes.map_size
        self._gate: MapGate | None = None  # begins every transaction of the open environment
        self._dbs: Databases | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards counters and _limit across the pool's threads
        self._packer = ValuePacker(self._fingerprint, self._value_len, self._auth_key)
        self._last_usage = TierUsage(self.capacity_bytes, 0, 0)  # reported while not open
        self._limit = sizes.limit
        """Bytes of values held at most: the capacity, or less where the map is smaller."""
        self._health = WriteHealth(self.name, self.options.path)
        self._txns = WriteTransactions(
            self.name, self._handles, lambda: self._limit, self._committed
        )
        # NOTE: a batch is split into no more parts than there are cores, and a batch of
        # small values not at all (`read_parts`): the threads' Python work contends for the
        # interpreter lock. More threads still serve concurrent calls.
        self._parts = max(1, min(self.options.read_threads, os.cpu_count() or 1))

    async def _open(self) -> None:
        # docstring inherited
        pool = ThreadPoolExecutor(self.options.read_threads, f"kvtiers-lmdb-{self.name}")
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(pool, self._open_env)
        try:
            env, self._dbs = await asyncio.shield(fut)
        except BaseException:
            await wait_out({fut})
            if not fut.cancelled() and fut.exception() is None:
                fut.result()[0].close()  # opened after all, but this open was cancelled
            pool.shutdown(wait=False)
            raise
        self._gate = MapGate(env, self.map_size, self.options.writemap)
        self._pool = pool

    def _open_env(self) -> tuple[lmdb.Environment, Databases]:
        """Open the environment, mapping at least its file (see `map_size_over`)."""
        data = os.path.join(self.options.path, "data.mdb")
        size = os.path.getsize(data) if os.path.isfile(data) else 0
        map_size = map_size_over(self.map_size, size, self.options.writemap)
        return open_env(self.options, map_size, self.name, self.layout)

    def _handles(self) -> tuple[MapGate, Databases]:
        if self._gate is None or self._dbs is None:
            raise CacheStateError(f"tier {self.name!r} is not open")
        return self._gate, self._dbs

    async def _close(self) -> None:
        # docstring inherited
        await asyncio.to_thread(self._close_env)

    def _close_env(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        try:
            if self._txns.touched:  # recency that reads recorded since the last write
                self._txns.write(lambda w: None, threading.Event())
        except lmdb.Error as exc:  # a full or failing disk: recency is only a hint
            logger.warning(
                "kvtiers: lmdb tier %r: recency of recent reads not saved at close: %s",
                self.name,
                exc,
            )
        finally:
            if self._gate is not None:
                self.usage()  # remembered for stats taken after close
                self._gate.close()
            self._gate = self._dbs = None

    async def _run(self, jobs: Sequence[Callable[[threading.Event], _T]]) -> list[_T]:
        """Run blocking `jobs` in the pool and return their results (see `run_jobs`)."""
        return await run_jobs(self._pool, jobs, self.name, self.options.path)

    def _committed(self, evicted: list[bytes], unparked: int) -> None:
        """Count what a committed write evicted, and the cold chunks its reads found."""
        with self._lock:
            self.counters.evictions += len(evicted)
            self.counters.cold_hits += unparked
        self._note_evicted(evicted)

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        check_keys(keys)
        if len(keys) <= _INLINE_KEYS:  # on the loop, unless that could block
            gate, dbs = self._handles()
            if (found := keys_present_now(gate, dbs.seqs, keys)) is not None:
                return found
        return (await self._run([functools.partial(self._contains, keys)]))[0]

    def _contains(self, keys: Sequence[ChunkKey], cancel: threading.Event) -> list[bool]:
        gate, dbs = self._handles()
        # NOTE: `seqs` holds every stored key with a few bytes; asking `chunks` would fault
        # in each whole value (see `_lmdb_format`), a read from the disk when it is cold.
        with gate.begin(db=dbs.seqs) as txn:
            return keys_present(txn, keys)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        # docstring inherited
        # Kept in memory like a read's hits; the next write transaction records it first.
        if keys:
            self._txns.touched.add(keys)

    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        return await self._get(keys, dsts, None, tally=True)

    async def get_layers(
        self,
        keys: Sequence[ChunkKey],
        layers: Sequence[int],
        dsts: Sequence[Buffer],
        *,
        tally: bool = True,
    ) -> list[bool]:
        """Fill only `layers` of each destination, each value checked whole first.

        NOTE: not `layer_reads`: py-lmdb faults in every page of a value it returns, so a
        read of some layers costs a read of them all (cold, layer 0 of eight 8 MiB values
        took 30-40 ms against 50-57 ms for the whole values). Arguments as for
        `Tier.get_layers`.
        """
        return await self._get(keys, dsts, check_layers(layers, self.layout.num_layers), tally)

    async def _get(
        self,
        keys: Sequence[ChunkKey],
        dsts: Sequence[Buffer],
        layers: tuple[int, ...] | None,
        tally: bool,
    ) -> list[bool]:
        self._ensure_open()
        check_keys(keys)
        self._check_buffers(keys, dsts)
        parts = read_parts(len(keys), self.layout.chunk_bytes, self._parts)
        step = max(1, -(-len(keys) // parts))
        jobs = [
            functools.partial(self._read, keys[i : i + step], dsts[i : i + step], layers, tally)
            for i in range(0, len(keys), step)
        ]
        hits = [hit for part in await self._run(jobs) for hit in part]
        touched = [key for key, hit in zip(keys, hits, strict=True) if hit]
        # Kept in memory, so reads need no write transaction.
        if touched and self._txns.touched.add(touched):
            try:
                await self._run([functools.partial(self._txns.write, lambda w: None)])
            except TierIOError:  # a full or failing disk: recency is only a hint
                self._txns.touched.clear()
        return hits

    def _read(
        self,
        keys: Sequence[ChunkKey],
        dsts: Sequence[Buffer],
        layers: tuple[int, ...] | None,
        tally: bool,
        cancel: threading.Event,
    ) -> list[bool]:
        gate, dbs = self._handles()
        with gate.begin(db=dbs.chunks) as txn:
            hits, bad = self._reader.read_batch(txn, keys, dsts, layers, cancel)
        num_hits = sum(hits)
        read = self.layout.chunk_bytes if layers is None else len(layers) * self.layout.layer_bytes
        with self._lock:
            if tally:
                self.counters.hits += num_hits
                self.counters.misses += len(keys) - num_hits
            self.counters.bytes_read += num_hits * read
        if bad:
            self._txns.write(functools.partial(self._discard, bad), cancel)
        return hits

    def _discard(self, keys: Sequence[ChunkKey], writer: Writer) -> None:
        """Delete the entries under `keys` that still fail their check."""
        verdicts = writer.discard(
            keys, self._fingerprint, self.layout.chunk_bytes, auth_key=self._auth_key
        )
        with self._lock:
            count_verdicts(self.counters, verdicts)

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
        put = functools.partial(self._put, keys, srcs, frozenset(cold))
        return (await self._run([put]))[0]

    def _put(
        self,
        keys: Sequence[ChunkKey],
        srcs: Sequence[Buffer],
        cold: frozenset[bytes],
        cancel: threading.Event,
    ) -> list[bool]:
        def plan(writer: Writer) -> Stored:
            # NOTE: the limit is read as the transaction runs: a retry sees it lowered.
            return store_new(writer, keys, srcs, self._packer, self._limit, cold)

        try:
            done = self._txns.write_freeing_dead_readers(plan, cancel)
        except lmdb.MapFullError as exc:
            if reader_pins_pages(self._handles()[0].env):  # a long read, not a small map
                return self._write_failed(keys, exc, cancel)
            # NOTE: the map filled up before the capacity: free twice the batch's size, then
            # retry once. LMDB reuses the pages a transaction frees only two commits later
            # (it keeps the last two snapshots), hence the eviction's own commit and one more.
            # A map that fills up at all is smaller than the capacity assumes (another
            # process may share it with a larger capacity): hold less from now on.
            self._map_full()
            need = 2 * len(keys) * self._value_len
            try:
                # NOTE: even deletes need free pages (copy-on-write), so these can fail too.
                self._txns.write(lambda w: w.evict(need, set(keys), limit=w.used), cancel)
                self._txns.write(lambda w: None, cancel)
                done = self._txns.write(plan, cancel)
            except lmdb.MapFullError:
                present = self._contains(keys, cancel)
                with self._lock:
                    self.counters.declined += present.count(False)
                return present
            except lmdb.Error as exc:
                return self._write_failed(keys, exc, cancel)
        except lmdb.Error as exc:
            return self._write_failed(keys, exc, cancel)
        if done is None:  # cancelled: nothing was written, and the caller is gone
            return [False] * len(keys)
        if done.new:
            self._health.stored()
        with self._lock:
            self.counters.puts += done.new
            self.counters.bytes_written += done.new * self.layout.chunk_bytes
            self.counters.declined += done.declined
            self.counters.cold_puts += done.parked
        return [key in done.held for key in keys]

    def _write_failed(
        self, keys: Sequence[ChunkKey], exc: lmdb.Error, cancel: threading.Event
    ) -> list[bool]:
        """Decline a batch whose write failed (a full or failing disk); reads go on."""
        present = self._contains(keys, cancel)
        with self._lock:
            self.counters.errors += 1
            self.counters.declined += present.count(False)
        self._health.failed(exc)
        return present

    def _map_full(self) -> None:
        """Lower the limit below what the map held when it filled up."""
        gate, dbs = self._handles()
        with gate.begin() as txn:
            used = fmt.read_used_bytes(txn, dbs)
        with self._lock:
            self._limit = max(self._value_len, min(self._limit, used * 9 // 10))
        self._health.map_full(self.map_size, self._limit)

    async def delete(self, keys: Sequence[ChunkKey]) -> None:
        # docstring inherited
        self._ensure_open()
        check_keys(keys)
        if keys:
            remove = functools.partial(self._txns.write, lambda w: [w.remove(key) for key in keys])
            await self._run([remove])

    def usage(self) -> TierUsage:
        """Return the tier's capacity and what it holds (as last seen, once closed).

        What the environment cannot tell now (it is closing, or fails) is as last seen too.
        """
        if self._gate is not None and self._dbs is not None:
            now = usage_now(self._gate, self._dbs, self.capacity_bytes)
            self._last_usage = self._last_usage if now is None else now
        return self._last_usage

    def explain_lines(self) -> list[str]:
        """Return what `kvtiers explain` shows of this tier beyond its config."""
        return writemap_hint(self.options, self.layout.chunk_bytes)
