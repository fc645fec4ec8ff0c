"""TieredCache over a redis tier: pooling across processes, a server outage, `explain`."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvtiers import TieredCache
from kvtiers.cli import main
from tests._pooling import run_child
from tests.conftest import SMALL_LAYOUT, make_kv, same_bytes, small_layout
from tests.tiers.servers import RedisServer, own_redis_server, redis_server, unique_prefix

pytest.importorskip("redis")

__all__ = ["own_redis_server", "redis_server"]  # fixtures, imported to be found here

CHUNK_BYTES = small_layout().chunk_bytes
TOKENS = list(range(7000, 7064))  # 4 chunks


def config(url: str, *, dram_chunks: int = 32, **options: Any) -> dict[str, Any]:
    dram = {"kind": "dram", "capacity": dram_chunks * CHUNK_BYTES}
    # room for headers: capacity counts whole stored values
    pool = {"kind": "redis", "url": url, "capacity": 200 * (CHUNK_BYTES + 256)}
    return {"layout": dict(SMALL_LAYOUT), "tiers": [dram, {**pool, **options}]}


async def test_another_process_loads_the_whole_prefix(redis_server: RedisServer, layout):
    cfg = config(redis_server.url, prefix=unique_prefix())
    async with TieredCache.from_config(cfg) as cache:
        assert await cache.store(TOKENS, make_kv(layout, 64, seed=42)) == 64
    result = await asyncio.to_thread(run_child, cfg, "load", TOKENS, seed=42)
    assert result == {"n": 64, "same": True, "hits": {"dram": 0, "redis": 4}}


async def test_server_outage_gives_misses_fast_and_recovers(
    own_redis_server: RedisServer, layout
) -> None:
    server = own_redis_server
    cfg = config(server.url, prefix=unique_prefix(), breaker_cooldown=0.3, timeout=1)
    local, pooled = TOKENS, list(range(64))
    kv_local, kv_pooled = make_kv(layout, 64, seed=1), make_kv(layout, 64, seed=2)
    async with TieredCache.from_config(cfg) as writer:
        await writer.store(pooled, kv_pooled)  # in the pool only, for the cache below
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(local, kv_local)
        await cache.flush()
        server.kill()
        start = time.perf_counter()
        for _ in range(3):
            assert await cache.lookup(local) == 64  # DRAM
            assert same_bytes(await cache.load(local), kv_local)
            assert await cache.lookup(pooled) == 0  # the pool answers misses
        await cache.store(list(range(900, 964)), make_kv(layout, 64, seed=3))
        await cache.flush()  # the write-through to the pool is dropped, not stuck
        assert time.perf_counter() - start < 5
        assert cache.stats().tiers[1].declined >= 4
        server.start()  # empty: a restart without persistence loses the pool
        await asyncio.sleep(0.35)
        async with TieredCache.from_config(cfg) as writer:
            await writer.store(pooled, kv_pooled)
        for _ in range(3):  # the first call probes; then everything goes through
            if await cache.lookup(pooled) == 64:
                break
        assert same_bytes(await cache.load(pooled), kv_pooled)


def test_explain_shows_a_redis_tier(tmp_path: Path, capsys) -> None:
    layout = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SMALL_LAYOUT.items())
    path = tmp_path / "tiers.toml"
    path.write_text(
        f"""
[layout]
{layout}

[[tiers]]
kind = "dram"
capacity = "64KiB"

[[tiers]]
kind = "redis"
name = "pool"
url = "redis://:hunter22@cache.internal:6379/0"
capacity = "1GiB"
ttl = 3600
"""
    )
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tiers[1]      pool (kind redis, kvtiers.tiers.redis.RedisTier)" in out
    assert "eviction    lru, by the tier itself; shared with other processes" in out
    assert "server      redis://cache.internal:6379/0, keys kvtiers:" in out
    assert "hunter22" not in out
