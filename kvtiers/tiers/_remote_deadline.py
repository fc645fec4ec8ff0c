"""A deadline for the remote tier's reads: the engine never waits past `read_timeout`.

One request is bounded by `timeout`, but a read call is more than one request: it may wait
for one of `max_in_flight` slots behind slow requests, retry after a failure, back off.
A store that is slow for some objects would then hold a load for several timeouts. So a
read call waits for its requests up to `read_timeout` in all; what has not arrived by then
is a miss, and the requests still running become stragglers: they run on to their own
timeout (their effects on the catalog and counters are still accounted) with nobody
waiting, and the tier's close waits for them.

A straggler only ever produces bytes; it never writes into a caller's buffer (the caller
copies what arrived in time), so abandoning it cannot corrupt a destination reused later.
`as_they_come` starts the caller's follow-up (verify, copy) on each request as it arrives,
so the copies overlap the requests still in flight, and waits for every follow-up it
started before it returns or raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kvtiers.tiers._cancellation import wait_out

__all__ = ["Stragglers"]

_T = TypeVar("_T")
_U = TypeVar("_U")


class Stragglers:
    """Run a read call's requests under a deadline; own the ones it stopped waiting for."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.abandoned = 0
        """Requests a read call stopped waiting for, so far."""

    async def within(
        self, seconds: float, aws: Sequence[Awaitable[_T]], default: _T
    ) -> tuple[list[_T], int]:
        """Await `aws` concurrently for at most `seconds`.

        Returns:
            Each result in order, `default` for those not done in time; and how many
            those were.

        Raises:
            BaseException: the first error among those done in time. On cancellation the
                requests are waited for first (as `gather_all` does).
        """
        tasks = [asyncio.ensure_future(aw) for aw in aws]
        if not tasks:
            return [], 0
        try:
            done, pending = await asyncio.wait(tasks, timeout=seconds)
        except asyncio.CancelledError:
            await wait_out(tasks)
            raise
        for task in pending:
            self._tasks.add(task)
            task.add_done_callback(self._reap)
        self.abandoned += len(pending)
        errors = [error for task in done if (error := task.exception()) is not None]
        if errors:  # every one retrieved above, so none is reported as never retrieved
            raise errors[0]
        results = [task.result() if task in done else default for task in tasks]
        return results, len(pending)

    async def as_they_come(
        self,
        seconds: float,
        aws: Sequence[Awaitable[_T]],
        then: Callable[[int, _T], Awaitable[_U]],
        default: _U,
    ) -> tuple[list[_U], int]:
        """Await `aws` for at most `seconds`, running `then(i, result)` as each one arrives.

        Returns:
            Per awaitable, what its follow-up returned, `default` for those not done in
            time; and how many those were (they become stragglers, with no follow-up).

        Raises:
            BaseException: the first error of a request done in time or of a follow-up,
                once every follow-up started has ended. On cancellation the requests and
                the follow-ups are waited for first.
        """
        tasks = [asyncio.ensure_future(aw) for aw in aws]
        index: dict[asyncio.Future[_T], int] = {task: i for i, task in enumerate(tasks)}
        follow: dict[int, asyncio.Future[_U]] = {}
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        pending: set[asyncio.Future[_T]] = set(tasks)
        errors: list[BaseException] = []
        try:
            while pending and (left := end - loop.time()) > 0:
                done, pending = await asyncio.wait(
                    pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if (error := task.exception()) is not None:
                        errors.append(error)
                    else:
                        follow[index[task]] = asyncio.ensure_future(
                            then(index[task], task.result())
                        )
        except asyncio.CancelledError:
            await wait_out(tasks)
            await wait_out(follow.values())
            raise
        for task in pending:
            self._tasks.add(task)  # type: ignore[arg-type]  # a Task: ensure_future of a coroutine
            task.add_done_callback(self._reap)  # type: ignore[arg-type]
        self.abandoned += len(pending)
        if await wait_out(follow.values()):
            raise asyncio.CancelledError
        errors += [e for fut in follow.values() if (e := fut.exception()) is not None]
        if errors:
            raise errors[0]
        results = [follow[i].result() if i in follow else default for i in range(len(tasks))]
        return results, len(pending)

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: nobody else will look at it

    async def drain(self) -> None:
        """Wait for every straggler to end (each is bounded by its request timeout)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
