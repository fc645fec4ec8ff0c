"""The load half of the cascade's helpers: branches of one load never outlive it."""

from __future__ import annotations

import asyncio

import pytest

from kvtiers._gathering import _all


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
