"""Lookup of a 4,096-token prompt through a shared LMDB tier vs raw py-lmdb lookups.

A shared tier (lmdb here) may hold chunks other processes wrote, so `TieredCache.lookup`
asks it for every chunk its own index does not place: the vLLM scheduler does this for
each waiting request, SGLang's `batch_exists` for each prefetch. The cache has one tier,
`lmdb`, opened on a path another cache filled (so its index is empty). The baseline does
the same work by hand: the prompt's chunk keys (`ChunkHasher.keys`), then one py-lmdb read
transaction with a `get` per key in the tier's `seqs` table (a few bytes a key).

Both run on one event loop, taking turns, page cache warm; medians.

Run alone: `python -m benchmarks.bench_shared_lookup [--quick]`.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._common import Result, main
from kvtiers import TieredCache
from kvtiers.core.keys import ChunkHasher

LAYOUT = {
    "model": "bench-shared-lookup",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_size": 64,
    "dtype": "float16",
    "chunk_size": 256,
}
NUM_TOKENS = 4096  # 16 chunks


def _config(path: Path) -> dict[str, object]:
    return {"layout": LAYOUT, "tiers": [{"kind": "lmdb", "path": str(path), "capacity": "1GiB"}]}


async def _fill(path: Path, prompts: list[list[int]]) -> None:
    async with TieredCache.from_config(_config(path)) as cache:
        for tokens in prompts:
            kv = torch.zeros(cache.layout.kv_shape(len(tokens)), dtype=torch.float16)
            assert await cache.store(tokens, kv) == len(tokens)


async def _bench(path: Path, prompts: list[list[int]], runs: int) -> tuple[float, float]:
    kv_times: list[float] = []
    raw_times: list[float] = []
    async with TieredCache.from_config(_config(path)) as cache:
        hasher = ChunkHasher(cache.layout.fingerprint, cache.layout.chunk_size)
        # NOTE: py-lmdb opens a path once per process: the baseline uses the tier's handle.
        tier = cache.tiers[0]
        env, seqs = tier._gate.env, tier._dbs.seqs
        for i in range(runs + 5):  # five warm-up rounds
            tokens = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            hit = await cache.lookup(tokens)
            t1 = time.perf_counter()
            keys = hasher.keys(tokens)
            with env.begin(db=seqs) as txn:
                found = sum(txn.get(key) is not None for key in keys)
            t2 = time.perf_counter()
            assert hit == len(tokens) and found == len(keys)
            if i >= 5:
                kv_times.append(t1 - t0)
                raw_times.append(t2 - t1)
            await asyncio.sleep(0)
    return statistics.median(kv_times), statistics.median(raw_times)


def run(quick: bool) -> list[Result]:
    """Time `lookup` through an LMDB tier against hashing plus raw py-lmdb gets."""
    runs = 100 if quick else 1000
    prompts = [[(p * 7919 + t) % 32000 for t in range(NUM_TOKENS)] for p in range(8)]
    root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-lookup-", dir="/tmp"))
    try:
        asyncio.run(_fill(root / "lmdb", prompts))
        kv_s, raw_s = asyncio.run(_bench(root / "lmdb", prompts, runs))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return [
        Result.of_times(
            "lookup 4K tok (16 chunks) through an LMDB tier vs hash + raw py-lmdb gets",
            kv_s,
            raw_s,
            unit="us",
            notes=f"{runs} lookups of 8 prompts, index empty (another cache stored them)",
        )
    ]


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
