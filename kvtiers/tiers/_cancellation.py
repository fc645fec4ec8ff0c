"""Waiting out work that touches a caller's buffers, whatever cancellations arrive.

A call that is cancelled while a thread, a request or a copy still reads or writes the
caller's memory (a destination buffer, a reserved or pinned block, a reused stage) must
wait for that work before the cancellation propagates: the memory is given back when the
call ends. The wait itself can be cancelled again: `asyncio.gather` and `_reap`-style
clean-ups cancel their children a second time, and a caller may cancel twice. A plain
`await asyncio.wait(...)` in an `except CancelledError` block then ends early and leaves the
work running into memory that is someone else's by then. `wait_out` does not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

__all__ = ["wait_out"]


async def wait_out(futures: Iterable[asyncio.Future[Any]], timeout: float | None = None) -> bool:
    """Wait until every one of `futures` is done (or `timeout` seconds have passed).

    Cancellations of the waiting task do not end the wait; they are reported instead, so
    the caller raises `CancelledError` once the work has ended. The futures themselves are
    never cancelled here.

    Returns:
        Whether the waiting task was cancelled meanwhile.
    """
    pending = set(futures)
    loop = asyncio.get_running_loop()
    end = None if timeout is None else loop.time() + timeout
    cancelled = False
    while pending:
        left = None if end is None else end - loop.time()
        if left is not None and left <= 0:
            break
        try:
            _, pending = await asyncio.wait(pending, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled
