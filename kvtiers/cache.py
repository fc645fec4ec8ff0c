"""`TieredCache`: the one facade over keys, prefix index, eviction and the tier cascade."""

from __future__ import annotations

import asyncio
import enum
import os
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Self

import torch

from kvtiers._activity import Activity, tracked
from kvtiers._cascade import build_slots
from kvtiers._endpoints import (
    PagedSink,
    PagedSource,
    TensorSink,
    TensorSource,
)
from kvtiers._keyed import KeyLevelAPI, Salt
from kvtiers._movement import Mover
from kvtiers._salts import SaltWitness
from kvtiers._tally import CallTally
from kvtiers._tensors import as_tokens, check_kv, check_out, torch_dtype
from kvtiers.core.config import CacheConfig, load_config
from kvtiers.core.errors import CacheStateError, ConfigError, InvalidInputError
from kvtiers.core.events import ChunkRemoved, ChunkStored, EventQueue
from kvtiers.core.index import PrefixIndex
from kvtiers.core.keys import ChunkHasher, ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import CacheStats
from kvtiers.gpu.copy_engine import CopyEngine
from kvtiers.gpu.paged import PagedKV
from kvtiers.metrics import MetricsServer
from kvtiers.tiers.blocks import BlockTier
from kvtiers.tiers.registry import TierRegistry

__all__ = ["CacheState", "TieredCache"]


class CacheState(enum.Enum):
    """Lifecycle of a cache: opened once, closed once."""

    UNOPENED = 1  # built; tiers hold no resources yet
    OPEN = 2  # tiers open, writers running
    CLOSED = 3  # queues drained, tiers closed; cannot be reopened


class TieredCache(KeyLevelAPI):
    """Cache KV chunks across a cascade of tiers and serve the longest cached prefix.

    Use it as an async context manager::

        async with TieredCache.from_config("tiers.toml") as cache:
            n = await cache.lookup(tokens, salt=tenant)
            kv = await cache.load(tokens[:n], salt=tenant)
            await cache.store(tokens, full_kv, salt=tenant)

    All calls must come from the event loop that opened the cache. Engines that hash their
    own pages use the key-level calls (`chunk_keys`, `lookup_keys`, `contains_keys`,
    `get_chunks`, `put_chunks`), through the same tiers.

    Args:
        config: the validated config.
        layout: the KV layout, when the config has none (an engine adapter supplies it).
        registry: tier kinds to resolve; built-ins plus entry-point plugins by default.
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        layout: KVLayout | None = None,
        registry: TierRegistry | None = None,
    ) -> None:
        _check_args(config, layout, registry)
        layout = layout or config.layout
        if layout is None:
            raise ConfigError("layout: required; give a [layout] table or a KVLayout")
        self.config = config.with_layout(layout)
        self.layout = layout
        self._hasher = ChunkHasher(layout.fingerprint, layout.chunk_size)
        self._salts = SaltWitness(layout.chunk_size)
        self._index = PrefixIndex(len(config.tiers))
        self._slots = build_slots(self.config, layout, registry or TierRegistry())
        self._events = EventQueue(config.events) if config.events > 0 else None
        self._mover = Mover(
            layout,
            self._index,
            self._slots,
            config.write_queue_chunks,
            self._events,
            config.concurrent_reads,
        )
        self._state = CacheState.UNOPENED
        self._stack = AsyncExitStack()
        self._engines: dict[torch.device, CopyEngine] = {}
        self._metrics: MetricsServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that opened it
        self._tally = CallTally()
        self._activity = Activity()  # calls in flight, which `close` waits for
        self._closed = asyncio.Event()  # set once the tiers are closed (or never opened)

    @classmethod
    def from_config(
        cls,
        source: str | os.PathLike[str] | Mapping[str, Any] | CacheConfig,
        *,
        layout: KVLayout | None = None,
        registry: TierRegistry | None = None,
    ) -> TieredCache:
        """Build a cache from a TOML or YAML file, a dict or a `CacheConfig`.

        Nothing is allocated or opened until the cache is entered (`async with`) or `open`ed.

        Raises:
            ConfigError: the config is invalid; the message names the field.
        """
        config = source if isinstance(source, CacheConfig) else load_config(source)
        return cls(config, layout=layout, registry=registry)

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus endpoint (`[metrics]` in the config), once open; else `None`."""
        return self._metrics.url if self._metrics is not None else None

    def _metric_labels(self) -> dict[str, str]:
        return {"model": self.layout.model, "tp_rank": str(self.layout.tp_rank)}

    async def _snapshot(self) -> CacheStats | None:
        return None if self._state is CacheState.CLOSED else self.stats()

    def serve_metrics_of(self, other: TieredCache) -> bool:
        """Serve `other`'s metrics on this cache's endpoint too, while `other` is open.

        For caches that one engine uses side by side (an SGLang hybrid model's extra
        pools): one endpoint to scrape. `other`'s samples carry its own labels (its
        layout's model and TP rank), and its stats are read on the loop that opened it.
        Callable from any thread; serving `other` again is a no-op.

        Returns:
            Whether this cache serves metrics (without a `[metrics]` table, or before
            `open`, nothing is kept).
        """
        if not isinstance(other, TieredCache):
            raise InvalidInputError(f"other: expected a TieredCache, got {type(other).__name__}")
        loop = other._loop
        if self._metrics is None or loop is None or other is self:
            return False
        return self._metrics.add_source(id(other), other._snapshot, loop, other._metric_labels())

    @property
    def state(self) -> CacheState:
        """The lifecycle state."""
        return self._state

    @property
    def tiers(self) -> tuple[Any, ...]:
        """The tier objects, top first."""
        return tuple(slot.tier for slot in self._slots)

    async def open(self) -> None:
        """Open every tier, top first, and start the background writers.

        Raises:
            CacheStateError: the cache was opened before.
        """
        if self._state is not CacheState.UNOPENED:
            raise CacheStateError(f"a cache can be opened once; this one is {self._state.name}")
        self._loop = asyncio.get_running_loop()
        try:
            for slot in self._slots:
                await self._stack.enter_async_context(slot.tier)
            group = await self._stack.enter_async_context(asyncio.TaskGroup())
            self._mover.start(group)
            if self.config.metrics is not None:
                self._metrics = await self._stack.enter_async_context(
                    MetricsServer(self.config.metrics, self._snapshot, self._metric_labels())
                )
        except BaseException:
            await self._stack.aclose()
            self._state = CacheState.CLOSED
            self._closed.set()
            raise
        self._state = CacheState.OPEN

    async def close(self) -> None:
        """Drain the write queues, then close the tiers, bottom first; idempotent.

        Calls made from then on raise `CacheStateError`; calls already running finish
        first (so a `store` in flight when `close` is called still reaches every
        write-through tier). After an orderly close every chunk that `store` accepted is
        in every write-through tier that accepted it. A second call returns once the
        first has closed the tiers.

        Cancelled before the queues are drained, it still closes the tiers (the copies
        still queued are dropped) before the cancellation propagates.
        """
        if self._state is CacheState.OPEN:
            self._state = CacheState.CLOSED
            try:
                await self._activity.idle()
                await self._mover.drain()
            except BaseException:
                # NOTE: cut short, the writers would wait for the end of their queues
                # forever, and the task group (so the tiers' closing) with them.
                self._mover.stop()
                raise
            finally:
                try:
                    await self._stack.aclose()
                finally:
                    self._closed.set()
        elif self._state is CacheState.UNOPENED:
            self._closed.set()
        self._state = CacheState.CLOSED
        await self._closed.wait()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _ensure_open(self) -> None:
        if self._state is not CacheState.OPEN:
            raise CacheStateError(f"the cache is {self._state.name.lower()}, not open")

    def keys(self, tokens: Any, *, salt: Salt = None) -> list[ChunkKey]:
        """Return the chunk keys of the full chunks of `tokens` (prefix first)."""
        return self._hasher.keys_of_array(as_tokens(tokens), salt)

    @tracked
    async def lookup(self, tokens: Any, *, salt: Salt = None) -> int:
        """Return the length in tokens of the longest cached prefix of `tokens`.

        The result is a multiple of `chunk_size`. Chunks that another process wrote to a
        shared tier are found too: the tiers are asked past the last locally known hit.

        Raises:
            TokenError: `tokens` is not a 1-D sequence of non-negative integer ids.
        """
        start = time.perf_counter()
        arr = as_tokens(tokens)
        keys = self._hasher.keys_of_array(arr, salt)
        num_chunks = await self._mover.lookup(
            keys, lambda: self._salts.other_root(arr, self._hasher.root(salt))
        )
        hit = num_chunks * self.layout.chunk_size
        self._tally.lookup(len(arr), hit, time.perf_counter() - start)
        return hit

    @tracked
    async def load(
        self, tokens: Any, *, salt: Salt = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return the KV of the cached prefix of `tokens`.

        Each chunk comes from the highest tier holding it; chunks found in a lower tier are
        promoted into the top memory tier. The result covers the leading full chunks that
        could be loaded: normally all of `tokens[: lookup(tokens)]`, fewer if a chunk was
        evicted (or another process evicted it) in between.

        Args:
            tokens: token ids (list, NumPy array or torch tensor).
            salt: the tenant's namespace; chunks of other salts never match.
            out: a tensor to fill, shaped like the result with at least as many tokens;
                a new CPU tensor is returned when omitted.

        Returns:
            KV shaped `(num_layers, 2, n_tokens, num_kv_heads, head_size)` (mha) or
            `(num_layers, 1, n_tokens, head_size)` (mla); a view of `out` when given.

        Raises:
            TokenError: bad token ids.
            LayoutMismatch: `out` has the wrong dtype or shape.
        """
        start = time.perf_counter()
        keys = self._hasher.keys_of_array(as_tokens(tokens), salt)
        num_tokens = len(keys) * self.layout.chunk_size
        if out is None:
            out = torch.empty(self.layout.kv_shape(num_tokens), dtype=torch_dtype(self.layout))
        else:
            check_out(self.layout, out, num_tokens)
        sink = TensorSink(self.layout, out)
        loaded = await self._mover.load(keys, sink) if keys else 0
        result = out.narrow(2, 0, loaded * self.layout.chunk_size)
        self._record_load(loaded, start)
        return result

    @tracked
    async def store(self, tokens: Any, kv: torch.Tensor, *, salt: Salt = None) -> int:
        """Cache the KV of the full chunks of `tokens`.

        The top tier holds the chunks when this returns; write-through tiers receive them in
        the background (this waits when their queues are full), write-back tiers when the
        tier above evicts them.

        Args:
            tokens: token ids (list, NumPy array or torch tensor).
            kv: KV of every token, shaped as `load` returns it; any device, any strides.
            salt: the tenant's namespace.

        Returns:
            Tokens newly stored: full chunks that no tier held before.

        Raises:
            TokenError: bad token ids.
            LayoutMismatch: `kv` does not match the layout or the number of tokens.
        """
        start = time.perf_counter()
        arr = as_tokens(tokens)
        check_kv(self.layout, kv, len(arr))
        keys = self._hasher.keys_of_array(arr, salt)
        self._salts.stored(arr, self._hasher.root(salt))
        source = TensorSource(self.layout, kv)
        new_chunks = await self._mover.store(keys, source) if keys else 0
        return self._record_store(new_chunks, start)

    @tracked
    async def store_paged(
        self, tokens: Any, paged: PagedKV, block_table: Any, *, salt: Salt = None
    ) -> int:
        """Cache the full chunks of `tokens` straight from an engine's paged KV.

        Each chunk is gathered from the engine's blocks into its top-tier block with one
        copy (device-to-host on dedicated CUDA streams, awaited without blocking the loop).

        Args:
            tokens: token ids of the request, prefix first.
            paged: the engine's KV (`PagedKV.vllm_flash`, `.sglang_mha`, `.mla`).
            block_table: the request's engine block ids in token order.
            salt: the tenant's namespace.

        Returns:
            Tokens newly stored.

        Raises:
            TokenError: bad token ids.
            LayoutMismatch: `paged` does not match the layout.
            InvalidInputError: a bad block table; nothing is written.
        """
        start = time.perf_counter()
        _check_paged(paged, self.layout)
        arr = as_tokens(tokens)
        keys = self._hasher.keys_of_array(arr, salt)
        self._salts.stored(arr, self._hasher.root(salt))
        engine = await self._copy_engine(paged.device)
        source = PagedSource(self.layout, engine, paged, block_table)
        new_chunks = await self._mover.store(keys, source) if keys else 0
        return self._record_store(new_chunks, start)

    @tracked
    async def load_paged(
        self, tokens: Any, paged: PagedKV, block_table: Any, *, salt: Salt = None
    ) -> int:
        """Load the cached prefix of `tokens` straight into an engine's paged KV.

        Chunks are scattered into the blocks that `block_table` names, with one copy from
        their tier block (host-to-device on dedicated CUDA streams).

        Returns:
            Tokens loaded: the leading full chunks delivered (see `load`).

        Raises:
            TokenError: bad token ids.
            LayoutMismatch: `paged` does not match the layout.
            InvalidInputError: a bad block table; nothing is written.
        """
        start = time.perf_counter()
        _check_paged(paged, self.layout)
        keys = self._hasher.keys_of_array(as_tokens(tokens), salt)
        engine = await self._copy_engine(paged.device)
        sink = PagedSink(self.layout, engine, paged, block_table)
        loaded = await self._mover.load(keys, sink) if keys else 0
        self._record_load(loaded, start)
        return loaded * self.layout.chunk_size

    def _record_load(self, num_chunks: int, start: float) -> None:
        size = self.layout.chunk_size
        seconds = time.perf_counter() - start
        self._tally.load(num_chunks * size, num_chunks * self.layout.chunk_bytes, seconds)

    def _record_store(self, new_chunks: int, start: float) -> int:
        stored = new_chunks * self.layout.chunk_size
        self._tally.store(stored, time.perf_counter() - start)
        return stored

    async def _copy_engine(self, device: torch.device) -> CopyEngine:
        engine = self._engines.get(device)
        if engine is None:
            engine = await self._stack.enter_async_context(CopyEngine(self.layout, device))
            self._engines[device] = engine
        return engine

    @tracked
    async def prefetch(self, tokens: Any, *, salt: Salt = None) -> int:
        """Move the cached prefix of `tokens` up into the top memory tier.

        Awaiting it waits for the move; run it as a task to overlap it with other work.

        Returns:
            Tokens of the prefix now in the top tier.
        """
        keys = self._hasher.keys_of_array(as_tokens(tokens), salt)
        return await self._mover.prefetch(keys) * self.layout.chunk_size

    @tracked
    async def clear(self) -> int:
        """Remove every chunk this cache knows of from every tier.

        Chunks that only other processes stored in a shared tier are not known here and
        stay. Waits for queued write-through copies first.

        Returns:
            Residencies removed (a chunk held by two tiers counts twice).
        """
        return await self._mover.clear()

    @tracked
    async def flush(self) -> None:
        """Wait until every chunk queued for a write-through tier is written."""
        await self._mover.flush()

    def take_events(self) -> list[ChunkStored | ChunkRemoved]:
        """Return the KV events since the last call, oldest first, and clear them.

        A `ChunkStored` says a chunk became resident in a tier (placed in the top tier,
        promoted, demoted, written through, or placed below when the top tier was full); a
        `ChunkRemoved` says the cache evicted or dropped one (evicted from a memory tier, a
        stale hint discarded, an entry found corrupt or missing on load), or that a tier
        evicting by itself (lmdb, remote) removed one this cache had placed there (by
        capacity or expiry; what other processes sharing the tier remove shows only when
        the cache next finds the chunk missing). Empty when the config's `events` is 0;
        when the queue is full the oldest events are dropped (`CacheStats.events_dropped`).
        """
        if self._events is None:
            return []
        self._mover.reap()
        return self._events.drain()

    def stats(self) -> CacheStats:
        """Return a snapshot of the cache's and every tier's counters."""
        t = self._tally
        return CacheStats(
            lookups=t.lookups,
            lookup_tokens=t.lookup_tokens,
            hit_tokens=t.hit_tokens,
            loads=t.loads,
            loaded_tokens=t.loaded_tokens,
            loaded_bytes=t.loaded_bytes,
            load_seconds=t.load_seconds,
            stores=t.stores,
            stored_tokens=t.stored_tokens,
            write_queue_chunks=self._mover.queued_chunks(),
            miss_reasons=dict(self._mover.miss_reasons),
            evicted_from=dict(self._mover.evicted_from),
            events_dropped=self._events.dropped if self._events is not None else 0,
            latency=t.latency(),
            tiers=tuple(slot.tier.stats() for slot in self._slots),
        )

    def pin_count(self) -> int:
        """Return the pins held on memory-tier blocks now (zero when idle)."""
        return sum(slot.tier.total_pins for slot in self._slots if isinstance(slot.tier, BlockTier))


def _check_args(config: Any, layout: Any, registry: Any) -> None:
    if not isinstance(config, CacheConfig):
        raise ConfigError(
            f"config: expected a CacheConfig, got {type(config).__name__} "
            "(TieredCache.from_config takes a path or a dict)"
        )
    if layout is not None and not isinstance(layout, KVLayout):
        raise ConfigError(f"layout: expected a KVLayout, got {type(layout).__name__}")
    if registry is not None and not isinstance(registry, TierRegistry):
        raise ConfigError(f"registry: expected a TierRegistry, got {type(registry).__name__}")


def _check_paged(paged: Any, layout: KVLayout) -> None:
    if not isinstance(paged, PagedKV):
        raise InvalidInputError(f"paged: expected a PagedKV, got {type(paged).__name__}")
    paged.check_layout(layout)
