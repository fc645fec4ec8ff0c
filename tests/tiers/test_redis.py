"""The redis tier on a real Valkey (or Redis) server on loopback."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.testing.tiers import SMALL_LAYOUT, TierTests
from kvtiers.tiers._chunk_format import pack_value, value_bytes
from kvtiers.tiers._remote_breaker import BreakerState
from kvtiers.tiers.registry import TierRegistry
from tests.tiers.servers import (
    RedisServer,
    free_port,
    own_redis_server,
    redis_server,
    unique_prefix,
)

pytest.importorskip("redis")

from kvtiers.tiers.redis import RedisTier  # noqa: E402 - needs redis-py

__all__ = ["own_redis_server", "redis_server"]  # fixtures, imported to be found here

LAYOUT = SMALL_LAYOUT
VALUE_BYTES = value_bytes(LAYOUT.fingerprint, LAYOUT.chunk_bytes, num_layers=LAYOUT.num_layers)


def make_tier(url: str, num_chunks: int = 64, index: int = 1, **options: Any) -> RedisTier:
    config = TierConfig(
        "redis",
        num_chunks * VALUE_BYTES,
        options={"url": url, "prefix": unique_prefix(), **options},
        index=index,
    )
    return RedisTier(config, LAYOUT)


def keys(num: int, seed: int = 0) -> list[ChunkKey]:
    rng = np.random.default_rng(seed + 7)
    return [ChunkKey(rng.bytes(16)) for _ in range(num)]


def payloads(num: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.chunk_bytes, dtype=np.uint8) for _ in range(num)]


def dsts(num: int) -> list[np.ndarray]:
    return [np.zeros(LAYOUT.chunk_bytes, np.uint8) for _ in range(num)]


class TestRedisTier(TierTests):
    tier_cls = RedisTier
    atomic_batches = True  # one script per batch
    evicts_cold_first = True

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def entry_bytes(self) -> int:
        return VALUE_BYTES

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> RedisTier:
        options = {"url": self.server.url, "prefix": unique_prefix()}
        return RedisTier(TierConfig("redis", capacity_bytes, options=options), layout)


# -- pooling and eviction -------------------------------------------------------------------


async def test_two_tiers_share_entries_and_one_lru(redis_server: RedisServer) -> None:
    one = make_tier(redis_server.url, num_chunks=4)
    two = RedisTier(one.config, LAYOUT)  # same prefix: the same pool
    ks, srcs = keys(6), payloads(6)
    async with one, two:
        assert await one.put(ks[:4], srcs[:4]) == [True] * 4
        out = dsts(2)
        assert await two.get(ks[:2], out) == [True, True]  # ks[0:2] are now the most recent
        assert all(np.array_equal(s, d) for s, d in zip(srcs[:2], out, strict=True))
        assert await two.put(ks[4:], srcs[4:]) == [True, True]  # evicts ks[2:4]
        assert await one.contains(ks) == [True, True, False, False, True, True]
        assert two.counters.evictions == 2
        assert sorted(two.take_evicted()) == sorted(ks[2:4])  # reported once, by the evictor
        assert two.take_evicted() == one.take_evicted() == []
        assert one.usage().num_entries == two.usage().num_entries == 4


async def test_a_batch_larger_than_the_capacity_keeps_its_prefix(redis_server: RedisServer):
    async with make_tier(redis_server.url, num_chunks=3) as tier:
        ks = keys(5)
        assert await tier.put(ks, payloads(5)) == [True, True, True, False, False]
        assert tier.counters.declined == 2 and tier.counters.evictions == 0


async def test_ttl_expires_chunks_and_a_read_extends_it(redis_server: RedisServer) -> None:
    async with make_tier(redis_server.url, ttl=0.4) as tier:
        ks = keys(2)
        await tier.put(ks, payloads(2))
        for _ in range(3):
            await asyncio.sleep(0.2)
            assert (await tier.get(ks[:1], dsts(1))) == [True]  # read: expiry pushed back
        assert await tier.contains(ks) == [True, False]
        await tier.put(keys(1, seed=5), payloads(1))  # the write prunes the recency set
        assert tier.usage().num_entries == 2
        assert tier.take_evicted() == [ks[1]]


async def test_cold_chunks_expire_by_their_write_not_at_once(redis_server: RedisServer) -> None:
    async with make_tier(redis_server.url, ttl=1.0) as tier:
        cold, warm = keys(2), keys(2, seed=1)
        await tier.put_hinted(cold, payloads(2), cold=set(cold))
        await asyncio.sleep(0.2)
        await tier.put(warm, payloads(2))  # the write prunes the recency set: nothing is past
        assert tier.take_evicted() == [] and tier.usage().num_entries == 4
        await asyncio.sleep(0.9)
        await tier.put(keys(1, seed=5), payloads(1))
        assert sorted(tier.take_evicted()) == sorted(cold)
        assert await tier.contains([*cold, *warm]) == [False, False, True, True]


async def test_a_batch_never_evicts_its_own_cold_chunks(redis_server: RedisServer) -> None:
    async with make_tier(redis_server.url, num_chunks=3) as tier:
        ks = keys(5)
        held = await tier.put_hinted(ks, payloads(5), cold=set(ks[1:]))
        assert held == [True, True, True, False, False]
        assert tier.counters.evictions == 0
        assert await tier.put_hinted(keys(1, seed=7), payloads(1), cold=set()) == [True]
        assert await tier.contains(ks[:3]) == [True, True, False]  # the deepest cold one went


# -- values behind kvtiers' back --------------------------------------------------------------


async def test_garbage_and_foreign_values_are_counted_misses(redis_server: RedisServer) -> None:
    import redis.asyncio as aioredis

    async with make_tier(redis_server.url) as tier:
        ks, srcs = keys(4), payloads(4)
        await tier.put(ks, srcs)
        client = aioredis.Redis.from_url(redis_server.url)
        name = tier._chunk_key
        good = pack_value(LAYOUT.fingerprint, ks[0], srcs[0].data)
        await client.set(name(ks[0]), b"garbage")
        own = pack_value(LAYOUT.fingerprint, ks[1], srcs[1].data)
        await client.set(name(ks[1]), own[:-1])  # truncated
        await client.set(name(ks[2]), good)  # ks[0]'s value under ks[2]'s key
        await client.aclose()
        out = dsts(4)
        assert await tier.get(ks, out) == [False, False, False, True]
        assert (out[0] == 0).all() and (out[2] == 0).all()
        assert (tier.counters.corrupt, tier.counters.foreign) == (2, 1)
        assert await tier.contains(ks) == [False, False, False, True]  # deleted
        assert tier.usage().num_entries == 1
        assert await tier.put(ks[:3], srcs[:3]) == [True] * 3  # and written again
        assert await tier.get(ks, dsts(4)) == [True] * 4


# -- integrity -------------------------------------------------------------------------------

SECRET_ENV = "KVTIERS_TEST_REDIS_SECRET"


async def test_a_forged_value_is_never_loaded(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis.asyncio as aioredis

    monkeypatch.setenv(SECRET_ENV, "a-redis-secret-of-32-bytes-xxxxx")
    options = {"integrity": "hmac-sha256", "integrity_key_env": SECRET_ENV}
    async with make_tier(redis_server.url, **options) as tier:
        ks, srcs = keys(2), payloads(2)
        assert await tier.put(ks, srcs) == [True, True]
        # a writer without the secret plants a value with a valid checksum but no tag
        forged = pack_value(LAYOUT.fingerprint, ks[0], payloads(1, seed=9)[0].data)
        client = aioredis.Redis.from_url(redis_server.url)
        await client.set(tier._chunk_key(ks[0]), forged)
        await client.aclose()
        out = dsts(2)
        assert await tier.get(ks, out) == [False, True]
        assert (out[0] == 0).all() and (out[1] == srcs[1]).all()
        assert (tier.counters.forged, tier.counters.corrupt) == (1, 1)


class TestRedisTierWithIntegrity(TestRedisTier):
    @pytest.fixture(autouse=True)
    def _secret(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(SECRET_ENV, "a-redis-secret-of-32-bytes-xxxxx")

    def entry_bytes(self) -> int:
        n = LAYOUT.num_layers
        return value_bytes(LAYOUT.fingerprint, LAYOUT.chunk_bytes, num_layers=n, tagged=True)

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> RedisTier:
        options = {
            "url": self.server.url,
            "prefix": unique_prefix(),
            "integrity": "hmac-sha256",
            "integrity_key_env": SECRET_ENV,
        }
        return RedisTier(TierConfig("redis", capacity_bytes, options=options), layout)


# -- outage ----------------------------------------------------------------------------------


async def test_server_killed_mid_workload_gives_misses_and_recovers(
    own_redis_server: RedisServer,
) -> None:
    server = own_redis_server
    async with make_tier(server.url, breaker_cooldown=0.3, timeout=1) as tier:
        ks, srcs = keys(8), payloads(8)
        assert await tier.put(ks[:4], srcs[:4]) == [True] * 4

        async def workload() -> None:
            for _ in range(50):
                await tier.get(ks[:4], dsts(4))
                await tier.contains(ks)
                await tier.put(ks[4:], srcs[4:])
                await asyncio.sleep(0.005)

        start = time.perf_counter()
        task = asyncio.ensure_future(workload())
        await asyncio.sleep(0.05)
        server.kill()
        await task  # no exception
        for _ in range(5):
            assert await tier.get(ks[:4], dsts(4)) == [False] * 4
            assert await tier.contains(ks) == [False] * 8
            assert await tier.put(ks[4:], srcs[4:]) == [False] * 4
            await tier.delete(ks[4:5])
        assert time.perf_counter() - start < 5
        assert tier._guard.breaker.state is not BreakerState.CLOSED
        assert tier.io_counters.refused > 0 and tier.io_counters.dropped_writes >= 4
        assert tier.counters.errors > 0 and tier.counters.declined >= 4
        server.start()  # same port, empty (no persistence)
        await asyncio.sleep(0.35)
        for _ in range(3):  # the first call probes; then everything goes through
            if await tier.put(ks[:4], srcs[:4]) == [True] * 4:
                break
        out = dsts(4)
        assert await tier.get(ks[:4], out) == [True] * 4
        assert all(np.array_equal(s, d) for s, d in zip(srcs[:4], out, strict=True))
        assert tier._guard.breaker.state is BreakerState.CLOSED


async def test_unreachable_server_at_open_opens_fast_and_serves_misses() -> None:
    start = time.perf_counter()
    url = f"redis://127.0.0.1:{free_port()}/0"
    async with make_tier(url, breaker_failures=1) as tier:
        assert await tier.get(keys(2), dsts(2)) == [False, False]
        assert await tier.put(keys(2), payloads(2)) == [False, False]
        assert await tier.contains(keys(2)) == [False, False]
    assert time.perf_counter() - start < 5


async def test_a_hung_server_times_out(own_redis_server: RedisServer) -> None:
    server = own_redis_server
    async with make_tier(server.url, timeout=0.3, breaker_failures=1) as tier:
        assert server.proc is not None
        server.proc.send_signal(19)  # SIGSTOP: connections accepted, nothing answered
        try:
            start = time.perf_counter()
            assert await tier.get(keys(2), dsts(2)) == [False, False]
            assert await tier.get(keys(2), dsts(2)) == [False, False]  # refused at once
            assert time.perf_counter() - start < 2
            assert tier.io_counters.timeouts == 1 and tier.io_counters.refused == 1
        finally:
            server.proc.send_signal(18)  # SIGCONT


# -- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"url": ""}, "url"),
        ({"url": "http://localhost:6379"}, "url"),
        ({"url": 6379}, "url"),
        ({"prefix": ""}, "prefix"),
        ({"prefix": "a b"}, "prefix"),
        ({"ttl": 0}, "ttl"),
        ({"ttl": "1h"}, "ttl"),
        ({"max_connections": 0}, "max_connections"),
        ({"timeout": -1}, "timeout"),
        ({"retries": -1}, "retries"),
        ({"breaker_failures": 0}, "breaker_failures"),
        ({"breaker_cooldown": 0}, "breaker_cooldown"),
        ({"max_value_bytes": "lots"}, "max_value_bytes"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_option_names_the_field(options: dict[str, Any], field: str) -> None:
    opts = {"url": "redis://127.0.0.1:1/0", **options}
    with pytest.raises(ConfigError, match=rf"^tiers\[2\]\.{field}: "):
        RedisTier(TierConfig("redis", 1 << 20, options=opts, index=2), LAYOUT)


def test_defaults_and_a_rediss_url() -> None:
    tier = make_tier("rediss://user:secret@cache.example:6380/2")
    options = tier.options
    assert (options.max_connections, options.timeout, options.retries) == (16, 5.0, 1)
    assert (options.breaker_failures, options.ttl, options.max_value_bytes) == (5, None, 2**29)
    assert "secret" not in tier._guard.where


def test_a_chunk_larger_than_the_server_accepts_is_refused_at_config_load() -> None:
    big = KVLayout(
        model="m", num_layers=64, num_kv_heads=32, head_size=128, dtype="float32", chunk_size=512
    )  # 1 GiB chunks
    config = TierConfig("redis", 1 << 40, options={"url": "redis://h:1"}, index=1)
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.max_value_bytes: a stored chunk takes"):
        RedisTier(config, big)
    small = TierConfig("redis", 1 << 20, options={"url": "redis://h:1", "max_value_bytes": "1KiB"})
    with pytest.raises(ConfigError, match="more than the server accepts"):
        RedisTier(small, LAYOUT)


def test_eviction_other_than_lru_and_tiny_capacity_are_refused() -> None:
    config = TierConfig("redis", 1 << 20, eviction="arc", options={"url": "redis://h:1"}, index=1)
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.eviction: "):
        RedisTier(config, LAYOUT)
    config = TierConfig("redis", VALUE_BYTES - 1, options={"url": "redis://h:1"}, index=3)
    with pytest.raises(ConfigError, match=r"^tiers\[3\]\.capacity: capacity too small"):
        RedisTier(config, LAYOUT)


def test_registered_through_the_entry_point_group_not_as_a_built_in() -> None:
    assert TierRegistry().resolve("redis") is RedisTier
    assert "redis" not in TierRegistry(load_entry_points=False)
    assert RedisTier.shared and RedisTier.manages_eviction
