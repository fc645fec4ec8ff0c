"""Host-memory tier: chunks in fixed-size blocks of one pre-allocated buffer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtiers.core.blockpool import BlockPool
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierUsage
from kvtiers.tiers.base import Buffer, Tier, TierState

__all__ = ["Allocator", "DRAMTier", "MemoryTier", "PinnedViews", "Reservation", "Reserved"]

Allocator = Callable[[int], Buffer]
"""Return a 1-D uint8 buffer of the given byte size (pinned host memory, for instance)."""


def _numpy_allocator(num_bytes: int) -> Buffer:
    return np.empty(num_bytes, dtype=np.uint8)


class MemoryTier(Tier):
    """A tier whose chunks live in blocks of one buffer, with zero-copy pinned views.

    Beyond the tier contract it offers `pinned` (views of resident chunks, pinned while the
    context is open, so a copy can read them without an extra copy) and `reserve` (blocks to
    fill in place, committed when the context exits normally). Eviction is the cache's job:
    `put` declines when no block is free.

    Args:
        config: this tier's config.
        layout: the KV layout.
        allocate: returns the tier's buffer; plain NumPy memory by default.
    """

    _OPTIONS: frozenset[str] = frozenset()

    def __init__(
        self, config: TierConfig, layout: KVLayout, allocate: Allocator | None = None
    ) -> None:
        super().__init__(config, layout)
        unknown = sorted(set(config.options) - self._OPTIONS)
        if unknown:
            raise ConfigError(f"{config.where}.{unknown[0]}: unknown option for {self.kind!r}")
        self.num_chunks = config.capacity_bytes // layout.chunk_bytes
        if self.num_chunks < 1:
            raise ConfigError(
                f"{config.where}.capacity: {config.capacity_bytes} bytes is too small for one "
                f"chunk of {layout.chunk_bytes} bytes"
            )
        self._allocate = allocate or _numpy_allocator
        self._buffer: Buffer = np.empty(0, dtype=np.uint8)
        self._pool = BlockPool(0)
        self._blocks: dict[ChunkKey, int] = {}
        # Deleted while pinned: freed when the last pin goes.
        self._doomed: set[int] = set()

    @classmethod
    def from_config(cls, config: TierConfig, layout: KVLayout, **resources: Any) -> MemoryTier:
        # docstring inherited
        return cls(config, layout, allocate=resources.get("allocate"))

    async def _open(self) -> None:
        self._buffer = self._allocate(self.num_chunks * self.layout.chunk_bytes)
        self._pool = BlockPool(self.num_chunks)

    async def _close(self) -> None:
        self._blocks.clear()
        self._buffer = np.empty(0, dtype=np.uint8)

    @property
    def buffer(self) -> Buffer:
        """The whole pre-allocated buffer (for registering it with a copy engine)."""
        return self._buffer

    @property
    def num_free_chunks(self) -> int:
        """Blocks free now."""
        return self._pool.num_free_blocks

    @property
    def total_pins(self) -> int:
        """Sum of pin counts over all blocks (zero when no copy is in flight)."""
        return self._pool.total_pins()

    def block_view(self, block_id: int) -> Buffer:
        """Return the 1-D uint8 view of one block."""
        size = self.layout.chunk_bytes
        return self._buffer[block_id * size : (block_id + 1) * size]

    def is_pinned(self, key: ChunkKey) -> bool:
        """Return whether `key` is resident and pinned."""
        block_id = self._blocks.get(key)
        return block_id is not None and self._pool.pin_count(block_id) > 0

    def resident_keys(self) -> list[ChunkKey]:
        """Return the keys held now."""
        return list(self._blocks)

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        return [key in self._blocks for key in keys]

    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        self._check_buffers(keys, dsts)
        found: list[bool] = []
        for key, dst in zip(keys, dsts, strict=True):
            block_id = self._blocks.get(key)
            if block_id is None:
                found.append(False)
                continue
            np.copyto(dst, self.block_view(block_id).reshape(dst.shape))
            found.append(True)
        hits = sum(found)
        self.counters.hits += hits
        self.counters.misses += len(found) - hits
        self.counters.bytes_read += hits * self.layout.chunk_bytes
        return found

    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        self._check_buffers(keys, srcs)
        stored: list[bool] = []
        for key, src in zip(keys, srcs, strict=True):
            if key in self._blocks:
                stored.append(True)
                continue
            block_id = self._pool.allocate()
            if block_id is None:
                self.counters.declined += 1
                stored.append(False)
                continue
            self.block_view(block_id)[:] = np.ascontiguousarray(src).reshape(-1)
            self._blocks[key] = block_id
            self.counters.puts += 1
            self.counters.bytes_written += self.layout.chunk_bytes
            stored.append(True)
        return stored

    async def delete(self, keys: Sequence[ChunkKey]) -> None:
        # docstring inherited
        self._ensure_open()
        for key in keys:
            block_id = self._blocks.pop(key, None)
            if block_id is None:
                continue
            if self._pool.pin_count(block_id):
                self._doomed.add(block_id)
            else:
                self._pool.free(block_id)

    def usage(self) -> TierUsage:
        # docstring inherited
        entries = len(self._blocks)
        return TierUsage(self.capacity_bytes, entries * self.layout.chunk_bytes, entries)

    def pinned(self, keys: Sequence[ChunkKey]) -> PinnedViews:
        """Return an async context that pins the resident `keys` and yields their views.

        The views are `None` where a key is not resident. The blocks can be neither evicted
        nor reused until the context exits, also when the task is cancelled inside it.
        """
        self._ensure_open()
        return PinnedViews(self, [self._blocks.get(key) for key in keys])

    def reserve(self, keys: Sequence[ChunkKey]) -> Reserved:
        """Return an async context that yields blocks to fill in place for leading `keys`.

        Fewer views than keys come back when too few blocks are free. When the context exits
        normally, each block whose `keep` flag is still set becomes its key's entry; the rest
        are freed. On an exception (cancellation included) every block is freed and nothing
        is stored. A key stored meanwhile by another task keeps its existing block.
        """
        self._ensure_open()
        count = min(len(keys), self._pool.num_free_blocks)
        return Reserved(self, list(keys[:count]), self._pool.allocate_many(count) or [])

    def _unpin(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self._pool.unpin(block_id)
            if block_id in self._doomed and not self._pool.pin_count(block_id):
                self._doomed.discard(block_id)
                self._pool.free(block_id)

    def _settle(self, keys: list[ChunkKey], block_ids: list[int], keep: list[bool]) -> None:
        commit = self._state is TierState.OPEN
        for key, block_id, kept in zip(keys, block_ids, keep, strict=True):
            if commit and kept and key not in self._blocks:
                self._blocks[key] = block_id
                self.counters.puts += 1
                self.counters.bytes_written += self.layout.chunk_bytes
            else:
                self._pool.free(block_id)


class PinnedViews:
    """Pins held on a memory tier's blocks for one `async with` (see `MemoryTier.pinned`)."""

    __slots__ = ("_block_ids", "_held", "_tier")

    # NOTE: a class rather than @asynccontextmanager: this is on every load's hot path, and
    # a generator-based context costs about as much as the rest of a small load.
    def __init__(self, tier: MemoryTier, block_ids: list[int | None]) -> None:
        self._tier = tier
        self._block_ids = block_ids
        self._held: list[int] = []

    async def __aenter__(self) -> list[Buffer | None]:
        pool, view = self._tier._pool, self._tier.block_view
        for block_id in self._block_ids:
            if block_id is not None:
                pool.pin(block_id)
                self._held.append(block_id)
        return [None if b is None else view(b) for b in self._block_ids]

    async def __aexit__(self, *exc_info: object) -> None:
        held, self._held = self._held, []
        self._tier._unpin(held)


class Reserved:
    """Blocks reserved on a memory tier for one `async with` (see `MemoryTier.reserve`)."""

    __slots__ = ("_block_ids", "_keys", "_reservation", "_tier")

    def __init__(self, tier: MemoryTier, keys: list[ChunkKey], block_ids: list[int]) -> None:
        self._tier = tier
        self._keys = keys
        self._block_ids = block_ids
        views = [tier.block_view(b) for b in block_ids]
        self._reservation = Reservation(views, [True] * len(block_ids))

    async def __aenter__(self) -> Reservation:
        return self._reservation

    async def __aexit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        keep = self._reservation.keep if exc_type is None else [False] * len(self._block_ids)
        block_ids, self._block_ids = self._block_ids, []
        self._tier._settle(self._keys, block_ids, keep)


@dataclass(slots=True)
class Reservation:
    """Blocks reserved by `MemoryTier.reserve`, to fill in place."""

    views: list[Buffer]
    """One 1-D block view per reserved key, in key order."""
    keep: list[bool]
    """Whether to commit each block on exit; clear a flag for a block left unfilled."""


class DRAMTier(MemoryTier):
    """Host DRAM tier: one pre-allocated (pinned, when CUDA is present) buffer of blocks."""

    kind = "dram"
