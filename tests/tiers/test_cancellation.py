"""`wait_out`: a cancelled call waits for the work on its buffers, however often cancelled."""

from __future__ import annotations

import asyncio

from kvtiers.tiers._cancellation import wait_out


async def test_repeated_cancellations_do_not_end_the_wait() -> None:
    release = asyncio.Event()
    work = asyncio.ensure_future(release.wait())
    waiter = asyncio.ensure_future(wait_out([work]))
    for _ in range(3):  # as asyncio.gather and then a clean-up cancel their children
        await asyncio.sleep(0.01)
        waiter.cancel()
    await asyncio.sleep(0.01)
    assert not waiter.done() and not work.done()  # the work was not cancelled either
    release.set()
    assert await waiter is True  # told it was cancelled, once the work ended
    assert work.done() and not work.cancelled()


async def test_an_uncancelled_wait_reports_no_cancellation() -> None:
    work = asyncio.ensure_future(asyncio.sleep(0.01))
    assert await wait_out([work]) is False
    assert work.done()
    assert await wait_out([]) is False


async def test_a_timeout_bounds_the_wait_and_leaves_the_work_running() -> None:
    release = asyncio.Event()
    work = asyncio.ensure_future(release.wait())
    waiter = asyncio.ensure_future(wait_out([work], timeout=0.05))
    await asyncio.sleep(0.01)
    waiter.cancel()
    assert await waiter is True
    assert not work.done()
    release.set()
    await work
