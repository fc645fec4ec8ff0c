"""TieredCache under concurrency and cancellation, on real tiers.

The tiers: dram, lmdb, remote (file://), and redis and mooncake pools on the tests' own
servers. Three stacks put an HBM tier (its CPU seam) on top: over dram and lmdb, DRAM
written back or through from it, and over lmdb and a remote tier, which reads layer-wise
loads in waves.

Many tasks store, look up and load overlapping prefixes of a few prompt families at once,
through tiers far smaller than what is stored, so every tier evicts all the time. The KV of
a chunk is a function of its key, so every hit is checked byte for byte; afterwards the
cache's accounting (pins, free blocks, index, policies, pending copies) must add up.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtiers.tiers
from kvtiers import CacheState, CacheStateError, TieredCache, TierUsage
from kvtiers.core.keys import ChunkKey
from kvtiers.tiers.base import TierState
from kvtiers.tiers.blocks import BlockTier
from tests.conftest import make_config, make_kv, same_bytes, schedule_seeds, small_layout
from tests.tiers.servers import mooncake_cluster, redis_server, unique_prefix

__all__ = ["mooncake_cluster", "redis_server"]  # fixtures, imported to be found here
pytestmark = pytest.mark.filterwarnings("error")

LAYOUT = small_layout()
CS = LAYOUT.chunk_size
HANG = 30  # seconds: a guard against hangs, never a timing assertion
STACKS = [
    "dram",
    "dram-lmdb",
    "dram-lmdb_back",
    "dram-lmdb-remote",
    "hbm-dram-lmdb",
    "hbm-dram_through-lmdb",
    "hbm-lmdb-remote",
    "dram-redis",
    "dram-mooncake",
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Give `schedule_seed` the fixed seeds of each schedule, or `--schedule-seeds`."""
    if "schedule_seed" in metafunc.fixturenames:
        default = [0, 1] if "cancelled" in metafunc.function.__name__ else [0]
        seeds = schedule_seeds(metafunc.config, default)
        metafunc.parametrize("schedule_seed", seeds, ids=[f"seed{s}" for s in seeds])


def pool_tier(request: pytest.FixtureRequest, stack: str) -> dict[str, Any] | None:
    """Return the pool tier of a `redis` or `mooncake` stack (its server a fixture's)."""
    capacity = 40 * (LAYOUT.chunk_bytes + 256)  # room for headers
    if stack.endswith("redis"):
        server = request.getfixturevalue("redis_server")
        return {"kind": "redis", "url": server.url, "prefix": unique_prefix(), "capacity": capacity}
    if stack.endswith("mooncake"):
        cluster = request.getfixturevalue("mooncake_cluster")
        pool = {"kind": "mooncake", "master": cluster.master, "segment_size": 0}
        return {**pool, "prefix": unique_prefix(), "capacity": capacity}
    return None


def stack_config(
    tmp_path: Path, stack: str, *, dram_chunks: int = 4, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """Return a config of `stack`'s tiers, each far smaller than what the tests store.

    `lmdb_back`: the lmdb tier is written back (on eviction from DRAM), not through.
    `hbm`: an HBM tier on its CPU seam on top, DRAM below it written back (`dram_through`:
    through), or no DRAM (`hbm-lmdb-remote`). `redis`, `mooncake`: that pool tier below
    DRAM, on the session's server.
    """
    lmdb_chunks = 12 if "lmdb" in stack else None
    write_policy = "write_back" if "lmdb_back" in stack else "write_through"
    cfg = make_config(
        tmp_path, dram_chunks=dram_chunks, lmdb_chunks=lmdb_chunks, write_policy=write_policy
    )
    if "remote" in stack:
        cfg["tiers"].append(
            {
                "kind": "remote",
                "url": f"file://{tmp_path}/pool",
                "capacity": 40 * (LAYOUT.chunk_bytes + 256),  # room for headers
            }
        )
    if stack.startswith("hbm"):
        hbm = {"kind": "hbm", "capacity": 3 * LAYOUT.chunk_bytes, "device": "cpu"}
        cfg["tiers"].insert(0, hbm)
        if "dram_through" in stack:
            cfg["tiers"][1]["write_policy"] = "write_through"
        if "dram" not in stack:
            del cfg["tiers"][1]
    if (pool := pool_tier(request, stack)) is not None:
        cfg["tiers"].append(pool)
    cfg["write_queue_chunks"] = 8  # back-pressure on the store path
    return cfg


def prompt(family: int, branch: int, num_chunks: int) -> list[int]:
    """Tokens of a prompt; prompts of one family share chunks up to `family % 3`."""
    out: list[int] = []
    for c in range(num_chunks):
        owner = branch if c > family % 3 else 0
        out.extend((family * 100 + owner * 10 + c) * 64 + t for t in range(CS))
    return out


def chunk_kv(key: ChunkKey) -> torch.Tensor:
    """The KV of the chunk under `key`: a function of the key, so of its whole prefix."""
    return make_kv(LAYOUT, CS, seed=int.from_bytes(key[:4], "little"))


class Expected:
    """The KV every prompt's chunks must load as, memoized per key."""

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache
        self._kv: dict[ChunkKey, torch.Tensor] = {}

    def chunk(self, key: ChunkKey) -> torch.Tensor:
        kv = self._kv.get(key)
        if kv is None:
            kv = self._kv[key] = chunk_kv(key)
        return kv

    def of(self, tokens: list[int]) -> torch.Tensor:
        keys = self.cache.keys(tokens)
        return torch.cat([self.chunk(key) for key in keys], dim=2)


def random_prompt(rng: random.Random) -> list[int]:
    return prompt(rng.randrange(4), rng.randrange(3), rng.randint(1, 6))


async def one_op(cache: TieredCache, want: Expected, rng: random.Random) -> None:
    """Run one random call on `cache` and check what it returns."""
    tokens = random_prompt(rng)
    keys = cache.keys(tokens)
    op = rng.randrange(9)
    # A reuse hint on a third of the stores: chunks past it go in cold (or below).
    keep = rng.choice([None, None, None, None, 0, 1, 3])
    if op == 0:
        hint = None if keep is None else keep * CS
        await cache.store(tokens, want.of(tokens), keep_tokens=hint)
    elif op == 1:
        await cache.put_chunks(keys, [want.chunk(key) for key in keys], keep_chunks=keep)
    elif op == 2:
        hint = await cache.lookup(tokens)
        assert hint % CS == 0 and 0 <= hint <= len(tokens)
        got = await cache.load(tokens[:hint])  # the hint may be stale, never the bytes
        assert same_bytes(got, want.of(tokens)[:, :, : got.shape[2]])
    elif op == 3:
        got = await cache.load(tokens)
        assert same_bytes(got, want.of(tokens)[:, :, : got.shape[2]])
    elif op == 4:
        dsts = [torch.zeros(LAYOUT.chunk_shape(), dtype=torch.float16) for _ in keys]
        found = await cache.get_chunks(keys, dsts)
        for key, dst, hit in zip(keys, dsts, found, strict=True):
            assert same_bytes(dst, want.chunk(key)) if hit else not dst.any()
    elif op == 5:
        assert 0 <= await cache.prefetch(tokens) <= len(tokens)
    elif op == 6:
        held = await cache.contains_keys(keys)
        assert 0 <= await cache.lookup_keys(keys) <= len(keys) == len(held)
    elif op == 7:
        await layerwise_load(cache, want, tokens)
    elif rng.random() < 0.2:  # rarely: everything goes, under the other calls' feet
        assert await cache.clear() >= 0


async def layerwise_load(cache: TieredCache, want: Expected, tokens: list[int]) -> None:
    """Load `tokens` layer by layer; every report holds exact bytes, and none grows."""
    out = torch.zeros(LAYOUT.kv_shape(len(tokens)), dtype=torch.float16)
    reports: list[tuple[int, int]] = []
    bad: list[tuple[int, int]] = []

    def on_layers(num_layers: int, num_tokens: int) -> None:
        if reports:
            assert num_layers > reports[-1][0] and num_tokens <= reports[-1][1]
        reports.append((num_layers, num_tokens))
        kv = want.of(tokens)[:num_layers, :, :num_tokens]
        if not same_bytes(out[:num_layers, :, :num_tokens], kv):
            bad.append((num_layers, num_tokens))

    got = await cache.load(tokens, out=out, on_layers=on_layers)
    assert not bad, bad
    assert same_bytes(got, want.of(tokens)[:, :, : got.shape[2]])
    assert not reports or got.shape[2] <= reports[-1][1]


async def worker(cache: TieredCache, want: Expected, seed: int, num_ops: int) -> None:
    rng = random.Random(seed)
    for _ in range(num_ops):
        await one_op(cache, want, rng)
        if rng.random() < 0.3:
            await asyncio.sleep(0)


def check_accounting(cache: TieredCache) -> None:
    """Assert that the cache's bookkeeping agrees with its tiers once it is idle."""
    mover = cache._mover
    assert cache.pin_count() == 0
    assert not mover._pending and not mover._evicting
    assert cache.stats().write_queue_chunks == 0
    for slot in mover._slots:
        tier = slot.tier
        if not isinstance(tier, BlockTier):
            continue
        usage = tier.usage()
        assert usage.num_entries + tier.num_free_chunks == tier.num_chunks
        resident = set(tier.resident_keys())
        assert set(cache._index.keys_in(slot.idx)) == resident, tier.name
        assert slot.policy is not None and set(slot.policy.candidates()) == resident
    for slot in mover._slots:
        assert not slot.queued
        usage = slot.tier.usage()
        assert 0 <= usage.used_bytes <= usage.capacity_bytes


async def check_everything_loads_right(cache: TieredCache, want: Expected) -> None:
    """Every prompt loads bit-exact or short (a miss), and agrees with `lookup` now."""
    for family in range(4):
        for branch in range(3):
            tokens = prompt(family, branch, 6)
            got = await cache.load(tokens)
            assert same_bytes(got, want.of(tokens)[:, :, : got.shape[2]])


# -- many tasks at once --------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("eviction", ["lru", "arc", "2q"])
async def test_concurrent_overlapping_calls_serve_exact_bytes(
    request, tmp_path, stack, eviction, schedule_seed
):
    cfg = stack_config(tmp_path, stack, request=request)
    seeds = range(12 * schedule_seed, 12 * schedule_seed + 12)
    cfg["tiers"][0]["eviction"] = eviction

    async def run() -> None:
        async with TieredCache.from_config(cfg) as cache:
            want = Expected(cache)
            await asyncio.gather(*(worker(cache, want, seed, 25) for seed in seeds))
            await cache.flush()
            check_accounting(cache)
            await check_everything_loads_right(cache, want)
            await cache.flush()  # loads queue copies of what they promoted
            check_accounting(cache)
            assert cache.stats().tiers[0].evictions > 0  # the tiers were under pressure

    await asyncio.wait_for(run(), HANG)


@pytest.mark.parametrize("stack", STACKS)
async def test_the_same_chunks_stored_at_once_are_held_once(request, tmp_path, stack):
    tokens = prompt(1, 1, 3)

    async def run() -> None:
        async with TieredCache.from_config(stack_config(tmp_path, stack, request=request)) as cache:
            want = Expected(cache)
            kv = want.of(tokens)
            stored = await asyncio.gather(*(cache.store(tokens, kv) for _ in range(8)))
            assert all(n in (0, len(tokens)) for n in stored)
            await cache.flush()
            assert same_bytes(await cache.load(tokens), kv)
            assert cache.tiers[0].usage().num_entries == 3
            check_accounting(cache)

    await asyncio.wait_for(run(), HANG)


# -- cancellation --------------------------------------------------------------------------


async def cancel_at_random(aw: Awaitable[None], rng: random.Random) -> None:
    """Run `aw` as a task and cancel it after a random number of event-loop turns."""
    task = asyncio.ensure_future(aw)
    for _ in range(rng.randrange(12)):
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("stack", STACKS)
async def test_calls_cancelled_anywhere_leave_a_sound_cache(
    request, tmp_path, stack, schedule_seed
):
    rng = random.Random(schedule_seed)

    async def run() -> None:
        async with TieredCache.from_config(stack_config(tmp_path, stack, request=request)) as cache:
            want = Expected(cache)
            for _ in range(40):
                ops = [one_op(cache, want, random.Random(rng.random())) for _ in range(4)]
                await asyncio.gather(*(cancel_at_random(op, rng) for op in ops))
            await cache.flush()
            check_accounting(cache)
            await check_everything_loads_right(cache, want)
            await asyncio.gather(*(worker(cache, want, s, 10) for s in range(4)))
            await cache.flush()
            check_accounting(cache)

    await asyncio.wait_for(run(), HANG)


# -- close ---------------------------------------------------------------------------------


def assert_closed(cache: TieredCache) -> None:
    assert cache.state is CacheState.CLOSED
    assert all(tier.state is TierState.CLOSED for tier in cache.tiers)


@pytest.mark.parametrize("stack", STACKS)
async def test_close_with_calls_in_flight_finishes_them_then_refuses(request, tmp_path, stack):
    async def run() -> None:
        cache = TieredCache.from_config(stack_config(tmp_path, stack, request=request))
        await cache.open()
        want = Expected(cache)
        calls = [asyncio.ensure_future(worker(cache, want, seed, 5)) for seed in range(8)]
        await asyncio.sleep(0)
        await cache.close()
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:  # done, or refused at a later call of the worker
            assert result is None or isinstance(result, CacheStateError), result
        assert_closed(cache)
        await cache.close()  # idempotent
        with pytest.raises(CacheStateError):
            await cache.lookup(prompt(0, 0, 2))
        with pytest.raises(CacheStateError):
            await cache.put_chunks([], [])

    await asyncio.wait_for(run(), HANG)


@pytest.mark.parametrize("stack", STACKS)
async def test_concurrent_closes_both_wait_for_the_tiers(request, tmp_path, stack):
    async def run() -> None:
        cache = TieredCache.from_config(stack_config(tmp_path, stack, request=request))
        await cache.open()
        want = Expected(cache)
        tokens = prompt(2, 0, 6)
        await cache.store(tokens, want.of(tokens))
        first = asyncio.ensure_future(cache.close())
        await asyncio.sleep(0)  # the first close is draining the queues
        await cache.close()
        assert_closed(cache)  # the second returned only once the tiers were closed
        await first

    await asyncio.wait_for(run(), HANG)


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("turns", [0, 1, 3, 8])
async def test_a_cancelled_close_still_closes_the_tiers(request, tmp_path, stack, turns):
    async def run() -> None:
        cfg = stack_config(tmp_path, stack, dram_chunks=32, request=request)
        cfg["write_queue_chunks"] = 2  # stores wait on full queues
        cache = TieredCache.from_config(cfg)
        await cache.open()
        want = Expected(cache)
        calls = [asyncio.ensure_future(worker(cache, want, seed, 5)) for seed in range(6)]
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(cache.close())
        for _ in range(turns):
            await asyncio.sleep(0)
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        await cache.close()
        for result in await asyncio.gather(*calls, return_exceptions=True):
            assert result is None or isinstance(result, CacheStateError), result
        assert_closed(cache)

    await asyncio.wait_for(run(), HANG)


# -- a tier's own futures cancelled under a call ---------------------------------------------


class _CancelledUnderneath(kvtiers.tiers.Tier):
    """A shared tier whose requests end cancelled though nobody cancelled the caller.

    As a tier's thread pool does to calls still queued when the tier closes.
    """

    kind = "cancelled_underneath"
    shared = True
    manages_eviction = True

    async def contains(self, keys):
        raise asyncio.CancelledError

    async def get(self, keys, dsts):
        raise asyncio.CancelledError

    async def put(self, keys, srcs):
        raise asyncio.CancelledError

    async def delete(self, keys):
        raise asyncio.CancelledError

    def usage(self):
        return TierUsage(self.capacity_bytes, 0, 0)


async def test_a_tier_request_cancelled_underneath_is_a_miss_not_a_cancellation():
    registry = kvtiers.tiers.TierRegistry(load_entry_points=False)
    registry.register("cancelled_underneath", _CancelledUnderneath)
    cfg = make_config(dram_chunks=2)
    cfg["tiers"].append({"kind": "cancelled_underneath", "capacity": "1MiB"})
    tokens = prompt(0, 0, 4)

    async def run() -> None:
        async with TieredCache.from_config(cfg, registry=registry) as cache:
            want = Expected(cache)
            await cache.store(tokens, want.of(tokens))  # two chunks overflow into the tier
            await cache.flush()
            assert await cache.lookup(tokens) == 2 * CS
            assert same_bytes(await cache.load(tokens), want.of(tokens)[:, :, : 2 * CS])
            assert await cache.contains_keys(cache.keys(tokens)) == [True] * 2 + [False] * 2
            assert cache.stats().tiers[1].errors > 0

    await asyncio.wait_for(run(), HANG)
