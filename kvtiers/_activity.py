"""Calls in flight on a cache, so that `close` can wait for them before it drains."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["Activity", "tracked"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Activity:
    """Count calls in flight; `idle()` waits until none is."""

    def __init__(self) -> None:
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        """Record a call that started."""
        self._active += 1
        self._idle.clear()

    def exit(self) -> None:
        """Record a call that ended, however it ended."""
        self._active -= 1
        if not self._active:
            self._idle.set()

    async def idle(self) -> None:
        """Wait until no call is in flight."""
        await self._idle.wait()


class _Tracked(Protocol):
    _activity: Activity

    def _ensure_open(self) -> None: ...


_S = TypeVar("_S", bound=_Tracked)


def tracked(
    fn: Callable[Concatenate[_S, _P], Awaitable[_R]],
) -> Callable[Concatenate[_S, _P], Coroutine[Any, Any, _R]]:
    """Refuse the call unless the cache is open, and count it while it runs."""

    @functools.wraps(fn)
    async def call(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._ensure_open()
        self._activity.enter()
        try:
            return await fn(self, *args, **kwargs)
        finally:
            self._activity.exit()

    return call
