"""The redis tier's whole-value paths under stress, on a real server.

Each check holds the tier's promise: a hit is the bytes stored, anything else is a miss;
nothing raises into the caller while the server is away, full or closed under it; what is
not the tier's is never served nor deleted. Layer-wise reads are in
`test_redis_layers_qa.py`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from kvtiers.tiers._remote_breaker import BreakerState
from tests.tiers._pool_callers import (
    close_during_calls,
    neighbours_stay_apart,
    overlapping_callers,
    same,
)
from tests.tiers.servers import RedisServer, own_redis_server, redis_server, unique_prefix
from tests.tiers.test_redis import LAYOUT, VALUE_BYTES, dsts, keys, make_tier, payloads

pytest.importorskip("redis")

import redis.asyncio as aioredis  # noqa: E402 - needs redis-py

from kvtiers.tiers.redis import RedisTier  # noqa: E402 - needs redis-py

__all__ = ["own_redis_server", "redis_server"]  # fixtures, imported to be found here

HANG = 60  # seconds: a guard against hangs, never a timing assertion


async def num_clients(url: str) -> int:
    """Return the connections the server has, besides the one asking."""
    client = aioredis.Redis.from_url(url)
    try:
        return len(await client.client_list()) - 1
    finally:
        await client.aclose()


async def test_close_waits_for_calls_in_flight_and_leaves_no_connection_open(
    own_redis_server: RedisServer,
) -> None:
    tier = make_tier(own_redis_server.url, num_chunks=256)
    await tier.open()
    await close_during_calls(tier, keys, payloads, dsts)
    assert await num_clients(own_redis_server.url) == 0  # none reopened behind the close


async def test_a_server_out_of_memory_declines_writes_and_keeps_serving_reads(
    own_redis_server: RedisServer,
) -> None:
    admin = aioredis.Redis.from_url(own_redis_server.url)
    async with make_tier(own_redis_server.url, num_chunks=10_000, breaker_failures=2) as tier:
        ks, srcs = keys(4), payloads(4)
        assert await tier.put(ks, srcs) == [True] * 4
        # a server that refuses writes past maxmemory (the policy of many managed servers
        # for keys without a TTL): its reads and deletes still work
        await admin.config_set("maxmemory-policy", "noeviction")
        used = (await admin.info("memory"))["used_memory"]
        await admin.config_set("maxmemory", used + 64 * VALUE_BYTES)
        declined = 0
        for i in range(8):
            held = await tier.put(keys(32, seed=10 + i), payloads(32, seed=i))
            declined += held.count(False)
        assert declined > 0
        assert tier._guard.breaker.state is BreakerState.CLOSED
        assert tier.io_counters.failures == 0 and tier.io_counters.full > 0
        assert tier.counters.errors == tier.counters.unavailable == 0
        for _ in range(4):  # reads go on, also while writes are refused
            out = dsts(4)
            assert await tier.get(ks, out) == [True] * 4 and same(srcs, out, [True] * 4)
            assert await tier.contains(ks) == [True] * 4
        await tier.delete(ks[:1])
        assert await tier.contains(ks) == [False, True, True, True]
        await admin.config_set("maxmemory", "512mb")
        assert await tier.put(ks[:1], srcs[:1]) == [True]  # room again: written
        assert tier._guard.breaker.state is BreakerState.CLOSED
    await admin.aclose()


async def test_others_prefixes_layouts_and_keys_are_never_served_nor_deleted(
    redis_server: RedisServer,
) -> None:
    other_layout = KVLayout(
        model="other", num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
        head_size=LAYOUT.head_size, dtype=LAYOUT.dtype, chunk_size=LAYOUT.chunk_size,
    )  # fmt: skip
    assert other_layout.chunk_bytes == LAYOUT.chunk_bytes
    prefix = unique_prefix()
    ours = make_tier(redis_server.url, num_chunks=4, prefix=prefix)
    layout_b = RedisTier(
        TierConfig("redis", 4 * VALUE_BYTES, options=dict(ours.config.options)), other_layout
    )
    prefix_b = make_tier(redis_server.url, num_chunks=4, prefix=prefix + "-b")
    admin = aioredis.Redis.from_url(redis_server.url)
    planted = {f"{prefix}:not-ours".encode(): b"x", f"{prefix}:{'0' * 64}:c:x".encode(): b"y"}
    await admin.mset(planted)
    ks = keys(8, seed=4)
    async with ours, layout_b, prefix_b:
        await neighbours_stay_apart(ours, layout_b, prefix_b, ks, payloads, dsts)
    for name, value in planted.items():
        assert await admin.get(name) == value
    await admin.aclose()


_WRITER = """
import asyncio, sys
import numpy as np
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.testing.tiers import SMALL_LAYOUT
from kvtiers.tiers.redis import RedisTier

async def main(url, prefix, capacity, seed):
    config = TierConfig("redis", capacity, options={"url": url, "prefix": prefix})
    rng = np.random.default_rng(seed)
    async with RedisTier(config, SMALL_LAYOUT) as tier:
        for _ in range(40):
            ks = [ChunkKey(bytes([seed]) + rng.bytes(15)) for _ in range(4)]
            srcs = [np.frombuffer(k * (SMALL_LAYOUT.chunk_bytes // 16), np.uint8) for k in ks]
            await tier.put(ks, srcs)
            out = [np.zeros(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in ks]
            for hit, k, dst in zip(await tier.get(ks, out), ks, out):
                assert not hit or bytes(dst) == k * (SMALL_LAYOUT.chunk_bytes // 16), "wrong KV"
        assert tier.counters.errors == tier.counters.corrupt == 0

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


async def test_two_processes_share_one_capacity(redis_server: RedisServer) -> None:
    prefix, capacity = unique_prefix(), 24 * VALUE_BYTES
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _WRITER,
            redis_server.url,
            prefix,
            str(capacity),
            str(seed),
            env=env,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for seed in (1, 2)
    ]
    config = TierConfig("redis", capacity, options={"url": redis_server.url, "prefix": prefix})
    async with RedisTier(config, LAYOUT) as tier:
        for proc in procs:
            _, err = await asyncio.wait_for(proc.communicate(), HANG)
            assert proc.returncode == 0, err.decode()[-2000:]
        await tier.contains(keys(1))
        assert tier.usage().num_entries == 24  # full, and never past the capacity
        admin = aioredis.Redis.from_url(redis_server.url)
        names = await admin.keys(f"{prefix}:*:c:*")
        await admin.aclose()
        assert len(names) == 24  # every value is in the recency set and nothing more


async def test_many_concurrent_callers_on_overlapping_keys(redis_server: RedisServer) -> None:
    ks, srcs = keys(32, seed=8), payloads(32, seed=8)
    async with make_tier(redis_server.url, num_chunks=24, max_connections=4) as tier:
        await overlapping_callers(tier, ks, srcs, dsts, hang_s=HANG)
        await tier.contains(ks[:1])
        assert tier.usage().num_entries <= 24
        assert tier.counters.corrupt == tier.counters.foreign == tier.counters.errors == 0
        assert tier.io_counters.failures == 0


async def test_a_server_that_takes_smaller_values_than_a_chunk_is_a_config_error(
    own_redis_server: RedisServer,
) -> None:
    big = KVLayout(  # 2 MiB chunks
        model="m", num_layers=8, num_kv_heads=8, head_size=128, dtype="float16", chunk_size=64
    )
    admin = aioredis.Redis.from_url(own_redis_server.url)
    await admin.config_set("proto-max-bulk-len", "1mb")  # it resets every write's connection
    config = TierConfig("redis", 1 << 30, options={"url": own_redis_server.url}, index=2)
    tier = RedisTier(config, big)
    with pytest.raises(ConfigError, match=r"^tiers\[2\]\.max_value_bytes: .*proto-max-bulk-len"):
        await tier.open()
    await admin.config_set("proto-max-bulk-len", "512mb")
    await admin.aclose()
    async with RedisTier(config, big) as tier:  # the server takes them now
        assert await tier.put(keys(1), [np.ones(big.chunk_bytes, np.uint8)]) == [True]
    assert await num_clients(own_redis_server.url) == 0
