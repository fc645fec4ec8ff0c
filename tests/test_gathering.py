"""The load half of the cascade's helpers: branches of one load never outlive it."""

from __future__ import annotations

import asyncio

import pytest

from kvtiers._gathering import _all
from kvtiers.tiers._cancellation import wait_out


async def test_all_returns_results_in_order() -> None:
    async def value(x: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return x

    assert await _all([value(1, 0.02), value(2, 0.0)]) == [1, 2]
    assert await _all([]) == []


async def test_a_failing_branch_cancels_the_others_and_waits_for_them() -> None:
    ended: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.01)  # a copy still landing when cancelled
            ended.append("slow")

    async def failing() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        await _all([slow(), failing()])
    assert ended == ["slow"]  # ended before the error reached the caller


async def test_cancelling_the_caller_waits_for_every_branch() -> None:
    ended: list[int] = []

    async def branch(i: int) -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.01)
            ended.append(i)

    task = asyncio.ensure_future(_all([branch(0), branch(1)]))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(ended) == [0, 1]


async def test_a_cancellation_during_the_clean_up_still_waits_for_every_branch() -> None:
    # One branch fails; the other is cancelled and waits out its own work (a read into
    # the caller's memory). Cancelling the caller meanwhile must not end that wait early.
    release = asyncio.Event()
    ended: list[str] = []

    async def reading() -> None:
        work = asyncio.ensure_future(release.wait())
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            await wait_out([work])
            ended.append("reading")
            raise

    async def failing() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("copy failed")

    task = asyncio.ensure_future(_all([reading(), failing()]))
    await asyncio.sleep(0.03)  # the failure is in, the clean-up waits for `reading`
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done() and ended == []
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["reading"]
