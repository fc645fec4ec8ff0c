"""Warm loads of whole prompts from an LMDB tier vs raw py-lmdb reads, by value size.

`bench_lmdb` loads 32 MiB chunks; engines more often store small ones: the vLLM TTFT
benchmark's default model keeps 256 KiB per 256-token chunk (a 4,096-token prompt is 4 MiB),
SGLang's small pages are 64 KiB, its large ones several MiB. Per value, verifying a value
and copying it has a fixed Python part besides its bytes, and how a batch is split across
the tier's threads (`read_parts`) matters most for small values.

The cache has one tier, `lmdb`, page cache warm, and loads a prompt with `TieredCache.load`
(its lookup included). The baseline does the bare reads by hand, on the same thread: the
prompt's chunk keys (`ChunkHasher.keys`), then one py-lmdb read transaction with a `get` per
key and a copy of each payload into a reused buffer, nothing verified. Both run on one event
loop, taking turns; medians.

Run alone: `python -m benchmarks.bench_lmdb_small [--quick]`.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import Result, main
from kvtiers import TieredCache
from kvtiers.core.keys import ChunkHasher

# (name, layout, tokens per prompt)
CASES: list[tuple[str, dict[str, Any], int]] = [
    ("16 x 256 KiB (the TTFT default model)", {"num_layers": 2, "num_kv_heads": 2}, 4096),
    ("128 x 64 KiB", {"num_layers": 2, "num_kv_heads": 1, "chunk_size": 128}, 16384),
    ("64 x 384 KiB (two parts on two cores)", {"num_layers": 6, "num_kv_heads": 1}, 16384),
    ("16 x 3 MiB (the TTFT larger model)", {"num_layers": 6, "num_kv_heads": 8}, 4096),
]


def _layout(overrides: dict[str, Any]) -> dict[str, Any]:
    base = {"model": "bench-lmdb-small", "head_size": 64, "dtype": "bfloat16", "chunk_size": 256}
    return {**base, **overrides}


async def _bench(
    path: Path, layout: dict[str, Any], num_tokens: int, runs: int
) -> tuple[float, float]:
    config = {"layout": layout, "tiers": [{"kind": "lmdb", "path": str(path), "capacity": "1GiB"}]}
    tokens = list(range(num_tokens))
    kv_times: list[float] = []
    raw_times: list[float] = []
    async with TieredCache.from_config(config) as cache:
        kv = torch.randn(cache.layout.kv_shape(num_tokens)).to(torch.bfloat16)
        assert await cache.store(tokens, kv) == num_tokens
        await cache.flush()
        out = torch.empty_like(kv)
        hasher = ChunkHasher(cache.layout.fingerprint, cache.layout.chunk_size)
        size = cache.layout.chunk_bytes
        bufs = [np.empty(size, np.uint8) for _ in range(num_tokens // cache.layout.chunk_size)]
        # NOTE: py-lmdb opens a path once per process: the baseline uses the tier's handle.
        tier = cache.tiers[0]
        env, chunks = tier._gate.env, tier._dbs.chunks
        for i in range(runs + 5):  # five warm-up rounds
            t0 = time.perf_counter()
            loaded = await cache.load(tokens, out=out)
            t1 = time.perf_counter()
            with env.begin(db=chunks, buffers=True) as txn:
                for key, buf in zip(hasher.keys(tokens), bufs, strict=True):
                    raw = txn.get(key)
                    np.copyto(buf, np.frombuffer(raw, np.uint8, size, len(raw) - size))
            t2 = time.perf_counter()
            assert loaded.shape[2] == num_tokens
            if i >= 5:
                kv_times.append(t1 - t0)
                raw_times.append(t2 - t1)
            await asyncio.sleep(0)
        assert torch.equal(out, kv)
    return statistics.median(kv_times), statistics.median(raw_times)


def run(quick: bool) -> list[Result]:
    """Time whole-prompt loads through an LMDB tier against raw py-lmdb reads, per case."""
    runs = 20 if quick else 200
    results = []
    root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-lmdb-small-", dir="/var/tmp"))
    try:
        for i, (name, overrides, num_tokens) in enumerate(CASES):
            kv_s, raw_s = asyncio.run(_bench(root / str(i), _layout(overrides), num_tokens, runs))
            results.append(
                Result.of_times(
                    f"LMDB load, {name}, warm, vs raw py-lmdb gets",
                    kv_s,
                    raw_s,
                    notes=f"{runs} loads; kvtiers verifies each value, the baseline does not",
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
