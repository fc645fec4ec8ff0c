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
from kvtiers._config_source import PROBE_LAYOUT, check_args, config_of, naming_file
from kvtiers._endpoints import Copies, TensorSink, TensorSource
from kvtiers._host_copies import HostCopier, default_copy_threads
from kvtiers._keyed import KeyLevelAPI, Salt
from kvtiers._movement import Mover
from kvtiers._observe import ObservedCache
from kvtiers._paged_api import PagedAPI
from kvtiers._salts import SaltWitness
from kvtiers._streaming import OnLayers, load_layerwise
from kvtiers._tally import CallTally
from kvtiers._tensors import as_tokens, check_kv, check_out, keep_hint, torch_dtype
from kvtiers.core.config import CacheConfig
from kvtiers.core.errors import CacheStateError, ConfigError
from kvtiers.core.events import EventQueue
from kvtiers.core.index import LookupResult, PrefixIndex
from kvtiers.core.keys import ChunkHasher, ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.gpu.copy_engine import CopyEngine
from kvtiers.gpu.hbm import HBMTier
from kvtiers.metrics import MetricsServer
from kvtiers.tiers.registry import TierRegistry

__all__ = ["CacheState", "TieredCache"]


class CacheState(enum.Enum):
    """Lifecycle of a cache: opened once, closed once."""

    UNOPENED = 1  # built; tiers hold no resources yet
    OPEN = 2  # tiers open, writers running
    CLOSED = 3  # queues drained, tiers closed; cannot be reopened


class TieredCache(KeyLevelAPI, PagedAPI, ObservedCache):
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
        check_args(config, layout, registry)
        layout = layout or config.layout
        if layout is None:
            raise ConfigError("layout: required; give a [layout] table or a KVLayout")
        self.config = config.with_layout(layout)
        self.layout = layout
        self._hasher = ChunkHasher(layout.fingerprint, layout.chunk_size)
        self._salts = SaltWitness(layout.chunk_size)
        self._index = PrefixIndex(len(config.tiers))
        self._copier = HostCopier(config.copy_threads or default_copy_threads())
        self._slots = build_slots(
            self.config, layout, registry or TierRegistry(), self._copier.copy
        )
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
        top = self._slots[0].tier
        self._copies = Copies(self._copier, top if isinstance(top, HBMTier) else None)
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
        config = config_of(source)
        with naming_file(source):
            return cls(config, layout=layout, registry=registry)

    @classmethod
    def check_tiers(
        cls,
        source: str | os.PathLike[str] | Mapping[str, Any] | CacheConfig,
        *,
        registry: TierRegistry | None = None,
    ) -> CacheConfig:
        """Load a config and check every tier as building a cache does, without a layout.

        For configs whose layout an engine adapter supplies later: kinds, options,
        eviction and write policies are checked against a one-token probe layout; checks
        that depend on the real layout (a capacity below one chunk) are left to the build.
        Nothing is allocated or opened.

        Returns:
            The loaded config.

        Raises:
            ConfigError: the config or a tier is invalid; the message names the field and,
                for a file, ends with `(in PATH)`.
        """
        config = config_of(source)
        with naming_file(source):
            cls(config, layout=PROBE_LAYOUT, registry=registry)
        return config

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
            await self._stack.enter_async_context(self._copier)
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

    def _is_closed(self) -> bool:
        return self._state is CacheState.CLOSED

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
        hit, _ = await self._lookup(tokens, salt)
        return hit

    @tracked
    async def locate(self, tokens: Any, *, salt: Salt = None) -> LookupResult:
        """Return the longest cached prefix of `tokens` and the tier of each of its chunks.

        A `lookup` (same semantics, counted as one) that also names, per chunk, the tier a
        load would read it from: for metrics by tier, or to weigh a hit by its tier.

        Raises:
            TokenError: `tokens` is not a 1-D sequence of non-negative integer ids.
        """
        hit, keys = await self._lookup(tokens, salt)
        found = tuple(keys[: hit // self.layout.chunk_size])
        return LookupResult(hit, self._mover.top_tiers(found), found)

    async def _lookup(self, tokens: Any, salt: Salt) -> tuple[int, list[ChunkKey]]:
        start = time.perf_counter()
        arr = as_tokens(tokens)
        keys = self._hasher.keys_of_array(arr, salt)
        num_chunks = await self._mover.lookup(
            keys, lambda: self._salts.other_root(arr, self._hasher.root(salt))
        )
        hit = num_chunks * self.layout.chunk_size
        self._tally.lookup(len(arr), hit, time.perf_counter() - start)
        return hit, keys

    @tracked
    async def load(
        self,
        tokens: Any,
        *,
        salt: Salt = None,
        out: torch.Tensor | None = None,
        on_layers: OnLayers | None = None,
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
            on_layers: makes the load layer-wise: called on the cache's loop as
                `on_layers(num_layers, num_tokens)` each time the first `num_layers`
                layers of the first `num_tokens` tokens are final in `out`, so an engine
                can start on early layers while later ones are read (see
                docs/architecture.md). Calls come in order of layers, `num_tokens` never
                grows, and the result holds at most the last call's tokens. It must be
                quick; if it raises, it is logged and not called again.

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
        sink = TensorSink(self.layout, out, self._copies)
        if on_layers is not None:
            loaded = await load_layerwise(self._mover, keys, sink, self.layout, on_layers)
        else:
            loaded = await self._mover.load(keys, sink) if keys else 0
        result = out.narrow(2, 0, loaded * self.layout.chunk_size)
        self._record_load(loaded, start)
        return result

    @tracked
    async def store(
        self, tokens: Any, kv: torch.Tensor, *, salt: Salt = None, keep_tokens: int | None = None
    ) -> int:
        """Cache the KV of the full chunks of `tokens`.

        The top tier holds the chunks when this returns; write-through tiers receive them in
        the background (this waits when their queues are full), write-back tiers when the
        tier above evicts them.

        Args:
            tokens: token ids (list, NumPy array or torch tensor).
            kv: KV of every token, shaped as `load` returns it; any device, any strides.
            salt: the tenant's namespace.
            keep_tokens: a reuse hint: only this many leading tokens are expected to be
                asked for again (a conversation that goes on: all; one that ended: 0). The
                new chunks past them go into the top memory tier cold, evicted before any
                other until a hit. None: no hint.

        Returns:
            Tokens newly stored: full chunks no tier held before and one holds now.

        Raises:
            TokenError: bad token ids.
            LayoutMismatch: `kv` does not match the layout or the number of tokens.
            InvalidInputError: `keep_tokens` is not a non-negative integer.
        """
        start = time.perf_counter()
        arr = as_tokens(tokens)
        check_kv(self.layout, kv, len(arr))
        keep = keep_hint("keep_tokens", keep_tokens, self.layout.chunk_size)
        keys = self._hasher.keys_of_array(arr, salt)
        self._salts.stored(arr, self._hasher.root(salt))
        source = TensorSource(self.layout, kv, self._copies)
        new_chunks = await self._mover.store(keys, source, keep) if keys else 0
        return self._record_store(new_chunks, start)

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
