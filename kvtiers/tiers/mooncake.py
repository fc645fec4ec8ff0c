"""The mooncake tier: chunks pooled in a Mooncake Store, in the memory of many processes.

A chunk is the object `<prefix>/<layout fingerprint hex>/<key hex>`, in the lmdb tier's
format (`_chunk_format`). The store's client (`mooncake.store`) is synchronous: its calls
run in the tier's own thread pool, one batched call per group of chunks (at most 64 MiB),
up to `max_in_flight` at once. Values travel zero-copy between the store and a staging
buffer registered with it (`_pool_staging`); a read is verified there before a byte
reaches the caller's buffer.

The store's semantics, and what the tier makes of them:

- a `put` of an existing key keeps the old value: a key read as bad (garbage, foreign,
  lost) is removed with `force`, so that the next `put` writes it anew;
- `remove` is refused for 10 s after a read (a lease): the tier always forces it;
- objects vanish without notice (eviction when the pool fills; the death of the process
  whose memory held them): a read then finds nothing, or fails, and either is a miss;
- a failed call looks like a miss; a call whose every key failed counts as a failure of
  the store, and enough of them in a row open the circuit breaker (`_pool_guard`);
- a write the pool has no room for (`NO_SPACE`: its segments full, or smaller than a
  value) is declined and counted (`io_counters.full`), not a failure: reads go on.

Capacity bounds the chunks this process knows to be in the pool (its writes and its hits),
least recently used first, those put cold (`put_hinted`) before all others until read (they
take room only from each other; `_mooncake_catalog`); the pool's real bound is the memory
its segments lend, beyond which the store evicts by itself. Since the store drops objects
without notice, a `put` asks the store about the batch's known chunks before it reports
them held, and writes again those it no longer has. `close` waits for the calls in flight.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from kvtiers.core.config import TierConfig, format_size
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierUsage
from kvtiers.tiers._chunk_format import Verdict
from kvtiers.tiers._mooncake_catalog import KnownChunks
from kvtiers.tiers._mooncake_io import (
    LOST,
    NO_SPACE,
    NOT_FOUND,
    NOT_READY,
    TOO_LARGE,
    Staging,
    StoreCalls,
    StoreFailed,
    bind_tcp,
    client_classes,
    setup_client,
)
from kvtiers.tiers._pool_guard import (
    StoredValues,
    StoreGuard,
    StoreUnavailable,
    check_keys,
    plan_put,
)
from kvtiers.tiers._pool_options import MooncakeOptions
from kvtiers.tiers._pool_tier import PoolTier
from kvtiers.tiers._remote_breaker import CircuitBreaker
from kvtiers.tiers.base import Buffer

__all__ = ["MooncakeOptions", "MooncakeTier"]


_GROUP_BYTES = 64 * 2**20  # values per store call, at most (one value may be more)
_MIN_BUFFER = 16 * 2**20  # the client's own transfer buffer, at least


class MooncakeTier(PoolTier):
    """A tier of chunks in a Mooncake Store, shared by every client of its master.

    `used_bytes` counts whole stored values (header and payload) that this process knows to
    be in the pool (see the module docstring).

    Args:
        config: capacity, eviction (only `"lru"`) and the options of `MooncakeOptions`.
        layout: the KV layout of the chunks it holds.

    Raises:
        ConfigError: an option is invalid, or the capacity cannot hold one chunk.
    """

    kind = "mooncake"

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        self.options = options = MooncakeOptions.from_config(config)
        guard = StoreGuard(
            f"mooncake tier {config.name or self.kind!r}",
            f"mooncake master {options.master}",
            timeout=None,  # NOTE: StoreCalls times calls out; the guard cannot stop a thread
            slots=options.max_in_flight,
            breaker=CircuitBreaker(options.breaker_failures, options.breaker_cooldown),
            errors=(StoreFailed, RuntimeError, OSError, ValueError),
        )
        values = StoredValues(config, layout)
        super().__init__(config, layout, values=values, guard=guard, batch_bytes=_GROUP_BYTES)
        if options.buffer_size and options.buffer_size < self.value_bytes:
            raise ConfigError(
                f"{config.where}.buffer_size: smaller than one stored chunk "
                f"({self.value_bytes} bytes), got {options.buffer_size}"
            )
        self.namespace = f"{options.prefix}/{layout.fingerprint.hex()}"
        """The first part of every object key of this tier's layout."""
        self._catalog = KnownChunks(self.max_entries)
        self._store: Any = None
        self._replicate: Any = None
        self._staging: Staging | None = None
        self._calls: StoreCalls | None = None
        self._write_lock = asyncio.Lock()  # one put at a time: exact accounting
        self._connect_lock = asyncio.Lock()
        self._new_client: Callable[[], Any] = lambda: None

    # -- lifecycle ---------------------------------------------------------------------

    async def _open(self) -> None:
        # docstring inherited
        store_class, replicate_class = client_classes(self.config.where)
        options = self.options
        bind_tcp(options)
        self._calls = StoreCalls(
            options.max_in_flight + 1, options.timeout, f"kvtiers-mooncake-{self.name}"
        )
        self._staging = Staging(options.max_in_flight, self._per_call, self.value_bytes)
        self._replicate = replicate_class()
        self._replicate.replica_num = options.replicas
        self._new_client = store_class
        await self._client()

    async def _client(self) -> Any:
        """Return the store's client, connecting it first if need be.

        Returns:
            The client, or `None` while the breaker refuses or the master is unreachable
            (a later call tries again: the tier recovers by itself).
        """
        if self._store is not None:
            return self._store
        if self._guard.refuses():
            return None
        async with self._connect_lock:
            if self._store is None:
                await self._guarded(self._connect, None)
        return self._store

    async def _connect(self) -> None:
        # NOTE: the client's setup holds the interpreter lock while it retries an unreachable
        # master (about 90 s), so a plain connection attempt goes first.
        host, _, port = self.options.master.rpartition(":")
        async with asyncio.timeout(self.options.timeout):
            _, writer = await asyncio.open_connection(host, int(port))
        writer.close()
        store = self._new_client()
        buffer_size = self.options.buffer_size or max(_MIN_BUFFER, self.value_bytes)
        assert self._staging is not None
        await self._io.run(setup_client, store, self.options, buffer_size, self._staging)
        self._store = store

    async def _close(self) -> None:
        # docstring inherited
        await self._in_flight.ended()  # NOTE: calls in flight use the client and the threads
        store, self._store = self._store, None
        calls, self._calls = self._calls, None
        if calls is not None:
            await calls.close()  # NOTE: first, so no call uses the client while it closes
        if store is not None:
            await asyncio.to_thread(store.close)

    @property
    def _io(self) -> StoreCalls:
        assert self._calls is not None  # NOTE: set by _open; every caller checks the state
        return self._calls

    # -- the contract ------------------------------------------------------------------

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # docstring inherited
        with self._running():
            check_keys(keys)
            store = await self._client() if keys else None
            if store is None or self._guard.refuses():
                self.counters.unavailable += bool(keys)
                return [False] * len(keys)
            names = [self._name(key) for key in keys]
            codes = await self._guarded(lambda: self._io.batch(store.batch_is_exist, names), None)
            if codes is None:
                return [False] * len(keys)
            self.counters.errors += sum(code < 0 for code in codes)
            for key, code in zip(keys, codes, strict=True):
                if code == 0:
                    self._catalog.forget(key)
            return [code == 1 for code in codes]

    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        with self._running():
            check_keys(keys)
            self._check_buffers(keys, dsts)
            store = await self._client() if keys else None
            read = functools.partial(self._get_some, store)
            reachable = store is not None
            chunk_bytes = self.layout.chunk_bytes
            return await self._read_batches(keys, dsts, read, chunk_bytes, reachable=reachable)

    async def _get_some(
        self, store: Any, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]
    ) -> list[Verdict | None]:
        """Read one call's worth of keys into `dsts`; `None` where there was no value.

        A value the store failed to deliver (lost with its segment) is `CORRUPT`, so that
        it is removed and may be written again. Each hit becomes the most recent of the
        known chunks; each miss is forgotten.
        """
        missed: list[Verdict | None] = [None] * len(keys)
        verdicts = await self._guarded(
            functools.partial(self._read_some, store, keys, dsts), missed
        )
        hits = [verdict is Verdict.OK for verdict in verdicts]
        self.counters.cold_hits += self._catalog.note_reads(keys, hits)
        return verdicts

    async def _read_some(
        self, store: Any, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]
    ) -> list[Verdict | None]:
        assert self._staging is not None
        async with self._staging.region(self.options.timeout) as region:
            names = [self._name(key) for key in keys]
            ptrs = [region.address(i) for i in range(len(keys))]
            sizes = [self.value_bytes] * len(keys)
            get = store.batch_get_into
            # NOTE: a value another client is still writing is not there yet: a miss
            answers = (NOT_FOUND, NOT_READY, TOO_LARGE)
            codes = await self._io.batch(get, names, ptrs, sizes, region=region, answers=answers)
            verdicts: list[Verdict | None] = []
            for i, (key, code, dst) in enumerate(zip(keys, codes, dsts, strict=True)):
                if code in (NOT_FOUND, NOT_READY):
                    verdicts.append(None)
                elif code == LOST:  # its segment is gone: remove it, so it can be rewritten
                    self.counters.errors += 1
                    verdicts.append(Verdict.CORRUPT)
                elif code < 0 and code != TOO_LARGE:  # a lease that expired, say
                    self.counters.errors += 1
                    verdicts.append(None)
                else:
                    raw = region.slot(i)[: max(code, 0)].data
                    verdicts.append(self._values.read_into(key, raw, dst))
            return verdicts

    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        return await self.put_hinted(keys, srcs, ())

    async def put_hinted(
        self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer], cold: Collection[ChunkKey]
    ) -> list[bool]:
        # docstring inherited
        cold = frozenset(cold)
        with self._running():
            check_keys(keys)
            self._check_buffers(keys, srcs)
            plan = plan_put(keys, srcs)
            order, held = plan.order, plan.held
            async with self._write_lock:
                await self._forget_lost(order)
                new, victims = self._catalog.admit(order, held, cold)
                if victims:
                    self.counters.evictions += len(victims)
                    self._note_evicted(victims)
                    await self._remove(victims)
                await self._put_new(new, plan.sources, held)
                parked = cold.intersection(new) if cold else ()
                settled = [key for key in order if held[key]]
                self.counters.cold_puts += self._catalog.settle(settled, parked)
            self.counters.declined += plan.num_declined
            return plan.results(keys)

    async def _forget_lost(self, keys: Sequence[ChunkKey]) -> None:
        """Forget the known chunks of `keys` that the store no longer holds.

        The store drops objects without notice (eviction, a lost segment, a master
        restarted empty); a known chunk it dropped must be written again, not reported
        held. Where the store cannot answer, none of them is taken as held.
        """
        known = [key for key in keys if key in self._catalog]
        if not known:
            return
        store = await self._client()
        codes: list[int] = [0] * len(known)
        if store is not None and not self._guard.refuses():
            names = [self._name(key) for key in known]
            codes = await self._guarded(
                lambda: self._io.batch(store.batch_is_exist, names, answers=()), codes
            )
        for key, code in zip(known, codes, strict=True):
            if code != 1:
                self._catalog.forget(key)

    async def _put_new(
        self, keys: list[ChunkKey], sources: dict[ChunkKey, Buffer], held: dict[ChunkKey, bool]
    ) -> None:
        per_call = self._per_call
        for start in range(0, len(keys), per_call):
            part = keys[start : start + per_call]
            store = await self._client()
            if store is None or self._guard.refuses():
                self._guard.counters.dropped_writes += len(keys) - start
                self.counters.unavailable += 1
                return
            try:
                await self._guard.call(
                    functools.partial(self._put_some, store, part, sources, held)
                )
            except StoreUnavailable as exc:
                self.counters.fail(timed_out=exc.timed_out)
                self._guard.counters.dropped_writes += len(keys) - start
                return

    async def _put_some(
        self,
        store: Any,
        keys: list[ChunkKey],
        sources: dict[ChunkKey, Buffer],
        held: dict[ChunkKey, bool],
    ) -> None:
        """Write one call's worth of keys through a staging region."""
        assert self._staging is not None

        def record(codes: list[int]) -> None:
            stored = [key for key, code in zip(keys, codes, strict=True) if code == 0]
            for key in stored:
                held[key] = True
                self._catalog.add(key)
            self.counters.puts += len(stored)
            self.counters.bytes_written += len(stored) * self.layout.chunk_bytes
            refused = codes.count(NO_SPACE)
            why = f"the pool of {self._guard.where} has no room for {refused} chunk(s)"
            self._full.note(refused, len(stored), f"{why} of {self.value_bytes} bytes")

        async with self._staging.region(self.options.timeout) as region:
            for i, key in enumerate(keys):
                payload = np.ascontiguousarray(sources[key]).reshape(-1)
                value = self._values.pack(key, payload.data)
                region.slot(i)[: len(value)] = np.frombuffer(value, np.uint8)
            names = [self._name(key) for key in keys]
            ptrs = [region.address(i) for i in range(len(keys))]
            sizes = [self.value_bytes] * len(keys)
            put = store.batch_put_from
            await self._io.batch(
                put,
                *(names, ptrs, sizes, self._replicate),
                region=region,
                on_done=record,
                answers=(NOT_FOUND, TOO_LARGE, NO_SPACE),  # a full pool is not failing
            )

    async def _remove(self, keys: Sequence[ChunkKey]) -> None:
        """Remove `keys` from the store (forced: leases do not hold it up)."""
        for key in keys:
            self._catalog.forget(key)
        store = await self._client()
        if store is None or self._guard.refuses():
            return
        names = [self._name(key) for key in keys]
        answers = (NOT_FOUND, NOT_READY)  # NOTE: a value being written: its write is later
        await self._guarded(
            lambda: self._io.batch(store.batch_remove, names, True, answers=answers), None
        )

    def usage(self) -> TierUsage:
        """Return the capacity and the chunks this process knows to be in the pool."""
        num = len(self._catalog)
        return TierUsage(self.capacity_bytes, num * self.value_bytes, num)

    def explain_lines(self) -> list[str]:
        """Return what `kvtiers explain` shows of this tier beyond its config."""
        options = self.options
        lends = (
            f"lends {format_size(options.segment_size)} of this process's memory to the pool"
            if options.segment_size
            else "a pure client: lends no memory to the pool"
        )
        staging = options.max_in_flight * self._per_call * self.value_bytes
        return [
            f"  master      {options.master} over {options.protocol}, metadata "
            f"{options.metadata}, {options.replicas} replica(s); objects {self.namespace}/<key>",
            f"  memory      {lends}; {format_size(staging)} of registered staging",
            f"  holds       up to {self.max_entries:,} chunks of {format_size(self.value_bytes)} "
            f"(header included) that this process wrote or read",
        ]

    def _name(self, key: ChunkKey) -> str:
        return f"{self.namespace}/{key.hex()}"
