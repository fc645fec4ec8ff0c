"""The redis tier's layer-wise reads (GETRANGE, per-layer checks) on a real server."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvtiers import TieredCache
from kvtiers.core.config import TierConfig
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.tiers._chunk_format import pack_value
from tests.conftest import make_kv, same_bytes
from tests.tiers.servers import RedisServer, redis_server, unique_prefix

pytest.importorskip("redis")

from kvtiers.tiers.redis import RedisTier  # noqa: E402 - needs redis-py

__all__ = ["redis_server"]  # the fixture, imported to be found here

LAYOUT = KVLayout(
    model="m", num_layers=8, num_kv_heads=2, head_size=8, dtype="float16", chunk_size=16
)
STEP = LAYOUT.layer_bytes
SENTINEL = 0xAB


def tier_on(server: RedisServer, **options: Any) -> RedisTier:
    options = {"url": server.url, "prefix": unique_prefix(), **options}
    return RedisTier(TierConfig("redis", 1 << 20, options=options, index=1), LAYOUT)


def keys(num: int) -> list[ChunkKey]:
    rng = np.random.default_rng(num)
    return [ChunkKey(rng.bytes(16)) for _ in range(num)]


def payloads(num: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.chunk_bytes, dtype=np.uint8) for _ in range(num)]


def blank(num: int) -> list[np.ndarray]:
    return [np.full(LAYOUT.chunk_bytes, SENTINEL, np.uint8) for _ in range(num)]


def layers_of(buf: np.ndarray, layers: list[int]) -> list[bytes]:
    return [bytes(buf[i * STEP : (i + 1) * STEP]) for i in layers]


async def raw(tier: RedisTier, key: ChunkKey) -> bytes | None:
    value: bytes | None = await tier._redis.get(tier._chunk_key(key))
    return value


async def test_waves_fill_their_layers_only_and_count_one_hit(redis_server: RedisServer) -> None:
    async with tier_on(redis_server) as tier:
        assert tier.layer_reads
        ks, srcs = keys(5), payloads(5)
        await tier.put(ks, srcs)
        out = blank(5)
        assert await tier.get_layers(ks, [0], out) == [True] * 5
        for buf, src in zip(out, srcs, strict=True):
            assert layers_of(buf, [0]) == layers_of(src, [0])
            assert not (buf[STEP:] != SENTINEL).any()  # the other layers left alone
        assert await tier.get_layers(ks, [1, 2], out, tally=False) == [True] * 5
        assert await tier.get_layers(ks, list(range(3, 8)), out, tally=False) == [True] * 5
        assert all((b == s).all() for b, s in zip(out, srcs, strict=True))
        assert (tier.counters.hits, tier.counters.misses) == (5, 0)
        assert tier.counters.bytes_read == 5 * LAYOUT.chunk_bytes


async def test_later_waves_read_their_layers_without_the_header(redis_server: RedisServer) -> None:
    async with tier_on(redis_server) as tier:
        (key,), (src,) = keys(1), payloads(1)
        await tier.put([key], [src])
        plan = tier._ranges.plan([1, 2])
        assert tier._ranges.ranges(key, plan)[0][0] == 0  # header not known yet
        await tier.get_layers([key], [0], blank(1))
        header_len = tier._values.header_len
        assert tier._ranges.ranges(key, plan) == [(header_len + STEP, header_len + 3 * STEP)]


async def test_a_corrupt_later_layer_is_read_whole_deleted_and_counted(
    redis_server: RedisServer,
) -> None:
    async with tier_on(redis_server) as tier:
        (key,), (src,) = keys(1), payloads(1)
        await tier.put([key], [src])
        out = blank(1)
        assert await tier.get_layers([key], [0], out) == [True]
        name = tier._chunk_key(key)
        value = await raw(tier, key)
        assert value is not None
        spot = len(value) - LAYOUT.chunk_bytes + 5 * STEP + 3  # inside layer 5
        await tier._redis.setrange(name, spot, bytes([value[spot] ^ 0xFF]))
        before = bytes(out[0])
        assert await tier.get_layers([key], [3, 4, 5, 6, 7], out, tally=False) == [False]
        assert tier.counters.corrupt == 1
        assert await raw(tier, key) is None  # deleted, so no one else reads it
        assert bytes(out[0]) == before  # nothing of the bad value reached the destination


async def test_a_missing_value_is_a_miss(redis_server: RedisServer) -> None:
    async with tier_on(redis_server) as tier:
        ks = keys(3)
        await tier.put(ks[:1], payloads(1))
        assert await tier.get_layers(ks, [0, 1], blank(3)) == [True, False, False]
        assert (tier.counters.hits, tier.counters.misses, tier.counters.corrupt) == (1, 2, 0)


async def test_a_value_rewritten_between_waves_is_read_whole(redis_server: RedisServer) -> None:
    async with tier_on(redis_server) as tier:
        (key,), (old,) = keys(1), payloads(1)
        await tier.put([key], [old])
        out = blank(1)
        await tier.get_layers([key], [0], out)
        (new,) = payloads(1, seed=9)  # another valid value under the same key
        value = pack_value(LAYOUT.fingerprint, key, new.data, num_layers=LAYOUT.num_layers)
        await tier._redis.set(tier._chunk_key(key), value)
        assert await tier.get_layers([key], [1], out, tally=False) == [True]
        assert layers_of(out[0], [0, 1]) == [*layers_of(old, [0]), *layers_of(new, [1])]
        assert tier.counters.corrupt == 0


async def test_only_a_tallied_read_touches_recency_and_ttl(redis_server: RedisServer) -> None:
    async with tier_on(redis_server, ttl=1000) as tier:
        (key,), (src,) = keys(1), payloads(1)
        await tier.put([key], [src])
        name, lru = tier._chunk_key(key), tier._lru
        await tier._redis.zadd(lru, {name: 1.0})
        await tier._redis.pexpire(name, 5000)
        await tier.get_layers([key], [0], blank(1), tally=False)
        assert await tier._redis.zscore(lru, name) == 1.0
        assert await tier._redis.pttl(name) <= 5000
        await tier.get_layers([key], [0], blank(1))
        assert await tier._redis.zscore(lru, name) > 1.0
        assert await tier._redis.pttl(name) > 900_000


@pytest.mark.parametrize("options", [{"layer_reads": False}, {"integrity": "hmac-sha256"}])
async def test_without_layer_reads_whole_values_are_read(
    redis_server: RedisServer, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    if "integrity" in options:
        monkeypatch.setenv("KVTIERS_TEST_REDIS_LAYERS_KEY", "k" * 32)
        options = {**options, "integrity_key_env": "KVTIERS_TEST_REDIS_LAYERS_KEY"}
    async with tier_on(redis_server, **options) as tier:
        assert not tier.layer_reads  # a tag covers the whole payload: no ranged checks
        ks, srcs = keys(2), payloads(2)
        await tier.put(ks, srcs)
        out = blank(2)
        assert await tier.get_layers(ks, [2, 3], out) == [True, True]
        assert layers_of(out[0], [2, 3]) == layers_of(srcs[0], [2, 3])
        assert not tier._ranges._headers  # no ranged read was made


async def test_a_cache_loads_a_redis_pool_wave_by_wave(redis_server: RedisServer) -> None:
    tokens = list(range(500, 596))  # 6 chunks
    kv = make_kv(LAYOUT, len(tokens))
    pool = {"kind": "redis", "url": redis_server.url, "prefix": unique_prefix()}
    config = {
        "layout": {"model": "m", "num_layers": 8, "num_kv_heads": 2, "head_size": 8,
                   "dtype": "float16", "chunk_size": 16},
        "tiers": [{"kind": "dram", "capacity": "1MiB"}, {**pool, "capacity": "1MiB"}],
    }  # fmt: skip
    async with TieredCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.flush()
    async with TieredCache.from_config(config) as cache:  # a fresh DRAM tier
        calls: list[tuple[int, int]] = []
        got = await cache.load(tokens, on_layers=lambda n, t: calls.append((n, t)))
        assert same_bytes(got, kv)
        assert calls == [(1, 96), (3, 96), (8, 96)]
        assert cache.stats().tiers[1].hits == 6


@pytest.mark.parametrize("layerwise", [False, True])
async def test_a_key_of_another_type_is_a_deleted_corrupt_value_not_an_outage(
    redis_server: RedisServer, layerwise: bool
) -> None:
    async with tier_on(redis_server) as tier:
        ks, srcs = keys(3), payloads(3)
        await tier.put(ks, srcs)
        name = tier._chunk_key(ks[1])
        await tier._redis.delete(name)
        await tier._redis.rpush(name, b"not a chunk")  # behind kvtiers' back
        out = blank(3)
        if layerwise:
            got = await tier.get_layers(ks, [0, 1], out)
        else:
            got = await tier.get(ks, out)
        assert got == [True, False, True]
        assert tier.counters.corrupt == 1 and tier.io_counters.failures == 0
        assert not await tier._redis.exists(name)  # deleted, so the next read is a plain miss
        assert await tier.get(ks, blank(3)) == [True, False, True]
