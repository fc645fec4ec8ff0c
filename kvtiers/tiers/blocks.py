"""Tiers of pre-allocated blocks (DRAM, HBM): bookkeeping, pins and in-place reservations."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtiers.core.blockpool import BlockPool
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierUsage
from kvtiers.tiers.base import Tier, TierState, check_option_keys

__all__ = ["BlockTier", "PinnedViews", "Reservation", "Reserved"]

ViewT = TypeVar("ViewT")


class BlockTier(Tier, Generic[ViewT]):
    """A tier whose chunks live in fixed-size blocks of one buffer, one chunk per block.

    It keeps the key-to-block map over a `BlockPool` and offers, beyond the tier contract,
    `pinned` (views of resident chunks, pinned while the context is open, so a copy can read
    them in place) and `reserve` (blocks to fill in place, committed when the context exits
    normally). Subclasses own the buffer and its views: host NumPy bytes for DRAM, device
    tensors for HBM. Eviction is the cache's job: `put` declines when no block is free.

    Args:
        config: this tier's config; kind options beyond `_OPTIONS` are refused.
        layout: the KV layout.

    Raises:
        ConfigError: an unknown option, or a capacity below one chunk.
    """

    _OPTIONS: frozenset[str] = frozenset()

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        check_option_keys(config, self.kind, self._OPTIONS)
        self.num_chunks = config.capacity_bytes // layout.chunk_bytes
        """Blocks in the buffer: the capacity in whole chunks."""
        if self.num_chunks < 1:
            raise ConfigError(
                f"{config.where}.capacity: {config.capacity_bytes} bytes is too small for one "
                f"chunk of {layout.chunk_bytes} bytes"
            )
        self._pool = BlockPool(0)
        self._blocks: dict[ChunkKey, int] = {}
        # Deleted while pinned: freed when the last pin goes.
        self._doomed: set[int] = set()

    @abstractmethod
    def block_view(self, block_id: int) -> ViewT:
        """Return the 1-D uint8 view of one block."""

    @property
    def num_free_chunks(self) -> int:
        """Blocks free now."""
        return self._pool.num_free_blocks

    @property
    def total_pins(self) -> int:
        """Sum of pin counts over all blocks (zero when no copy is in flight)."""
        return self._pool.total_pins()

    def is_pinned(self, key: ChunkKey) -> bool:
        """Return whether `key` is resident and pinned."""
        block_id = self._blocks.get(key)
        return block_id is not None and self._pool.pin_count(block_id) > 0

    def holds(self, key: ChunkKey) -> bool:
        """Return whether `key` is resident now."""
        return key in self._blocks

    def resident_keys(self) -> list[ChunkKey]:
        """Return the keys held now."""
        return list(self._blocks)

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        return [key in self._blocks for key in keys]

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

    def pinned(self, keys: Sequence[ChunkKey]) -> PinnedViews[ViewT]:
        """Return an async context that pins the resident `keys` and yields their views.

        The views are `None` where a key is not resident. The blocks can be neither evicted
        nor reused until the context exits, also when the task is cancelled inside it; a
        copy that reads the views must be awaited before the context exits.
        """
        self._ensure_open()
        return PinnedViews(self, [self._blocks.get(key) for key in keys])

    def reserve(self, keys: Sequence[ChunkKey]) -> Reserved[ViewT]:
        """Return an async context that yields blocks to fill in place for leading `keys`.

        Fewer views than keys come back when too few blocks are free. When the context exits
        normally, each block whose `keep` flag is still set becomes its key's entry; the rest
        are freed. On an exception (cancellation included) every block is freed and nothing
        is stored. A key stored meanwhile by another task keeps its existing block.
        """
        self._ensure_open()
        count = min(len(keys), self.num_free_chunks)
        return Reserved(self, list(keys[:count]), self._pool.allocate_many(count) or [])

    def _unpin(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self._pool.unpin(block_id)
            if block_id in self._doomed and not self._pool.pin_count(block_id):
                self._doomed.discard(block_id)
                self._pool.free(block_id)

    def _free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self._pool.free(block_id)

    def _settle(self, keys: list[ChunkKey], block_ids: list[int], keep: list[bool]) -> None:
        commit = self._state is TierState.OPEN
        for key, block_id, kept in zip(keys, block_ids, keep, strict=True):
            if commit and kept and key not in self._blocks:
                self._commit(key, block_id)
            else:
                self._pool.free(block_id)

    def _commit(self, key: ChunkKey, block_id: int) -> None:
        self._blocks[key] = block_id
        self.counters.puts += 1
        self.counters.bytes_written += self.layout.chunk_bytes


@dataclass(slots=True)
class Reservation(Generic[ViewT]):
    """Blocks reserved by `BlockTier.reserve`, to fill in place."""

    views: list[ViewT]
    """One 1-D block view per reserved key, in key order."""
    keep: list[bool]
    """Whether to commit each block on exit; clear a flag for a block left unfilled."""


class PinnedViews(Generic[ViewT]):
    """Pins held on a block tier's blocks for one `async with` (see `BlockTier.pinned`)."""

    __slots__ = ("_block_ids", "_held", "_tier")

    # NOTE: a class rather than @asynccontextmanager: this is on every load's hot path, and
    # a generator-based context costs about as much as the rest of a small load.
    def __init__(self, tier: BlockTier[ViewT], block_ids: list[int | None]) -> None:
        self._tier = tier
        self._block_ids = block_ids
        self._held: list[int] = []

    async def __aenter__(self) -> list[ViewT | None]:
        pool, view = self._tier._pool, self._tier.block_view
        for block_id in self._block_ids:
            if block_id is not None:
                pool.pin(block_id)
                self._held.append(block_id)
        return [None if b is None else view(b) for b in self._block_ids]

    async def __aexit__(self, *exc_info: object) -> None:
        held, self._held = self._held, []
        self._tier._unpin(held)


class Reserved(Generic[ViewT]):
    """Blocks reserved on a block tier for one `async with` (see `BlockTier.reserve`)."""

    __slots__ = ("_block_ids", "_keys", "_reservation", "_tier")

    def __init__(self, tier: BlockTier[ViewT], keys: list[ChunkKey], block_ids: list[int]) -> None:
        self._tier = tier
        self._keys = keys
        self._block_ids = block_ids
        views = [tier.block_view(b) for b in block_ids]
        self._reservation = Reservation(views, [True] * len(block_ids))

    async def __aenter__(self) -> Reservation[ViewT]:
        return self._reservation

    async def __aexit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        keep = self._reservation.keep if exc_type is None else [False] * len(self._block_ids)
        block_ids, self._block_ids = self._block_ids, []
        self._tier._settle(self._keys, block_ids, keep)
