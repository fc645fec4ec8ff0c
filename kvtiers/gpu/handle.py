"""The completion of a batched copy, layer by layer, and copy counters."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtiers.core.errors import InvalidInputError, TierIOError
from kvtiers.gpu._streams import Event, wait_event

__all__ = ["CopyHandle", "CopyStats"]


@dataclass(slots=True)
class CopyStats:
    """What a copy engine has moved since it was built."""

    gathers: int = 0
    """`gather` calls."""
    scatters: int = 0
    """`scatter` calls and layer feeds."""
    bytes_out: int = 0
    """Payload bytes written from paged KV into chunk payloads (each byte counts once)."""
    bytes_in: int = 0
    """Payload bytes written from chunk payloads into paged KV."""
    staged_bytes: int = 0
    """Of those, bytes that passed a device staging buffer (host payloads on CUDA only)."""
    ops: int = 0
    """Copy kernels and DMA transfers issued."""


class CopyHandle:
    """The completion of one batched copy: one event per layer.

    `wait_layer(i)` returns once layer `i` of every chunk of the batch has landed, so a
    layer-wise pipeline can start on layer `i` while later layers still travel; `wait()`
    waits for all of them. Waiting polls the events from the event loop and never blocks
    its thread. A layer of a layer-wise feed that never arrives (the source failed or
    ended early) makes its waiters raise `TierIOError`.

    Handles are made by `CopyEngine`; the tensors a copy reads or writes are held here
    until it is done. The caller keeps tier blocks pinned until the handle is awaited.

    Args:
        layers: the layers the copy covers, in submission order.
        device: the device whose streams carry the copy.
        max_poll_s: the longest sleep between two polls of an event.
    """

    __slots__ = (
        "_events",
        "_failure",
        "_finished",
        "_keep",
        "_max_poll_s",
        "_pos",
        "_ready",
        "device",
        "layers",
    )

    def __init__(self, layers: Sequence[int], device: torch.device, max_poll_s: float) -> None:
        self.layers = tuple(layers)
        """The layers this copy covers."""
        self.device = device
        """The device whose streams carry the copy."""
        self._pos = {layer: i for i, layer in enumerate(self.layers)}
        self._events: list[Event | None] = [None] * len(self.layers)
        self._ready = [asyncio.Event() for _ in self.layers]  # set once submitted or failed
        self._failure: BaseException | None = None
        self._finished = False
        self._keep: list[object] = []
        self._max_poll_s = max_poll_s

    # -- producer side (the engine) -------------------------------------------------------

    def _record(self, layer: int, event: Event) -> None:
        pos = self._pos[layer]
        self._events[pos] = event
        self._ready[pos].set()

    def _hold(self, *objs: object) -> None:
        self._keep.extend(objs)

    def _finish(self, failure: BaseException | None = None) -> None:
        """Mark the submission complete; layers not submitted by now never will be."""
        if self._finished:
            return
        self._finished = True
        self._failure = failure
        for ready in self._ready:
            ready.set()

    # -- consumer side --------------------------------------------------------------------

    def submitted(self, layer: int) -> bool:
        """Return whether the copies of `layer` have been issued."""
        return self._events[self._index(layer)] is not None

    def layer_done(self, layer: int) -> bool:
        """Return whether `layer` has landed, without waiting."""
        event = self._events[self._index(layer)]
        return event is not None and event.query()

    def done(self) -> bool:
        """Return whether every layer has landed, without waiting."""
        finished = all(e is not None and e.query() for e in self._events)
        if finished:
            self._keep.clear()
        return finished

    @property
    def finished(self) -> bool:
        """Whether no more layers will be submitted (all were, or the feed ended)."""
        return self._finished

    async def wait_layer(self, layer: int) -> None:
        """Wait until `layer` of every chunk of the batch has landed.

        Raises:
            InvalidInputError: the copy does not cover `layer`.
            TierIOError: the layer was never submitted: its source failed or ended early.
        """
        pos = self._index(layer)
        await self._ready[pos].wait()
        event = self._events[pos]
        if event is None:
            cause = self._failure
            reason = f"its source failed: {cause!r}" if cause else "its source ended early"
            raise TierIOError(f"layer {layer} was not copied: {reason}") from cause
        await wait_event(event, max_interval_s=self._max_poll_s)

    async def wait(self) -> None:
        """Wait until every layer has landed.

        Raises:
            TierIOError: a layer was never submitted (see `wait_layer`).
        """
        for layer in self.layers:
            await self.wait_layer(layer)
        self._keep.clear()

    def stream_wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make a CUDA stream wait for `layer` on the device, not the host.

        This is how an engine's forward pass orders layer `i`'s attention after its load
        without a host-side wait. On CPU (copies are synchronous) it does nothing.

        Args:
            layer: the layer to wait for.
            stream: the stream to hold back; the device's current stream by default.

        Raises:
            InvalidInputError: `layer` is not covered or has not been submitted yet.
        """
        event = self._events[self._index(layer)]
        if event is None:
            raise InvalidInputError(f"layer {layer} has not been submitted; await wait_layer")
        if isinstance(event, torch.cuda.Event):
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def _index(self, layer: int) -> int:
        pos = self._pos.get(layer)
        if pos is None:
            raise InvalidInputError(f"layer {layer} is not part of this copy ({self.layers})")
        return pos
