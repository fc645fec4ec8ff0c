"""Asynchronous copies between paged KV and chunk payloads, layer by layer."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterable, Sequence
from types import TracebackType
from typing import Any, Self

import torch

from kvtiers.core.errors import CacheStateError, InvalidInputError
from kvtiers.core.layout import KVLayout
from kvtiers.gpu import _kernels as k
from kvtiers.gpu._streams import CopyStream
from kvtiers.gpu.handle import CopyHandle, CopyStats
from kvtiers.gpu.paged import PagedKV, unit_width

__all__ = ["CopyEngine", "EngineState", "LayerFeed"]

logger = logging.getLogger("kvtiers")

_MIB = 1 << 20


class EngineState(enum.Enum):
    """Lifecycle of a copy engine: opened once, closed once."""

    UNOPENED = 1  # built; no streams yet
    OPEN = 2  # streams created; copies allowed
    CLOSED = 3  # in-flight copies drained, streams released; cannot be reopened


class CopyEngine:
    """Move chunks between an engine's paged KV and payloads without stalling.

    The engine owns one host-to-device and one device-to-host stream on its device (no-op
    stand-ins on CPU, where every copy is synchronous). `gather` copies chunks out of paged
    KV into payloads (a store), `scatter` copies payloads into paged KV (a load), and
    `scatter_layerwise` scatters layers as a slow source delivers them. Each returns at
    once with a `CopyHandle` whose per-layer events the caller awaits.

    Payloads are tensors of `layout.chunk_shape()` in the layout's dtype, contiguous: views
    of pinned DRAM blocks (`payload_tensor(layout, block_view)`) or of HBM blocks. Each
    chunk's bytes cross between memories exactly once per direction (see `stats`).

    Use it as an async context manager: `async with CopyEngine(layout, "cuda:0") as eng`.

    Args:
        layout: the chunk layout of the payloads.
        device: the device of the paged KV (`"cuda:0"`, or `"cpu"`).
        staging_bytes: the most device memory one layer's staging buffer may take; larger
            batches are staged in parts.
        poll_interval_s: the longest sleep between two polls of a copy's event.
        force_staging: stage through a buffer even when payloads share the KV's device
            (a test seam: it runs the CUDA path's packing on CPU).
    """

    def __init__(
        self,
        layout: KVLayout,
        device: str | torch.device,
        *,
        staging_bytes: int = 256 * _MIB,
        poll_interval_s: float = 2.5e-4,
        force_staging: bool = False,
    ) -> None:
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidInputError(f"copy engine: bad device {device!r}: {exc}") from exc
        if self.device.type not in ("cuda", "cpu"):
            raise InvalidInputError(f"copy engine: device {device!r} is not CUDA or CPU")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        self.layout = layout
        self.stats = CopyStats()
        """Counters of what was moved."""
        self._staging_bytes = staging_bytes
        self._poll_s = poll_interval_s
        self._force_staging = force_staging
        self._state = EngineState.UNOPENED
        self._h2d: CopyStream | None = None
        self._d2h: CopyStream | None = None
        self._inflight: list[CopyHandle] = []

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        """The lifecycle state."""
        return self._state

    async def open(self) -> None:
        """Create the streams.

        Raises:
            CacheStateError: the engine was opened before.
            InvalidInputError: the device is a CUDA device that is not available.
        """
        if self._state is not EngineState.UNOPENED:
            raise CacheStateError(f"a copy engine opens once; this one is {self._state.name}")
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise InvalidInputError(f"copy engine: {self.device} needs CUDA; none is present")
            if self.device.index is not None and self.device.index >= torch.cuda.device_count():
                raise InvalidInputError(f"copy engine: no device {self.device}")
        self._h2d, self._d2h = CopyStream(self.device), CopyStream(self.device)
        self._state = EngineState.OPEN

    async def aclose(self) -> None:
        """Wait for the copies in flight, then release the streams; idempotent."""
        if self._state is EngineState.OPEN:
            self._state = EngineState.CLOSED
            for handle in self._inflight:
                handle._finish(CacheStateError("the copy engine was closed"))
                # A failed feed raises here; its own waiters see the error.
                with contextlib.suppress(Exception):
                    await asyncio.shield(_settle(handle))
            self._inflight.clear()
            self._h2d = self._d2h = None
        self._state = EngineState.CLOSED

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _streams(self) -> tuple[CopyStream, CopyStream]:
        if self._state is not EngineState.OPEN or self._h2d is None or self._d2h is None:
            raise CacheStateError(f"the copy engine is {self._state.name.lower()}, not open")
        return self._h2d, self._d2h

    # -- copies ---------------------------------------------------------------------------------

    def gather(
        self,
        paged: PagedKV,
        block_table: Any,
        chunk_idxs: Sequence[int],
        dsts: Sequence[torch.Tensor],
        *,
        layers: Sequence[int] | None = None,
    ) -> CopyHandle:
        """Copy chunks of a request out of paged KV into payloads (a store).

        The copy is ordered after the work queued on the device's current stream (the
        forward pass that wrote the KV), runs layer by layer on the device-to-host stream,
        and records one event per layer.

        Args:
            paged: the engine's KV.
            block_table: the request's engine block ids in token order.
            chunk_idxs: the request's chunks to copy; `dsts[j]` receives `chunk_idxs[j]`.
            dsts: payload tensors, on the host (pinned) or on the KV's device.
            layers: the layers to copy (all by default), e.g. one layer just computed.

        Returns:
            The handle to await; keep the destinations pinned until it is done.

        Raises:
            LayoutMismatch: `paged` or a payload does not match the layout.
            InvalidInputError: bad block table, chunk indices, layers or devices; nothing
                is written.
            CacheStateError: the engine is not open.
        """
        _, d2h = self._streams()
        todo = self._check_layers(layers)
        on_host = self._check_payloads(paged, dsts, len(chunk_idxs), "dsts", full=True)
        handle = CopyHandle(todo, self.device, self._poll_s)
        d2h.wait_current()  # before `use`: inside it the copy stream is the current one
        with d2h.use():
            plan = k.plan_batch(paged, self.layout, block_table, chunk_idxs, unique=False)
            staged = on_host or self._force_staging
            for layer in todo:
                slices = [dst[layer] for dst in dsts]
                self._gather_layer(plan, layer, slices, staged)
                handle._record(layer, d2h.record())
        handle._hold(plan, list(dsts))
        handle._finish()
        self.stats.gathers += 1
        return self._track(handle)

    def scatter(
        self,
        paged: PagedKV,
        block_table: Any,
        chunk_idxs: Sequence[int],
        srcs: Sequence[torch.Tensor],
        *,
        layers: Sequence[int] | None = None,
    ) -> CopyHandle:
        """Copy payloads into a request's chunks in paged KV (a load).

        The copy runs layer by layer on the host-to-device stream, after the work already
        queued on the current stream; await `handle.wait_layer(i)` (or call
        `handle.stream_wait_layer(i)`) before layer `i`'s attention reads the blocks.

        Args:
            paged: the engine's KV.
            block_table: the request's engine block ids in token order.
            chunk_idxs: the request's chunks to fill; `srcs[j]` fills `chunk_idxs[j]`.
            srcs: payload tensors, on the host (pinned) or on the KV's device.
            layers: the layers to copy (all by default).

        Returns:
            The handle to await; keep the sources pinned until it is done.

        Raises:
            LayoutMismatch: `paged` or a payload does not match the layout.
            InvalidInputError: bad block table, chunk indices, layers or devices, or two
                chunks share a block; nothing is written.
            CacheStateError: the engine is not open.
        """
        self._check_payloads(paged, srcs, len(chunk_idxs), "srcs", full=True)
        feed = self.scatter_layerwise(paged, block_table, chunk_idxs, layers=layers)
        for layer in feed.handle.layers:
            feed.put_layer(layer, [src[layer] for src in srcs])
        feed.finish()
        return feed.handle

    def scatter_layerwise(
        self,
        paged: PagedKV,
        block_table: Any,
        chunk_idxs: Sequence[int],
        *,
        layers: Sequence[int] | None = None,
    ) -> LayerFeed:
        """Start a load whose layers are copied as a source delivers them.

        Feed it with `LayerFeed.put_layer` or `await LayerFeed.feed(source)`; meanwhile
        `feed.handle.wait_layer(i)` returns as soon as layer `i` has landed, while later
        layers are still on their way.

        Raises:
            LayoutMismatch: `paged` does not match the layout.
            InvalidInputError: bad block table, chunk indices or layers; two chunks share
                a block.
            CacheStateError: the engine is not open.
        """
        h2d, _ = self._streams()
        todo = self._check_layers(layers)
        h2d.wait_current()  # before `use`: inside it the copy stream is the current one
        with h2d.use():
            plan = k.plan_batch(paged, self.layout, block_table, chunk_idxs, unique=True)
        handle = CopyHandle(todo, self.device, self._poll_s)
        handle._hold(plan)
        self.stats.scatters += 1
        return LayerFeed(self, plan, self._track(handle))

    # -- internals ------------------------------------------------------------------------------

    def _gather_layer(
        self, plan: k.BatchPlan, layer: int, slices: list[torch.Tensor], staged: bool
    ) -> None:
        """Issue one layer's copies out of paged KV (the d2h stream is current)."""
        if not staged:
            width = unit_width([plan.paged.unit_width, *(s.data_ptr() for s in slices)])
            self.stats.ops += k.gather_direct(plan, layer, slices, width)
        else:
            for lo, hi in self._parts(plan.num_chunks):
                stage = k.new_staging(plan, hi - lo)
                self.stats.ops += k.pack(plan, layer, lo, hi, stage)
                rows = stage.view(torch.uint8).view(hi - lo, -1)
                for j in range(lo, hi):
                    _bytes(slices[j]).copy_(rows[j - lo], non_blocking=True)
                self.stats.ops += hi - lo
            self.stats.staged_bytes += plan.num_chunks * self.layout.layer_bytes
        self.stats.bytes_out += plan.num_chunks * self.layout.layer_bytes

    def _scatter_layer(
        self, plan: k.BatchPlan, layer: int, slices: Sequence[torch.Tensor], staged: bool
    ) -> None:
        """Issue one layer's copies into paged KV (the h2d stream is current)."""
        if not staged:
            width = unit_width([plan.paged.unit_width, *(s.data_ptr() for s in slices)])
            self.stats.ops += k.scatter_direct(plan, layer, slices, width)
        else:
            for lo, hi in self._parts(plan.num_chunks):
                stage = k.new_staging(plan, hi - lo)
                rows = stage.view(torch.uint8).view(hi - lo, -1)
                for j in range(lo, hi):
                    rows[j - lo].copy_(_bytes(slices[j]), non_blocking=True)
                self.stats.ops += hi - lo + k.unpack(plan, layer, lo, hi, stage)
            self.stats.staged_bytes += plan.num_chunks * self.layout.layer_bytes
        self.stats.bytes_in += plan.num_chunks * self.layout.layer_bytes

    def _parts(self, num_chunks: int) -> list[tuple[int, int]]:
        per = max(1, self._staging_bytes // self.layout.layer_bytes)
        return [(lo, min(num_chunks, lo + per)) for lo in range(0, num_chunks, per)]

    def _check_layers(self, layers: Sequence[int] | None) -> list[int]:
        num = self.layout.num_layers
        todo = list(range(num)) if layers is None else [int(x) for x in layers]
        if any(not 0 <= x < num for x in todo) or len(set(todo)) != len(todo):
            raise InvalidInputError(f"layers: {todo} are not distinct layers in [0, {num})")
        return todo

    def _check_payloads(
        self, paged: PagedKV, payloads: Sequence[torch.Tensor], num: int, name: str, full: bool
    ) -> bool:
        """Check payloads (or layer slices); return whether they are on the host."""
        if paged.device != self.device:
            raise InvalidInputError(f"paged KV is on {paged.device}, the engine on {self.device}")
        return k.check_payloads(self.layout, paged.device, payloads, num, name, full=full)

    def _track(self, handle: CopyHandle) -> CopyHandle:
        self._inflight = [h for h in self._inflight if not (h.finished and h.done())]
        self._inflight.append(handle)
        return handle


class LayerFeed:
    """A load into paged KV whose layers are copied as they arrive.

    Made by `CopyEngine.scatter_layerwise`. Each `put_layer` issues one layer's copies
    for every chunk of the batch and records that layer's event in `handle`.
    """

    def __init__(self, engine: CopyEngine, plan: k.BatchPlan, handle: CopyHandle) -> None:
        self._engine = engine
        self._plan = plan
        self.handle = handle
        """The handle whose `wait_layer(i)` returns once layer `i` has landed."""

    def put_layer(self, layer: int, srcs: Sequence[torch.Tensor]) -> None:
        """Issue one layer's copies for every chunk, in the batch's chunk order.

        Args:
            layer: the layer, one of `handle.layers`, each at most once.
            srcs: per chunk its contiguous layer slice `layout.chunk_shape()[1:]` (a
                payload's `[layer]`), on the host (pinned) or on the KV's device.

        Raises:
            InvalidInputError: the feed is finished, the layer is not expected or came
                before, or a slice is bad; nothing is written.
        """
        engine, handle = self._engine, self.handle
        if handle.finished:
            raise InvalidInputError("the layer feed is finished")
        if handle.submitted(layer):
            raise InvalidInputError(f"layer {layer} was fed already")
        paged = self._plan.paged
        num = self._plan.num_chunks
        on_host = engine._check_payloads(paged, srcs, num, "srcs", full=False)
        h2d, _ = engine._streams()
        with h2d.use():
            engine._scatter_layer(self._plan, layer, srcs, on_host or engine._force_staging)
            handle._record(layer, h2d.record())
        handle._hold(list(srcs))

    def finish(self, failure: BaseException | None = None) -> None:
        """End the feed; layers not fed by now make their waiters raise."""
        self.handle._finish(failure)

    async def feed(self, source: AsyncIterable[tuple[int, Sequence[torch.Tensor]]]) -> None:
        """Put each `(layer, srcs)` the source yields, then finish the feed.

        An error of the source (or a bad layer) does not propagate here: it finishes the
        feed, and whoever waits for a missing layer gets a `TierIOError` caused by it.
        Cancellation finishes the feed and propagates.
        """
        try:
            async for layer, srcs in source:
                self.put_layer(layer, srcs)
        except asyncio.CancelledError as exc:
            self.finish(exc)
            raise
        except Exception as exc:
            logger.warning("kvtiers: layer feed failed: %r", exc)
            self.finish(exc)
            return
        self.finish()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous tensor as its raw bytes (what a DMA copy moves)."""
    return t.view(torch.uint8).view(-1)


async def _settle(handle: CopyHandle) -> None:
    for layer in handle.layers:
        if handle.submitted(layer):
            await handle.wait_layer(layer)
