"""The async tier contract every storage tier implements."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Self, cast

import numpy as np
import numpy.typing as npt

from kvtiers.core.checks import describe
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import CacheStateError, ConfigError, InvalidInputError
from kvtiers.core.keys import KEY_BYTES, ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import StoreHealth, TierCounters, TierStats, TierUsage
from kvtiers.tiers._layers import check_layers, layer_pieces, write_layers

__all__ = [
    "Buffer",
    "HostCopy",
    "Tier",
    "TierState",
    "check_keys",
    "check_option_keys",
    "copy_serially",
]

Buffer = npt.NDArray[np.uint8]
"""A chunk's bytes: a uint8 array of `layout.chunk_bytes` bytes, any shape, any strides.

Its C-order element sequence is the payload (`[layer][k|v][token][head][dim]`), so a strided
view of a caller's KV tensor is a valid destination or source and saves a copy.
"""

HostCopy = Callable[[Sequence[tuple[Buffer, Buffer]]], None]
"""Copies `(dst, src)` pairs of host arrays of one shape: a block tier's copies.

The cache hands its copy threads to its block tiers (`HostCopier.copy`, resource
`host_copy`); `copy_serially` is the default.
"""


def copy_serially(pairs: Sequence[tuple[Buffer, Buffer]]) -> None:
    """Copy each pair's source into its destination, one after another."""
    for dst, src in pairs:
        np.copyto(dst, src)


_EVICTED_KEPT = 65_536  # keys a tier remembers having evicted until the cache takes them


def check_option_keys(config: TierConfig, kind: str, allowed: Iterable[str]) -> None:
    """Raise a `ConfigError` naming the first kind option of `config` not in `allowed`."""
    known = sorted(allowed)
    # NOTE: a key from a dict config may be anything hashable, such as an integer past
    # Python's limit on digits, which str() refuses; describe() shows it safely.
    unknown = sorted(
        (k if isinstance(k, str) else describe(k) for k in config.options if k not in known),
    )
    if unknown:
        expected = ", ".join(known) if known else "none"
        raise ConfigError(
            f"{config.where}.{unknown[0]}: unknown option for kind {kind!r}; expected {expected}"
        )


def check_keys(keys: Sequence[ChunkKey]) -> None:
    """Raise `InvalidInputError` for the first key that is not a chunk key."""
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidInputError(f"keys[{i}]: expected a {KEY_BYTES}-byte key, got {key!r:.60}")


class TierState(enum.Enum):
    """Lifecycle of a tier: opened once, closed once."""

    UNOPENED = 1  # built, holds no resources yet
    OPEN = 2  # resources held; operations allowed
    CLOSED = 3  # resources released; cannot be reopened


class Tier(ABC):
    """One storage tier: batched async operations on chunk payloads keyed by `ChunkKey`.

    Results are aligned with the keys; a miss is `False` in its slot, never an exception,
    also for an entry that fails its checksum or belongs to another layout (it is then
    deleted and counted in `counters`). Backend failures that are not misses surface as
    `TierIOError`.

    A tier is an async context manager; `open` acquires its resources and `close` (idempotent)
    releases them.

    Args:
        config: this tier's config (capacity, kind options).
        layout: the KV layout of the chunks it holds.
    """

    kind: ClassVar[str]
    """The config `kind` this class implements."""
    shared: ClassVar[bool] = False
    """Whether other processes or nodes may write this tier (the local index is then a hint)."""
    manages_eviction: ClassVar[bool] = False
    """Whether the tier evicts by capacity itself (shared tiers) instead of the cache's policy."""

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout
        self.name = config.name or self.kind
        self.capacity_bytes = config.capacity_bytes
        self.counters = TierCounters()
        self._state = TierState.UNOPENED
        # NOTE: a bounded deque, appended to by writer threads and drained on the loop
        # (deque appends and pops are atomic).
        self._evicted_keys: deque[bytes] = deque(maxlen=_EVICTED_KEPT)
        if self.manages_eviction and config.eviction != "lru":
            raise ConfigError(
                f"{config.where}.eviction: the {self.kind} tier evicts least-recently-used by "
                f"capacity itself (other processes share its entries); expected 'lru', "
                f"got {config.eviction!r}"
            )

    @classmethod
    def from_config(cls, config: TierConfig, layout: KVLayout, **resources: Any) -> Self:
        """Build the tier from its config, validating its kind-specific options."""
        return cls(config, layout, **resources)

    @property
    def state(self) -> TierState:
        """The lifecycle state."""
        return self._state

    async def open(self) -> None:
        """Acquire the tier's resources.

        Raises:
            CacheStateError: the tier was opened before.
        """
        if self._state is not TierState.UNOPENED:
            raise CacheStateError(f"tier {self.name!r} cannot be opened twice")
        await self._open()
        self._state = TierState.OPEN

    async def close(self) -> None:
        """Release the tier's resources; a second call does nothing."""
        if self._state is TierState.OPEN:
            self._state = TierState.CLOSED
            await self._close()
        self._state = TierState.CLOSED

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

    async def _open(self) -> None:  # noqa: B027 - an optional hook
        """Acquire resources (override); the base checks the lifecycle."""

    async def _close(self) -> None:  # noqa: B027 - an optional hook
        """Release resources (override); called once."""

    def _ensure_open(self) -> None:
        if self._state is not TierState.OPEN:
            raise CacheStateError(f"tier {self.name!r} is {self._state.name.lower()}, not open")

    def _check_buffers(self, keys: Sequence[ChunkKey], bufs: Sequence[Buffer]) -> None:
        if len(keys) != len(bufs):
            raise InvalidInputError(f"{len(keys)} keys but {len(bufs)} buffers")
        want = self.layout.chunk_bytes
        for buf in bufs:
            if buf.nbytes != want or buf.dtype != np.uint8:
                raise InvalidInputError(
                    f"buffer of {buf.nbytes} bytes ({buf.dtype}); expected {want} uint8 bytes"
                )

    @abstractmethod
    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Return, for each key, whether the tier holds it."""

    @abstractmethod
    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        """Fill each destination with its key's payload; `False` where it is missing."""

    @abstractmethod
    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        """Store each source under its key; `False` where the tier declined."""

    async def put_hinted(
        self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer], cold: Collection[ChunkKey]
    ) -> list[bool]:
        """Store as `put` does; no reuse is expected of the new entries among `cold`.

        A reuse hint (`TieredCache.store`'s `keep_tokens`): a tier that evicts by itself
        may evict those entries first, until they are read (the lmdb, remote, redis and
        mooncake tiers do). By default the hint is ignored.
        """
        return await self.put(keys, srcs)

    @abstractmethod
    async def delete(self, keys: Sequence[ChunkKey]) -> None:
        """Remove the keys the tier holds; unknown keys are ignored."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Return the tier's capacity and what it holds now."""

    @property
    def layer_reads(self) -> bool:
        """Whether `get_layers` reads only the layers asked for (else it reads whole chunks).

        A layer-wise load (`TieredCache.load` with `on_layers`) reads such a tier wave by
        wave; another tier is read whole in one call.
        """
        return False

    async def get_layers(
        self,
        keys: Sequence[ChunkKey],
        layers: Sequence[int],
        dsts: Sequence[Buffer],
        *,
        tally: bool = True,
    ) -> list[bool]:
        """Fill only `layers` of each destination; bytes of other layers are left alone.

        The default reads each chunk whole into a scratch buffer (verified as `get`
        verifies) and copies the layers out; tiers with `layer_reads` read only them.

        Args:
            keys: the chunks.
            layers: layer indices, the same for every chunk.
            dsts: full chunk buffers, as for `get`.
            tally: whether the call counts its hits and misses; the later waves of one
                layer-wise load pass `False`, so a chunk counts once.

        Returns:
            For each key, whether its layers were delivered.

        Raises:
            InvalidInputError: a layer index is out of range or repeated, or a buffer is not
                one chunk.
        """
        self._check_buffers(keys, dsts)
        wanted = check_layers(layers, self.layout.num_layers)
        if not keys:
            return []
        scratch = np.empty((len(keys), self.layout.chunk_bytes), dtype=np.uint8)
        found = await self.get(keys, list(scratch))
        if not tally:  # take back what `get` counted (other calls may count meanwhile)
            self.counters.hits -= sum(found)
            self.counters.misses -= len(found) - sum(found)
        step = self.layout.layer_bytes
        for row, dst, hit in zip(scratch, dsts, found, strict=True):
            if hit:
                write_layers(dst, layer_pieces(row.data, wanted, step), self.layout.num_layers)
        return found

    def touch(self, keys: Sequence[ChunkKey]) -> None:  # noqa: B027 - an optional hook
        """Record that `keys` are about to be read, as recency for the tier's own eviction.

        For tiers that evict by themselves (`manages_eviction`): the cache calls it before
        a write that could make the tier evict (a write-back demotion into it) ahead of a
        read of `keys` from it, so that write does not evict them. Cheap and never fails;
        unknown keys are ignored. The default does nothing.
        """

    def take_evicted(self) -> list[ChunkKey]:
        """Return, and forget, the keys the tier evicted by itself since the last call.

        Only tiers that evict by themselves (`manages_eviction`) report any, and only what
        this process's instance removed (by capacity or expiry); what other processes
        remove from a shared tier is not seen. Past 65,536 keys the oldest are forgotten.
        """
        taken: list[bytes] = []
        while self._evicted_keys:
            taken.append(self._evicted_keys.popleft())
        return cast("list[ChunkKey]", taken)

    def _note_evicted(self, keys: Iterable[bytes]) -> None:
        """Remember keys the tier evicted by itself, for `take_evicted` (any thread)."""
        self._evicted_keys.extend(keys)

    def store_health(self) -> StoreHealth | None:
        """Return the breaker state and request counters of the tier's remote store.

        `None` (the default) for a tier without one; tiers that reach a store over the
        network (remote, redis, mooncake) override it.
        """
        return None

    def stats(self) -> TierStats:
        """Return a snapshot of the tier's counters and usage."""
        health = self.store_health()
        if health is None:
            return self.counters.snapshot(self.name, self.kind, self.usage())
        return self.counters.snapshot(
            self.name, self.kind, self.usage(), breaker=health.breaker, io=health.io
        )
