"""GPU-memory tier: chunks in blocks of one pre-allocated device buffer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtiers.core.blockpool import BlockPool
from kvtiers.core.checks import describe
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.gpu._streams import CopyStream, copy_pairs
from kvtiers.gpu.paged import host_tensor
from kvtiers.tiers.base import Buffer, HostCopy, copy_serially
from kvtiers.tiers.blocks import BlockTier

__all__ = ["HBMTier"]


class HBMTier(BlockTier[torch.Tensor]):
    """GPU memory tier: one device buffer of blocks, one chunk per block.

    Beyond the tier contract (whose `get`/`put` copy between device blocks and host
    buffers in one batch per call, through `copy_views`, so that the event loop never
    blocks on a device copy) it offers, like `MemoryTier`, `pinned` (device views of
    resident chunks, pinned for the context) and `reserve` (device blocks to fill in
    place). A copy engine reads and writes those views directly, so loading a chunk kept
    here into an engine's paged KV is one device-to-device copy. Eviction is the cache's
    job: `put` declines when no block is free.

    Config option `device` (default `"cuda:0"`) names the device. `"cpu"` is accepted as
    a test seam, so the tier's logic runs on machines without a GPU; it is not meant for
    production (use `dram`).

    Args:
        config: this tier's config.
        layout: the KV layout.
        host_copy: copies host-to-host pairs of `copy_views` (on the CPU seam); one
            `np.copyto` after another when not given. The cache passes its copy threads
            (resource `host_copy`).

    Raises:
        ConfigError: an unknown option, a bad device, or a capacity below one chunk.
    """

    kind = "hbm"
    _OPTIONS = frozenset({"device"})

    def __init__(
        self, config: TierConfig, layout: KVLayout, host_copy: HostCopy | None = None
    ) -> None:
        super().__init__(config, layout)
        self.device = _parse_device(config.options.get("device", "cuda:0"), config.where)
        """The device holding the blocks."""
        self._host_copy = host_copy or copy_serially
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._stream: CopyStream | None = None

    @classmethod
    def from_config(cls, config: TierConfig, layout: KVLayout, **resources: Any) -> HBMTier:
        # docstring inherited
        return cls(config, layout, host_copy=resources.get("host_copy"))

    async def _open(self) -> None:
        where = f"{self.config.where}.device"
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"{where}: the hbm tier needs CUDA, and no CUDA device is present"
                )
            if (self.device.index or 0) >= torch.cuda.device_count():
                raise ConfigError(f"{where}: no device {self.device}")
        try:
            buffer = torch.empty(
                self.num_chunks * self.layout.chunk_bytes, dtype=torch.uint8, device=self.device
            )
        except RuntimeError as exc:  # torch.OutOfMemoryError derives from it
            raise TierIOError(f"hbm tier {self.name!r}: cannot allocate: {exc}") from exc
        self._buffer = buffer
        self._pool = BlockPool(self.num_chunks)
        self._stream = CopyStream(self.device)

    async def _close(self) -> None:
        self._blocks.clear()
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._stream = None

    @property
    def buffer(self) -> torch.Tensor:
        """The whole device buffer."""
        return self._buffer

    def block_view(self, block_id: int) -> torch.Tensor:
        """Return the 1-D uint8 device view of one block."""
        size = self.layout.chunk_bytes
        return self._buffer[block_id * size : (block_id + 1) * size]

    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        self._check_buffers(keys, dsts)
        async with self.pinned(keys) as views:
            hits = [(dst, v) for dst, v in zip(dsts, views, strict=True) if v is not None]
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            unaligned: list[tuple[Buffer, torch.Tensor]] = []  # dsts torch cannot wrap
            for dst, view in hits:
                host = host_tensor(dst)
                if host is None:
                    host = torch.empty(dst.shape, dtype=torch.uint8)
                    unaligned.append((dst, host))
                pairs.append((host, view.view(host.shape)))
            await self.copy_views(pairs)
        for dst, host in unaligned:
            np.copyto(dst, host.numpy())
        num_hits = len(hits)
        self.counters.read(num_hits, len(keys) - num_hits, num_hits * self.layout.chunk_bytes)
        return [v is not None for v in views]

    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        self._check_buffers(keys, srcs)
        stored = [key in self._blocks for key in keys]
        todo: dict[ChunkKey, Buffer] = {}  # a key given twice is written once
        for key, src, held in zip(keys, srcs, stored, strict=True):
            if not held:
                todo.setdefault(key, src)
        async with self.reserve(list(todo)) as res:
            pairs = []
            for view, src in zip(res.views, todo.values(), strict=False):
                host = host_tensor(src)
                if host is None:
                    host = torch.from_numpy(np.ascontiguousarray(src))
                pairs.append((view.view(host.shape), host))
            await self.copy_views(pairs)
        self.counters.declined += len(todo) - len(res.views)
        reserved = set(list(todo)[: len(res.views)])
        return [held or key in reserved for key, held in zip(keys, stored, strict=True)]

    async def copy_views(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run `dst.copy_(src)` for each pair, one side a view of this tier's blocks.

        This is how chunks move between this tier's blocks and other memory without a
        call per chunk on the event loop: a lower tier's pinned blocks or a stage on
        promotion, a stage or a lower tier's reserved blocks on demotion, a caller's
        tensors on load and store. On CUDA the copies are queued on the tier's stream
        from a worker thread, which then synchronises once (pinned host memory moves by
        DMA; pageable memory is staged by the driver); on the CPU seam they run inline.

        The copies are ordered after the work already queued on the calling thread's
        current stream, and have landed when this returns. The views belong to the
        caller's `pinned` or `reserve` context, which must not end under a copy in flight:
        a cancellation that arrives meanwhile is raised once every copy has landed.

        Args:
            pairs: `(dst, src)` tensors of one shape and dtype.

        Raises:
            TierIOError: a copy failed on the device.
        """
        self._ensure_open()
        assert self._stream is not None  # set by _open
        try:
            await copy_pairs(self._stream, pairs, self._host_copy)
        except (RuntimeError, ValueError) as exc:
            raise TierIOError(f"hbm tier {self.name!r}: copy failed: {exc}") from exc


def _parse_device(value: object, where: str) -> torch.device:
    if not isinstance(value, str):
        raise ConfigError(
            f"{where}.device: expected a device name such as 'cuda:0', got {describe(value)}"
        )
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"{where}.device: {describe(value)} is not a device name ({exc})"
        ) from exc
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(
            f"{where}.device: {describe(value)} is not a CUDA device such as 'cuda:0'"
        )
    return device if device.type == "cpu" or device.index is not None else torch.device("cuda", 0)
