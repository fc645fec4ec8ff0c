"""Host-memory tier: chunks in fixed-size blocks of one pre-allocated buffer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtiers.core.blockpool import BlockPool
from kvtiers.core.config import TierConfig, format_size
from kvtiers.core.errors import TierIOError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.tiers.base import Buffer
from kvtiers.tiers.blocks import BlockTier

__all__ = ["Allocator", "DRAMTier", "MemoryTier"]

Allocator = Callable[[int], Buffer]
"""Return a 1-D uint8 buffer of the given byte size (pinned host memory, for instance)."""


def _numpy_allocator(num_bytes: int) -> Buffer:
    return np.empty(num_bytes, dtype=np.uint8)


class MemoryTier(BlockTier[Buffer]):
    """A block tier in host memory; its views are NumPy bytes that copies use in place.

    Args:
        config: this tier's config.
        layout: the KV layout.
        allocate: returns the tier's buffer; plain NumPy memory by default.
    """

    def __init__(
        self, config: TierConfig, layout: KVLayout, allocate: Allocator | None = None
    ) -> None:
        super().__init__(config, layout)
        self._allocate = allocate or _numpy_allocator
        self._buffer: Buffer = np.empty(0, dtype=np.uint8)

    @classmethod
    def from_config(cls, config: TierConfig, layout: KVLayout, **resources: Any) -> MemoryTier:
        # docstring inherited
        return cls(config, layout, allocate=resources.get("allocate"))

    async def _open(self) -> None:
        num_bytes = self.num_chunks * self.layout.chunk_bytes
        try:
            self._buffer = self._allocate(num_bytes)
        except (MemoryError, ValueError, RuntimeError) as exc:  # numpy's and torch's
            raise TierIOError(
                f"{self.name}: cannot allocate {format_size(num_bytes)} of host memory: {exc}"
            ) from exc
        self._pool = BlockPool(self.num_chunks)

    async def _close(self) -> None:
        self._blocks.clear()
        self._buffer = np.empty(0, dtype=np.uint8)

    @property
    def buffer(self) -> Buffer:
        """The whole pre-allocated buffer (for registering it with a copy engine)."""
        return self._buffer

    def block_view(self, block_id: int) -> Buffer:
        # docstring inherited
        size = self.layout.chunk_bytes
        return self._buffer[block_id * size : (block_id + 1) * size]

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
            self._commit(key, block_id)
            stored.append(True)
        return stored


class DRAMTier(MemoryTier):
    """Host DRAM tier: one pre-allocated (pinned, when CUDA is present) buffer of blocks."""

    kind = "dram"
