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
from kvtiers.tiers.base import Buffer, HostCopy, copy_serially
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
        host_copy: copies a batch of `get` or `put` (the cache passes its copy threads);
            one `np.copyto` after another by default.
    """

    def __init__(
        self,
        config: TierConfig,
        layout: KVLayout,
        allocate: Allocator | None = None,
        host_copy: HostCopy | None = None,
    ) -> None:
        super().__init__(config, layout)
        self._allocate = allocate or _numpy_allocator
        self._host_copy = host_copy or copy_serially
        self._buffer: Buffer = np.empty(0, dtype=np.uint8)

    @classmethod
    def from_config(cls, config: TierConfig, layout: KVLayout, **resources: Any) -> MemoryTier:
        # docstring inherited
        return cls(
            config,
            layout,
            allocate=resources.get("allocate"),
            host_copy=resources.get("host_copy"),
        )

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
        found = [self._blocks.get(key) for key in keys]
        pairs = [
            (dst, self.block_view(b).reshape(dst.shape))
            for dst, b in zip(dsts, found, strict=True)
            if b is not None
        ]
        self._host_copy(pairs)
        hits = len(pairs)
        self.counters.read(hits, len(found) - hits, hits * self.layout.chunk_bytes)
        return [b is not None for b in found]

    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        self._check_buffers(keys, srcs)
        stored: list[bool] = []
        writes: dict[ChunkKey, tuple[int, Buffer]] = {}
        for key, src in zip(keys, srcs, strict=True):
            if key in self._blocks or key in writes:
                stored.append(True)
                continue
            block_id = self._pool.allocate()
            if block_id is None:
                self.counters.declined += 1
                stored.append(False)
                continue
            writes[key] = (block_id, src)
            stored.append(True)
        try:
            self._host_copy(
                [(self.block_view(b).reshape(src.shape), src) for b, src in writes.values()]
            )
        except BaseException:
            self._free([b for b, _ in writes.values()])
            raise
        for key, (block_id, _) in writes.items():
            self._commit(key, block_id)
        return stored


class DRAMTier(MemoryTier):
    """Host DRAM tier: one pre-allocated (pinned, when CUDA is present) buffer of blocks."""

    kind = "dram"
