"""Where loaded chunks go and where stored chunks come from: tensors or an engine's pages.

The mover hands a sink the tier buffers of some chunks while they are pinned or reserved;
the sink must finish with them before it returns (a CUDA copy is awaited, also when the
task is cancelled meanwhile, so no block is reused under a copy in flight).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtiers._host_copies import HostCopier, Pair
from kvtiers._tensors import host_bytes
from kvtiers.core.layout import KVLayout
from kvtiers.gpu._streams import CopyStream, copy_pairs, until_done
from kvtiers.gpu.copy_engine import CopyEngine
from kvtiers.gpu.hbm import HBMTier
from kvtiers.gpu.paged import PagedKV, host_tensor, payload_tensor
from kvtiers.tiers._layers import layer_pieces, write_layers
from kvtiers.tiers.base import Buffer

__all__ = [
    "Chunk",
    "Copies",
    "ChunkSink",
    "ChunkSource",
    "PagedSink",
    "PagedSource",
    "Sink",
    "Source",
    "TensorSink",
    "TensorSource",
    "View",
]

View = Buffer | torch.Tensor
"""A tier block's bytes: a host NumPy view (DRAM) or a device tensor (HBM)."""
TensorPair = tuple[torch.Tensor, torch.Tensor]
"""A `(dst, src)` copy with a side in device memory (an HBM block, a caller's tensor)."""


class Copies:
    """How sinks and sources copy: host bytes on the copy threads, device memory in batches.

    Args:
        host: copies between host buffers (several threads for a large batch).
        hbm: the top tier when it is an HBM tier; its stream carries the device copies.
    """

    def __init__(self, host: HostCopier, hbm: HBMTier | None) -> None:
        self.host = host
        self._hbm = hbm
        self._streams: dict[torch.device, CopyStream] = {}

    async def device(self, pairs: list[TensorPair]) -> None:
        """Copy `(dst, src)` pairs with a side in device memory, in one batch per device.

        The side is an HBM block or the caller's tensor (a DRAM block into a GPU `out=`).
        See `copy_pairs`: one synchronisation per batch, off the event loop's thread.
        """
        if not pairs:
            return
        if self._hbm is not None:
            await self._hbm.copy_views(pairs)
            return
        groups: dict[torch.device, list[TensorPair]] = {}
        for dst, src in pairs:
            groups.setdefault(dst.device if dst.is_cuda else src.device, []).append((dst, src))
        for device, group in groups.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = CopyStream(device)
            await copy_pairs(stream, group, self.host.copy)


class Sink(ABC):
    """Receives chunks that a load found, by chunk index."""

    def direct(self, idx: int) -> Buffer | None:
        """Return host memory a tier may fill with chunk `idx` directly, if any."""
        return None

    @abstractmethod
    async def deliver(self, idxs: list[int], views: Sequence[View]) -> None:
        """Copy chunk `idxs[j]` from `views[j]`; done with the views on return."""

    async def deliver_layers(self, idxs: list[int], views: Sequence[View], layers: range) -> None:
        """Copy only `layers` of chunk `idxs[j]` from `views[j]` (the rest may be stale).

        Sinks that take whole chunks only (an engine's pages) do not override it.
        """
        raise NotImplementedError(f"{type(self).__name__} takes whole chunks only")


class Source(ABC):
    """Supplies the chunks a store writes, by chunk index."""

    @abstractmethod
    async def fill(self, idxs: list[int], views: Sequence[View]) -> None:
        """Copy chunk `idxs[j]` into `views[j]`; done with the views on return."""

    def direct(self, idx: int) -> Buffer | None:
        """Return chunk `idx`'s payload as contiguous host bytes a tier may read in place.

        `None` (the default) when the chunk must be copied out with `fill` first.
        """
        return None


class TensorSink(Sink):
    """Deliver into a KV tensor `(num_layers, planes, tokens, ...)` on any device.

    Host copies go through `copies.host` (several threads for a large batch), copies with
    device memory through `copies.device` (one batch on a stream).
    """

    def __init__(self, layout: KVLayout, out: torch.Tensor, copies: Copies) -> None:
        self._layout = layout
        self._out = out
        self._out_bytes = host_bytes(out)
        self._copies = copies

    def direct(self, idx: int) -> Buffer | None:
        # docstring inherited
        if self._out_bytes is None:
            return None
        size = self._layout.chunk_size
        return self._out_bytes[:, :, idx * size : (idx + 1) * size]

    async def deliver(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        size = self._layout.chunk_size
        host: list[Pair] = []
        device: list[TensorPair] = []
        for idx, view in zip(idxs, views, strict=True):
            dst = self.direct(idx)
            if dst is not None and isinstance(view, np.ndarray):
                # NOTE: NumPy copies, spread over threads by piece, beat a parallel torch
                # copy per chunk on the host.
                host.append((dst, view.reshape(dst.shape)))
                continue
            device.append(
                (self._out.narrow(2, idx * size, size), payload_tensor(self._layout, view))
            )
        self._copies.host.copy(host)
        await self._copies.device(device)

    async def deliver_layers(self, idxs: list[int], views: Sequence[View], layers: range) -> None:
        # docstring inherited
        # NOTE: waves come from tiers that read into host buffers, never from HBM blocks.
        size, part = self._layout.chunk_size, slice(layers.start, layers.stop)
        device: list[TensorPair] = []
        for idx, view in zip(idxs, views, strict=True):
            dst = self.direct(idx)
            if dst is not None and isinstance(view, np.ndarray):
                _copy_layers(dst, view, layers, self._layout)
            else:
                src = payload_tensor(self._layout, view)[part]
                device.append((self._out[part].narrow(2, idx * size, size), src))
        await self._copies.device(device)


class TensorSource(Source):
    """Fill from a KV tensor `(num_layers, planes, tokens, ...)` on any device.

    Host copies go through `copies.host`, copies with device memory through `copies.device`.
    """

    def __init__(self, layout: KVLayout, kv: torch.Tensor, copies: Copies) -> None:
        self._layout = layout
        self._kv = kv
        self._kv_bytes = host_bytes(kv)
        self._copies = copies

    async def fill(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        size = self._layout.chunk_size
        host: list[Pair] = []
        device: list[TensorPair] = []
        for idx, view in zip(idxs, views, strict=True):
            lo = idx * size
            if self._kv_bytes is not None and isinstance(view, np.ndarray):
                src = self._kv_bytes[:, :, lo : lo + size]
                host.append((view.reshape(src.shape), src))
                continue
            device.append((payload_tensor(self._layout, view), self._kv.narrow(2, lo, size)))
        self._copies.host.copy(host)
        await self._copies.device(device)


Chunk = torch.Tensor | Buffer
"""One chunk of the key-level API: a payload-shaped tensor, or its bytes as a uint8 array."""


def _chunk_bytes(chunk: Chunk) -> Buffer | None:
    return chunk if isinstance(chunk, np.ndarray) else host_bytes(chunk)


class ChunkSink(Sink):
    """Deliver chunk `i` into `dsts[i]` (see `Chunk`).

    Host memory (a permuted view is fine when its last axis is contiguous) is filled by the
    tiers directly; device tensors through one copy. Host copies go through `copies.host`
    (several threads for a large batch), copies with device memory through `copies.device`.
    """

    def __init__(self, layout: KVLayout, dsts: Sequence[Chunk], copies: Copies) -> None:
        self._layout = layout
        self._dsts = dsts
        self._bytes = [_chunk_bytes(dst) for dst in dsts]
        self._copies = copies

    def direct(self, idx: int) -> Buffer | None:
        # docstring inherited
        return self._bytes[idx]

    async def deliver(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        host: list[Pair] = []
        device: list[TensorPair] = []
        for idx, view in zip(idxs, views, strict=True):
            dst = self._bytes[idx]
            if dst is None:  # the caller's device tensor
                target = self._dsts[idx]
                assert isinstance(target, torch.Tensor)
                device.append((target, payload_tensor(self._layout, view)))
            elif isinstance(view, np.ndarray):
                host.append((dst, view.reshape(dst.shape)))
            elif (host_dst := host_tensor(dst)) is not None:  # an HBM block into host bytes
                device.append((host_dst, view.view(host_dst.shape)))
            else:  # bytes torch cannot view (negative strides)
                host.append((dst, view.cpu().numpy().reshape(dst.shape)))
        self._copies.host.copy(host)
        await self._copies.device(device)

    async def deliver_layers(self, idxs: list[int], views: Sequence[View], layers: range) -> None:
        # docstring inherited
        part = slice(layers.start, layers.stop)
        device: list[TensorPair] = []
        for idx, view in zip(idxs, views, strict=True):
            dst = self._bytes[idx]
            if dst is not None and isinstance(view, np.ndarray):
                _copy_layers(dst, view, layers, self._layout)
            else:
                target = self._dsts[idx]
                assert isinstance(target, torch.Tensor)
                device.append((target[part], payload_tensor(self._layout, view)[part]))
        await self._copies.device(device)


def _copy_layers(dst: Buffer, view: Buffer, layers: range, layout: KVLayout) -> None:
    """Copy `layers` of the chunk bytes `view` (C-contiguous) into the chunk buffer `dst`."""
    pieces = layer_pieces(view.reshape(-1).data, layers, layout.layer_bytes)
    write_layers(dst, pieces, layout.num_layers)


class ChunkSource(Source):
    """Fill chunk `i` from `srcs[i]` (see `Chunk`).

    Host copies go through `copies.host`, copies with device memory through `copies.device`.
    """

    def __init__(self, layout: KVLayout, srcs: Sequence[Chunk], copies: Copies) -> None:
        self._layout = layout
        self._srcs = srcs
        self._bytes = [_chunk_bytes(src) for src in srcs]
        self._copies = copies

    def direct(self, idx: int) -> Buffer | None:
        # docstring inherited
        src = self._bytes[idx]
        if src is None or not src.flags.c_contiguous:
            return None
        return src.reshape(-1)

    async def fill(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        host: list[Pair] = []
        device: list[TensorPair] = []
        for idx, view in zip(idxs, views, strict=True):
            src = self._bytes[idx]
            if src is None:  # the caller's device tensor
                source = self._srcs[idx]
                assert isinstance(source, torch.Tensor)
                device.append((payload_tensor(self._layout, view), source))
            elif isinstance(view, np.ndarray):
                host.append((view.reshape(src.shape), src))
            else:  # host bytes into an HBM block
                host_src = host_tensor(src)
                if host_src is None:  # bytes torch cannot view (negative strides)
                    host_src = torch.from_numpy(np.ascontiguousarray(src))
                device.append((view.view(host_src.shape), host_src))
        self._copies.host.copy(host)
        await self._copies.device(device)


class _Paged:
    """An engine's paged KV, reached through a copy engine."""

    def __init__(
        self, layout: KVLayout, engine: CopyEngine, paged: PagedKV, block_table: Any
    ) -> None:
        self._layout = layout
        self._engine = engine
        self._paged = paged
        self._table = block_table


class PagedSink(_Paged, Sink):
    """Scatter into an engine's paged KV through a copy engine."""

    async def deliver(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        if idxs:
            srcs = [payload_tensor(self._layout, v) for v in views]
            handle = self._engine.scatter(self._paged, self._table, idxs, srcs)
            await until_done(handle.wait())


class PagedSource(_Paged, Source):
    """Gather from an engine's paged KV through a copy engine."""

    async def fill(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        if idxs:
            dsts = [payload_tensor(self._layout, v) for v in views]
            handle = self._engine.gather(self._paged, self._table, idxs, dsts)
            await until_done(handle.wait())
