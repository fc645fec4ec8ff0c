"""Where loaded chunks go and where stored chunks come from: tensors or an engine's pages.

The mover hands a sink the tier buffers of some chunks while they are pinned or reserved;
the sink must finish with them before it returns (a CUDA copy is awaited, also when the
task is cancelled meanwhile, so no block is reused under a copy in flight).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtiers._host_copies import HostCopier, Pair
from kvtiers._tensors import host_bytes
from kvtiers.core.layout import KVLayout
from kvtiers.gpu.copy_engine import CopyEngine
from kvtiers.gpu.handle import CopyHandle
from kvtiers.gpu.paged import PagedKV, payload_tensor
from kvtiers.tiers._layers import layer_pieces, write_layers
from kvtiers.tiers.base import Buffer

__all__ = [
    "Chunk",
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

    Host copies go through `copier` (several threads for a large batch).
    """

    def __init__(self, layout: KVLayout, out: torch.Tensor, copier: HostCopier) -> None:
        self._layout = layout
        self._out = out
        self._out_bytes = host_bytes(out)
        self._copier = copier

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
        for idx, view in zip(idxs, views, strict=True):
            dst = self.direct(idx)
            if dst is not None and isinstance(view, np.ndarray):
                # NOTE: NumPy copies, spread over threads by piece, beat a parallel torch
                # copy per chunk on the host.
                host.append((dst, view.reshape(dst.shape)))
            else:
                self._out.narrow(2, idx * size, size).copy_(payload_tensor(self._layout, view))
        self._copier.copy(host)

    async def deliver_layers(self, idxs: list[int], views: Sequence[View], layers: range) -> None:
        # docstring inherited
        size, part = self._layout.chunk_size, slice(layers.start, layers.stop)
        for idx, view in zip(idxs, views, strict=True):
            dst = self.direct(idx)
            if dst is not None and isinstance(view, np.ndarray):
                _copy_layers(dst, view, layers, self._layout)
            else:
                src = payload_tensor(self._layout, view)[part]
                self._out[part].narrow(2, idx * size, size).copy_(src)


class TensorSource(Source):
    """Fill from a KV tensor `(num_layers, planes, tokens, ...)` on any device.

    Host copies go through `copier` (several threads for a large batch).
    """

    def __init__(self, layout: KVLayout, kv: torch.Tensor, copier: HostCopier) -> None:
        self._layout = layout
        self._kv = kv
        self._kv_bytes = host_bytes(kv)
        self._copier = copier

    async def fill(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        size = self._layout.chunk_size
        host: list[Pair] = []
        for idx, view in zip(idxs, views, strict=True):
            lo = idx * size
            if self._kv_bytes is not None and isinstance(view, np.ndarray):
                src = self._kv_bytes[:, :, lo : lo + size]
                host.append((view.reshape(src.shape), src))
            else:
                payload_tensor(self._layout, view).copy_(self._kv.narrow(2, lo, size))
        self._copier.copy(host)


Chunk = torch.Tensor | Buffer
"""One chunk of the key-level API: a payload-shaped tensor, or its bytes as a uint8 array."""


def _chunk_bytes(chunk: Chunk) -> Buffer | None:
    return chunk if isinstance(chunk, np.ndarray) else host_bytes(chunk)


class ChunkSink(Sink):
    """Deliver chunk `i` into `dsts[i]` (see `Chunk`).

    Host memory (a permuted view is fine when its last axis is contiguous) is filled by the
    tiers directly; device tensors through one copy. Host copies go through `copier`
    (several threads for a large batch).
    """

    def __init__(self, layout: KVLayout, dsts: Sequence[Chunk], copier: HostCopier) -> None:
        self._layout = layout
        self._dsts = dsts
        self._bytes = [_chunk_bytes(dst) for dst in dsts]
        self._copier = copier

    def direct(self, idx: int) -> Buffer | None:
        # docstring inherited
        return self._bytes[idx]

    async def deliver(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        host: list[Pair] = []
        for idx, view in zip(idxs, views, strict=True):
            dst = self._bytes[idx]
            if dst is not None:
                src = view if isinstance(view, np.ndarray) else view.cpu().numpy()
                host.append((dst, src.reshape(dst.shape)))
            else:
                target = self._dsts[idx]
                assert isinstance(target, torch.Tensor)
                target.copy_(payload_tensor(self._layout, view))
        self._copier.copy(host)

    async def deliver_layers(self, idxs: list[int], views: Sequence[View], layers: range) -> None:
        # docstring inherited
        part = slice(layers.start, layers.stop)
        for idx, view in zip(idxs, views, strict=True):
            dst = self._bytes[idx]
            if dst is not None and isinstance(view, np.ndarray):
                _copy_layers(dst, view, layers, self._layout)
            else:
                target = self._dsts[idx]
                assert isinstance(target, torch.Tensor)
                target[part].copy_(payload_tensor(self._layout, view)[part])


def _copy_layers(dst: Buffer, view: Buffer, layers: range, layout: KVLayout) -> None:
    """Copy `layers` of the chunk bytes `view` (C-contiguous) into the chunk buffer `dst`."""
    pieces = layer_pieces(view.reshape(-1).data, layers, layout.layer_bytes)
    write_layers(dst, pieces, layout.num_layers)


class ChunkSource(Source):
    """Fill chunk `i` from `srcs[i]` (see `Chunk`); host copies through `copier`."""

    def __init__(self, layout: KVLayout, srcs: Sequence[Chunk], copier: HostCopier) -> None:
        self._layout = layout
        self._srcs = srcs
        self._bytes = [_chunk_bytes(src) for src in srcs]
        self._copier = copier

    def direct(self, idx: int) -> Buffer | None:
        # docstring inherited
        src = self._bytes[idx]
        if src is None or not src.flags.c_contiguous:
            return None
        return src.reshape(-1)

    async def fill(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        host: list[Pair] = []
        for idx, view in zip(idxs, views, strict=True):
            src = self._bytes[idx]
            if src is not None:
                if isinstance(view, np.ndarray):
                    host.append((view.reshape(src.shape), src))
                else:  # a device block: its bytes, flat
                    view.copy_(torch.from_numpy(np.ascontiguousarray(src)).view(-1))
            else:
                source = self._srcs[idx]
                assert isinstance(source, torch.Tensor)
                payload_tensor(self._layout, view).copy_(source)
        self._copier.copy(host)


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
            await _until_done(self._engine.scatter(self._paged, self._table, idxs, srcs))


class PagedSource(_Paged, Source):
    """Gather from an engine's paged KV through a copy engine."""

    async def fill(self, idxs: list[int], views: Sequence[View]) -> None:
        # docstring inherited
        if idxs:
            dsts = [payload_tensor(self._layout, v) for v in views]
            await _until_done(self._engine.gather(self._paged, self._table, idxs, dsts))


async def _until_done(handle: CopyHandle) -> None:
    """Await a copy; if cancelled meanwhile, still wait for it before re-raising.

    The caller's pins and reservations are released when this returns, so a block must
    not be given back while a device copy still reads or writes it.
    """
    # NOTE: a short-lived waiter task, owned here: shield keeps the copy's completion
    # observable after our own await is cancelled.
    waiter = asyncio.ensure_future(handle.wait())
    cancelled = False
    while not waiter.done():
        try:
            await asyncio.shield(waiter)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    waiter.result()
