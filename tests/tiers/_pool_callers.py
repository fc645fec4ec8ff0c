"""Checks the pool tiers' tests share: many callers on overlapping keys, and their reads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from kvtiers.core.keys import ChunkKey
from kvtiers.tiers.base import Tier

__all__ = ["close_during_calls", "neighbours_stay_apart", "overlapping_callers", "same"]


def same(srcs: Sequence[np.ndarray], outs: Sequence[np.ndarray], hits: Sequence[bool]) -> bool:
    """Return whether every hit holds its source and every miss is untouched."""
    return all(
        np.array_equal(s, d) if hit else not d.any()
        for s, d, hit in zip(srcs, outs, hits, strict=True)
    )


async def overlapping_callers(
    tier: Tier,
    ks: Sequence[ChunkKey],
    srcs: Sequence[np.ndarray],
    dsts: Callable[[int], list[np.ndarray]],
    *,
    callers: int = 24,
    rounds: int = 12,
    hang_s: float = 60,
) -> None:
    """Run `callers` tasks of `rounds` random puts, gets, contains and deletes of six of
    `ks` each; every read must hold its source or be a miss (see `same`)."""
    by_key = dict(zip(ks, srcs, strict=True))

    async def caller(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(rounds):
            pick = [ks[i] for i in rng.choice(len(ks), size=6, replace=False)]
            op = rng.integers(4)
            if op == 0:
                await tier.put(pick, [by_key[k] for k in pick])
            elif op == 1:
                out = dsts(6)
                hits = await tier.get(pick, out)
                assert same([by_key[k] for k in pick], out, hits)
            elif op == 2:
                await tier.contains(pick)
            else:
                await tier.delete(pick[:1])

    await asyncio.wait_for(asyncio.gather(*(caller(s) for s in range(callers))), hang_s)


async def neighbours_stay_apart(
    ours: Tier,
    layout_b: Tier,
    prefix_b: Tier,
    ks: Sequence[ChunkKey],
    payloads: Callable[..., list[np.ndarray]],
    dsts: Callable[[int], list[np.ndarray]],
) -> None:
    """Check, on open tiers of 4 chunks, that `ours` neither serves nor evicts what another
    layout (`layout_b`) and another prefix (`prefix_b`) of the same pool stored under the
    same keys, and evicts its own chunks only."""
    mine, theirs, third = payloads(8, seed=1), payloads(8, seed=2), payloads(8, seed=3)
    assert await layout_b.put(ks[:4], theirs[:4]) == [True] * 4
    assert await prefix_b.put(ks[:4], third[:4]) == [True] * 4
    out = dsts(4)
    assert await ours.get(ks[:4], out) == [False] * 4 and not any(o.any() for o in out)
    for i in range(0, 8, 2):
        assert await ours.put(ks[i : i + 2], mine[i : i + 2]) == [True, True]
    assert ours.counters.evictions == 4
    assert sorted(ours.take_evicted()) == sorted(ks[:4])
    for tier, srcs in ((layout_b, theirs), (prefix_b, third)):
        out = dsts(4)
        assert await tier.get(ks[:4], out) == [True] * 4 and same(srcs[:4], out, [True] * 4)
    assert ours.counters.corrupt == ours.counters.foreign == 0


async def close_during_calls(
    tier: Tier,
    keys: Callable[..., list[ChunkKey]],
    payloads: Callable[..., list[np.ndarray]],
    dsts: Callable[[int], list[np.ndarray]],
) -> None:
    """Close the open `tier` (of 256 chunks at least) while gets, puts and a contains run:
    the close waits for them, each ends as it would have, and later calls are refused."""
    ks, srcs = keys(64, seed=3), payloads(64)
    assert await tier.put(ks, srcs) == [True] * 64
    outs = [dsts(64) for _ in range(12)]
    gets = [asyncio.ensure_future(tier.get(ks, out)) for out in outs]
    more = [keys(8, seed=50 + i) for i in range(6)]
    puts = [asyncio.ensure_future(tier.put(k, payloads(8, seed=i))) for i, k in enumerate(more)]
    contains = asyncio.ensure_future(tier.contains(ks))
    await asyncio.sleep(0)  # every call has started
    await tier.close()
    assert all(task.done() for task in [*gets, *puts, contains])  # close waited for them
    for task, out in zip(gets, outs, strict=True):
        assert task.result() == [True] * 64 and same(srcs, out, task.result())
    assert all(task.result() == [True] * 8 for task in puts)
    assert contains.result() == [True] * 64
    assert tier.io_counters.failures == 0 and tier.counters.errors == 0
    with pytest.raises(Exception, match="closed"):
        await tier.get(ks[:1], dsts(1))
