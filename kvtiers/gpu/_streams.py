"""Copy streams and completion events, with no-op stand-ins on CPU.

On CUDA a `CopyStream` wraps a `torch.cuda.Stream` and `record` returns a `torch.cuda.Event`.
On CPU every copy is synchronous, so the stream does nothing and `record` returns an event
that has already fired. `wait_event` turns either into an awaitable that polls the event and
never blocks the event loop's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

from kvtiers.gpu.paged import host_bytes
from kvtiers.tiers._cancellation import wait_out
from kvtiers.tiers.base import Buffer, HostCopy

__all__ = ["DONE", "CopyStream", "Event", "copy_pairs", "until_done", "wait_event"]

# Polling: for the first _SPIN_S the waiter re-checks on every pass of the event loop
# (`sleep(0)` lets other tasks run in between), so short copies resolve within
# microseconds; then it sleeps with an exponential backoff from _FIRST_SLEEP_S up to the
# caller's cap. NOTE: asyncio's timers wake with about 1 ms granularity on Linux (epoll
# rounds up), so past the spin phase a wait can overshoot by up to ~1 ms.
_SPIN_S = 2e-4
_FIRST_SLEEP_S = 1e-4


class Event(Protocol):
    """What the copy code needs of a completion event (`torch.cuda.Event`)."""

    def query(self) -> bool:
        """Return whether the work recorded before the event has finished."""
        ...

    def synchronize(self) -> None:
        """Block until the event has fired (never on the event loop's thread)."""
        ...


class _DoneEvent:
    """An event that fired already: what a synchronous CPU copy records."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE: Event = _DoneEvent()
"""The event of work that completed when it was submitted (every copy on CPU)."""


class CopyStream:
    """One stream of copies: a CUDA stream, or a no-op stand-in on CPU.

    Args:
        device: the device whose copies the stream carries.
    """

    __slots__ = ("_stream", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # NOTE: default (lowest) priority, so the engine's compute kernels go first.
        self._stream = (
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )

    @property
    def is_cuda(self) -> bool:
        """Whether copies on this stream run asynchronously on a CUDA device."""
        return self._stream is not None

    @contextmanager
    def use(self) -> Iterator[None]:
        """Make this stream current for the copies issued inside the context."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def wait_current(self) -> None:
        """Order later copies after the work already queued on the current stream.

        The engine's current stream is the one that produced (or still reads) its KV, so a
        gather sees finished KV and a scatter cannot overtake a kernel reading its blocks.
        Call it outside `use`, where the current stream is still the engine's.
        """
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def hold_current(self, event: Event) -> None:
        """Make later work on the current stream wait for `event`, on the device.

        The host does not wait: the engine's next kernels are queued behind the copies.
        """
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        """Block until every copy issued on the stream has finished (not on the loop)."""
        if self._stream is not None:
            self._stream.synchronize()

    def record(self) -> Event:
        """Return an event that fires when the copies issued so far have finished."""
        if self._stream is None:
            return DONE
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event


async def wait_event(event: Event, *, max_interval_s: float) -> None:
    """Wait for `event` to fire without blocking the event loop.

    The event is polled with `query`: on every pass of the loop at first, then sleeping
    between polls with an exponential backoff capped at `max_interval_s`. An event that
    has fired returns without suspending.
    """
    if event.query():
        return
    start = time.perf_counter()
    delay = 0.0
    while not event.query():
        await asyncio.sleep(delay)
        if delay or time.perf_counter() - start > _SPIN_S:
            delay = min(max_interval_s, max(2 * delay, _FIRST_SLEEP_S))


async def until_done(work: Awaitable[None]) -> None:
    """Await `work` to its end; if cancelled meanwhile, still wait for it, then re-raise.

    For copies into or out of blocks that the caller's pins or reservation hold: those are
    released when this returns, so a block must not be given back while a copy still
    reads or writes it. `work`'s own error is raised once it has ended.
    """
    task = asyncio.ensure_future(work)
    if await wait_out((task,)):
        raise asyncio.CancelledError
    task.result()


async def copy_pairs(
    stream: CopyStream, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], host_copy: HostCopy
) -> None:
    """Run `dst.copy_(src)` for each pair in one batch on `stream`; return once all landed.

    On CUDA the copies are queued from a worker thread, which then synchronises once, so
    the event loop never waits on a device copy and no pair costs a synchronisation of its
    own; they are ordered after the work already queued on the calling thread's current
    stream (kernels still writing a source or reading a destination). Pairs with both
    sides in host memory go to `host_copy` as NumPy arrays: torch's `copy_` spreads over
    its intra-op threads, and into memory not touched before that ran 30x slower on a
    2-vCPU VM (48 MiB: 340-400 ms against 8-12 ms), the page faults contending.

    The caller's pins or reservation hold the blocks involved, so a cancellation that
    arrives meanwhile is raised once every copy has landed (`until_done`).

    Raises:
        RuntimeError: a copy failed (torch's error).
        ValueError: host arrays of different shapes.
    """
    if not pairs:
        return

    def copy() -> None:
        host: list[tuple[Buffer, Buffer]] = []
        with stream.use():
            for dst, src in pairs:
                both = _host_pair(dst, src)
                if both is not None:
                    host.append(both)
                else:
                    # NOTE: non_blocking is safe for every pair: the stream is synchronised
                    # before anyone reads a destination.
                    dst.copy_(src, non_blocking=True)
            host_copy(host)
            stream.synchronize()

    if not stream.is_cuda:
        copy()
        return
    stream.wait_current()
    await until_done(asyncio.get_running_loop().run_in_executor(None, copy))


def _host_pair(dst: torch.Tensor, src: torch.Tensor) -> tuple[Buffer, Buffer] | None:
    """Return both sides as host bytes of one shape, or `None` (a device side, or no view)."""
    if dst.is_cuda or src.is_cuda:
        return None
    a, b = host_bytes(dst), host_bytes(src)
    if a is None or b is None or a.shape != b.shape:
        return None
    return a, b
