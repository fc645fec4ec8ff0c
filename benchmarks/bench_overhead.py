"""Per-request overhead of `lookup` + `load` of one small chunk from a DRAM tier.

A request is `n = await cache.lookup(tokens)` then `await cache.load(tokens[:n], out=dst)`
for a 16-token prompt (one chunk of a tiny layout: 2 layers, 1 KV head, head size 64,
float16, 8 KiB per chunk), served back to back by one event loop. The baseline does the same
two steps with the raw pieces: `ChunkHasher.keys` and a `dict` lookup for `lookup`, and
again with one `torch` `copy_` from a prepared tensor view for `load`. The ratio is the
facade's share of the raw pieces' speed; the notes give its overhead in microseconds.

A second line runs the same requests through two caches, one with a Prometheus endpoint
(`[metrics]`) scraped every 100 ms by another thread (a worst case: Prometheus scrapes every
15 s or so) and one without; goal: metrics on within 5% of metrics off.

Run alone: `python -m benchmarks.bench_overhead [--quick]`.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import urllib.request

import numpy as np
import torch

from benchmarks._common import Result, Target, main
from kvtiers import TieredCache
from kvtiers.core.keys import ChunkHasher
from kvtiers.core.layout import KVLayout

LAYOUT = {
    "model": "tiny",
    "num_layers": 2,
    "num_kv_heads": 1,
    "head_size": 64,
    "dtype": "float16",
    "chunk_size": 16,
}
NUM_PROMPTS = 64


async def _bench(num_requests: int, repeats: int) -> list[Result]:
    layout = KVLayout(**LAYOUT)  # type: ignore[arg-type]
    config = {"layout": LAYOUT, "tiers": [{"kind": "dram", "capacity": "16MiB"}]}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 32_000, 16).tolist() for _ in range(NUM_PROMPTS)]
    kv = torch.randn(layout.kv_shape(16)).to(torch.float16)
    dst = torch.empty(layout.kv_shape(16), dtype=torch.float16)

    # The raw pieces: the same hasher, a dict of keys to chunk tensors, one copy.
    hasher = ChunkHasher(layout.fingerprint, layout.chunk_size)
    blocks = {hasher.keys(p)[0]: kv.clone() for p in prompts}

    def raw_request(tokens: list[int]) -> None:
        n = 0
        for key in hasher.keys(tokens):
            if key not in blocks:
                break
            n += 1
        keys = hasher.keys(tokens[: n * 16])
        dst.copy_(blocks[keys[0]])

    async with TieredCache.from_config(config) as cache:
        for p in prompts:
            await cache.store(p, kv)

        async def cache_requests() -> None:
            for i in range(num_requests):
                tokens = prompts[i % NUM_PROMPTS]
                n = await cache.lookup(tokens)
                await cache.load(tokens[:n], out=dst)

        async def raw_requests() -> None:
            for i in range(num_requests):
                raw_request(prompts[i % NUM_PROMPTS])

        await cache_requests()
        assert torch.equal(dst, kv)
        await raw_requests()
        t_kv, t_raw = [], []
        for _ in range(repeats):
            for fn, acc in ((cache_requests, t_kv), (raw_requests, t_raw)):
                start = time.perf_counter()
                await fn()
                acc.append((time.perf_counter() - start) / num_requests)
        hits = cache.stats().tiers[0]

    us, raw_us = statistics.median(t_kv) * 1e6, statistics.median(t_raw) * 1e6
    return [
        Result.of_times(
            "lookup+load 1 chunk (8 KiB), DRAM, per request",
            us / 1e6,
            raw_us / 1e6,
            unit="us",
            notes=f"{1e6 / us:,.0f} requests/s vs {1e6 / raw_us:,.0f} with the raw pieces on "
            f"one event loop: the facade adds {us - raw_us:.0f} us ({us / raw_us:.1f}x) per "
            f"request; {num_requests} requests x {repeats} runs ({hits.hits:,} tier hits)",
        ),
    ]


async def _bench_metrics(num_requests: int, repeats: int) -> list[Result]:
    layout = KVLayout(**LAYOUT)  # type: ignore[arg-type]
    tiers = [{"kind": "dram", "capacity": "16MiB"}]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 32_000, 16).tolist() for _ in range(NUM_PROMPTS)]
    kv = torch.randn(layout.kv_shape(16)).to(torch.float16)
    dst = torch.empty(layout.kv_shape(16), dtype=torch.float16)
    on = TieredCache.from_config({"layout": LAYOUT, "tiers": tiers, "metrics": {"port": 0}})
    off = TieredCache.from_config({"layout": LAYOUT, "tiers": tiers})
    stop = threading.Event()
    scrapes = 0

    def scraper(url: str) -> None:
        nonlocal scrapes
        while not stop.wait(0.1):
            with urllib.request.urlopen(url, timeout=10) as resp:
                resp.read()
            scrapes += 1

    async with on, off:
        for cache in (on, off):
            for p in prompts:
                await cache.store(p, kv)
        assert on.metrics_url is not None
        thread = threading.Thread(target=scraper, args=(on.metrics_url,), daemon=True)
        thread.start()

        async def requests(cache: TieredCache) -> float:
            start = time.perf_counter()
            for i in range(num_requests):
                tokens = prompts[i % NUM_PROMPTS]
                n = await cache.lookup(tokens)
                await cache.load(tokens[:n], out=dst)
                # NOTE: DRAM hits never suspend; yield as a serving loop does between
                # requests, so that scrapes (run on this loop) are served meanwhile.
                await asyncio.sleep(0)
            return (time.perf_counter() - start) / num_requests

        t_on, t_off = [], []
        try:
            for _ in range(repeats):
                t_on.append(await requests(on))
                t_off.append(await requests(off))
        finally:
            stop.set()
            thread.join()
    m_on, m_off = statistics.median(t_on), statistics.median(t_off)
    return [
        Result.of_times(
            "lookup+load 1 chunk, metrics on vs off",
            m_on,
            m_off,
            unit="us",
            target=Target("ratio", ">=", 0.95),
            notes=f"endpoint scraped every 0.1 s ({scrapes} scrapes) while timing",
        )
    ]


def run(quick: bool) -> list[Result]:
    """Time back-to-back one-chunk requests through the cache and through raw pieces."""
    if quick:
        return asyncio.run(_bench(2_000, 3)) + asyncio.run(_bench_metrics(2_000, 3))
    return asyncio.run(_bench(10_000, 7)) + asyncio.run(_bench_metrics(10_000, 7))


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
