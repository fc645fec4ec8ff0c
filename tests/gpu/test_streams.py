"""`until_done`: a copy into held blocks is awaited to its end, even when cancelled."""

from __future__ import annotations

import asyncio

import pytest

from kvtiers.gpu._streams import until_done


async def test_a_cancelled_wait_still_waits_for_the_work_then_reraises() -> None:
    release = asyncio.Event()
    ended: list[str] = []

    async def work() -> None:
        await release.wait()
        ended.append("work")

    async def caller() -> None:
        try:
            await until_done(work())
        finally:
            ended.append("caller")  # where the blocks would be given back

    task = asyncio.create_task(caller())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done() and ended == []  # the block is still held
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["work", "caller"]


async def test_the_work_error_is_raised_once_it_ends() -> None:
    async def work() -> None:
        raise RuntimeError("device copy failed")

    with pytest.raises(RuntimeError, match="device copy failed"):
        await until_done(work())


async def test_a_future_from_a_thread_is_awaited_too() -> None:
    loop = asyncio.get_running_loop()
    await until_done(loop.run_in_executor(None, lambda: None))
