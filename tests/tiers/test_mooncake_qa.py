"""The mooncake tier under stress, on a real Mooncake Store (master and segment on loopback).

Each check holds the tier's promise: a hit is the bytes stored, anything else is a miss;
nothing raises into the caller while the store is away, full, or closed under it; `put`
reports held only what the store holds; what is not the tier's is never served nor
removed.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import numpy as np

from kvtiers.core.config import TierConfig
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.tiers._remote_breaker import BreakerState
from kvtiers.tiers.mooncake import MooncakeTier
from tests.tiers._pool_callers import (
    close_during_calls,
    neighbours_stay_apart,
    overlapping_callers,
    same,
)
from tests.tiers.servers import (
    MooncakeCluster,
    mooncake_cluster,
    own_mooncake_cluster,
    unique_prefix,
)
from tests.tiers.test_mooncake import LAYOUT, dsts, keys, make_tier, payloads

__all__ = ["mooncake_cluster", "own_mooncake_cluster"]  # fixtures, imported to be found here

HANG = 60  # seconds: a guard against hangs, never a timing assertion


async def test_close_waits_for_calls_in_flight(mooncake_cluster: MooncakeCluster) -> None:
    tier = make_tier(mooncake_cluster.master, num_chunks=256)
    await tier.open()
    await close_during_calls(tier, keys, payloads, dsts)


async def test_a_pool_without_room_declines_writes_and_keeps_serving_reads(
    own_mooncake_cluster: MooncakeCluster,
) -> None:
    huge = KVLayout(  # 64 MiB chunks: a value is larger than the whole 64 MiB pool
        model="m", num_layers=32, num_kv_heads=8, head_size=128, dtype="float16", chunk_size=512
    )
    options = {"breaker_failures": 2, "max_in_flight": 1}
    async with make_tier(own_mooncake_cluster.master, 4, huge, **options) as tier:
        src = payloads(1, layout=huge)
        for i in range(4):
            assert await tier.put(keys(1, seed=i), src) == [False]
        assert tier._guard.breaker.state is BreakerState.CLOSED
        assert tier.io_counters.failures == 0 and tier.io_counters.full == 4
        assert tier.counters.declined == 4 and tier.usage().num_entries == 0
        assert tier.counters.errors == tier.counters.unavailable == 0
        assert await tier.contains(keys(1)) == [False]  # asked, not refused
        assert await tier.get(keys(1), dsts(1, layout=huge)) == [False]
        assert tier.io_counters.refused == 0


async def test_a_master_restarted_empty_gets_known_chunks_written_again(
    own_mooncake_cluster: MooncakeCluster,
) -> None:
    cluster = own_mooncake_cluster
    async with make_tier(cluster.master, breaker_cooldown=0.2, timeout=2) as tier:
        ks, srcs = keys(8), payloads(8)
        assert await tier.put(ks, srcs) == [True] * 8
        cluster.kill_master()
        cluster.start_master()  # empty: which object lives where died with the old one
        cluster.kill_segment()  # and the segment registers with the new master
        cluster.start_segment()
        probe, probe_src = keys(1, seed=99), payloads(1, seed=99)
        deadline = time.monotonic() + HANG
        while await tier.put(probe, probe_src) != [True] or not await tier.get(probe, dsts(1)):
            assert time.monotonic() < deadline, "the store did not come back"
            await asyncio.sleep(0.2)
        # the tier still knows `ks` from before; the store does not hold them
        assert await tier.put(ks, srcs) == [True] * 8
        out = dsts(8)
        assert await tier.get(ks, out) == [True] * 8 and same(srcs, out, [True] * 8)


async def test_others_prefixes_and_layouts_are_never_served_nor_removed(
    mooncake_cluster: MooncakeCluster,
) -> None:
    other_layout = KVLayout(
        model="other", num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
        head_size=LAYOUT.head_size, dtype=LAYOUT.dtype, chunk_size=LAYOUT.chunk_size,
    )  # fmt: skip
    ours = make_tier(mooncake_cluster.master, num_chunks=4)
    layout_b = MooncakeTier(ours.config, other_layout)
    prefix_b = make_tier(mooncake_cluster.master, num_chunks=4)
    ks = keys(8, seed=4)
    async with ours, layout_b, prefix_b:
        await neighbours_stay_apart(ours, layout_b, prefix_b, ks, payloads, dsts)


_OTHER_PROCESS = """
import asyncio, sys
import numpy as np
from kvtiers.core.config import TierConfig
from kvtiers.core.keys import ChunkKey
from kvtiers.testing.tiers import SMALL_LAYOUT
from kvtiers.tiers.mooncake import MooncakeTier

def payload(key):
    return np.frombuffer(key * (SMALL_LAYOUT.chunk_bytes // 16), np.uint8)

async def main(master, prefix, capacity):
    config = TierConfig("mooncake", capacity, options={"master": master, "prefix": prefix})
    theirs = [ChunkKey(bytes([1, i]) * 8) for i in range(8)]
    mine = [ChunkKey(bytes([2, i]) * 8) for i in range(8)]
    async with MooncakeTier(config, SMALL_LAYOUT) as tier:
        out = [np.zeros(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in theirs]
        assert await tier.get(theirs, out) == [True] * 8, "a miss"
        assert all(bytes(o) == bytes(payload(k)) for o, k in zip(out, theirs)), "wrong KV"
        assert await tier.put(mine, [payload(k) for k in mine]) == [True] * 8
        assert tier.usage().num_entries == 8  # the capacity: the oldest read is forgotten

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def test_another_process_reads_and_writes_the_same_pool(
    mooncake_cluster: MooncakeCluster,
) -> None:
    prefix = unique_prefix()
    tier = make_tier(mooncake_cluster.master, num_chunks=8, prefix=prefix)
    theirs = [ChunkKey(bytes([1, i]) * 8) for i in range(8)]
    mine = [ChunkKey(bytes([2, i]) * 8) for i in range(8)]

    def payload(key: bytes) -> np.ndarray:
        return np.frombuffer(key * (LAYOUT.chunk_bytes // 16), np.uint8)

    async with tier:
        assert await tier.put(theirs, [payload(k) for k in theirs]) == [True] * 8
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _OTHER_PROCESS, mooncake_cluster.master, prefix,
            str(tier.config.capacity_bytes), env=env, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), HANG)
        assert proc.returncode == 0, err.decode()[-3000:]
        out = dsts(8)
        assert await tier.get(mine, out) == [True] * 8
        assert all(np.array_equal(o, payload(k)) for o, k in zip(out, mine, strict=True))
        assert tier.usage().num_entries == 8
        assert isinstance(tier.config, TierConfig)


async def test_many_concurrent_callers_on_overlapping_keys(
    mooncake_cluster: MooncakeCluster,
) -> None:
    ks, srcs = keys(32, seed=8), payloads(32, seed=8)
    async with make_tier(mooncake_cluster.master, num_chunks=24, max_in_flight=2) as tier:
        await overlapping_callers(tier, ks, srcs, dsts, hang_s=HANG)
        assert tier.usage().num_entries <= 24
        # NOTE: a forced remove may free a value's memory under a read of it, which then
        # reads whatever the store put there next: a foreign or corrupt miss, never served
        assert tier.io_counters.failures == 0
        assert tier._guard.breaker.state is BreakerState.CLOSED


async def test_reads_racing_another_clients_write_are_misses_not_failures(
    mooncake_cluster: MooncakeCluster,
) -> None:
    big = KVLayout(  # 8 MiB chunks: a write of 8 takes a while
        model="m", num_layers=16, num_kv_heads=8, head_size=128, dtype="float16", chunk_size=128
    )
    writer = make_tier(mooncake_cluster.master, num_chunks=16, layout=big)
    reader = MooncakeTier(writer.config, big)
    ks, srcs = keys(8, seed=6), payloads(8, layout=big)
    async with writer, reader:
        put = asyncio.ensure_future(writer.put(ks, srcs))
        reads = 0
        while not put.done() or reads == 0:  # reads while the values are being written
            out = dsts(8, layout=big)
            assert same(srcs, out, await reader.get(ks, out))
            reads += 1
        assert put.result() == [True] * 8
        assert reader.io_counters.failures == 0 and reader.counters.errors == 0
        assert reader._guard.breaker.state is BreakerState.CLOSED
        out = dsts(8, layout=big)
        assert await reader.get(ks, out) == [True] * 8 and same(srcs, out, [True] * 8)
