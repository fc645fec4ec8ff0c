"""A load split between LMDB and a remote tier: both tiers read at once, not one after the other.

A node that has cached the head of a long prompt in its LMDB tier and finds the tail in the
pool (a loopback S3 server, moto) loads the whole prompt: a DRAM tier over LMDB over
`remote`, the index knowing which tier holds which chunk. `TieredCache.get_chunks` of all
chunks is timed against the same call for each part alone (the LMDB head, then the remote
tail), in the same run, each round on a freshly opened cache (DRAM empty, the LMDB file
dropped from the page cache). moto serves a chunk several times slower than a cold LMDB
read on this kind of machine, so the head is 7/8 of the chunks: the two parts then take
about as long, where overlapping them matters most.

The same is then run with the pool on a latency-bound store instead: `slowmem://`, an
in-memory fsspec filesystem whose every request waits `LATENCY_S` (sleeping, as a client
waits for an object store's first byte) and costs no CPU; moto, all Python on the same two
cores, is CPU-bound instead, so its reads compete with LMDB's for the cores.

- vs the two parts one after the other: what a load cost when tiers were read in turn;
  the ratio is the speed-up (at most 2 when the parts take equally long).
- vs the slower part alone: the best any overlap can do; the ratio is the fraction of it
  reached (target >= 0.8).
- the split load with `concurrent_reads = false` (the tiers read one after another) against
  the default: the ratio says whether overlapping paid on this machine and store.

Chunks are 8 MiB (bench_dram's layout, 64 tokens), 64 of them (32 with `--quick`).
Run alone: `python -m benchmarks.bench_split_load [--quick]`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.memory import MemoryFileSystem

from benchmarks._common import MIB, Result, Target, main
from benchmarks.bench_dram import VOCAB, make_kv
from benchmarks.bench_lmdb import drop_page_cache
from benchmarks.bench_remote import (
    BUCKET,
    CHUNK_BYTES,
    CHUNK_TOKENS,
    IN_FLIGHT,
    REMOTE_LAYOUT,
    _raw_fs,
    _storage_options,
    moto_server,
)
from kvtiers import TieredCache

LATENCY_S = 0.03


class _SlowMemory(MemoryFileSystem):  # type: ignore[misc]
    """`memory://` whose reads first wait `LATENCY_S`, as for an object store's first byte."""

    protocol = "slowmem"
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix("slowmem://")
        return super()._strip_protocol(path)

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        time.sleep(LATENCY_S)
        return super().cat_file(path, start, end, **kw)


async def _bench_moto(num_chunks: int, repeats: int) -> list[Result]:
    with moto_server() as endpoint:
        raw = await _raw_fs(endpoint)
        await raw._call_s3("create_bucket", Bucket=BUCKET)
        await raw._s3.close()
        remote = {
            "kind": "remote",
            "url": f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}",
            "storage_options": _storage_options(endpoint),
        }
        return await _bench(remote, "S3 (moto)", num_chunks - num_chunks // 8, num_chunks, repeats)


async def _bench_latency(num_chunks: int, repeats: int) -> list[Result]:
    fsspec.register_implementation("slowmem", _SlowMemory, clobber=True)
    remote = {"kind": "remote", "url": f"slowmem://split/{uuid.uuid4().hex[:8]}"}
    where = f"a {LATENCY_S * 1e3:.0f} ms-latency store"
    return await _bench(remote, where, num_chunks // 2, num_chunks, repeats)


async def _bench(
    remote: dict[str, Any], where: str, half: int, num_chunks: int, repeats: int
) -> list[Result]:
    num_tokens = num_chunks * CHUNK_TOKENS
    tokens = np.random.default_rng(1).integers(0, VOCAB, num_tokens, dtype=np.int64)
    kv = make_kv(num_tokens)
    root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-split-", dir=os.getcwd()))
    remote = {**remote, "capacity": 2 * num_chunks * CHUNK_BYTES, "max_in_flight": IN_FLIGHT}
    lmdb = {"kind": "lmdb", "path": str(root / "lmdb"), "capacity": 2 * half * CHUNK_BYTES}
    dram = {"kind": "dram", "capacity": (num_chunks + 1) * CHUNK_BYTES}
    pool_only = {"layout": REMOTE_LAYOUT, "tiers": [remote]}
    node = {"layout": REMOTE_LAYOUT, "tiers": [dram, lmdb, remote]}
    # NOTE: timed caches take lmdb as write-back, so what they promote from the remote
    # pool is not copied into lmdb (a write-through lmdb would hold the tail next round).
    reader = {**node, "tiers": [dram, {**lmdb, "write_policy": "write_back"}, remote]}
    try:
        async with TieredCache.from_config(pool_only) as cache:
            assert await cache.store(tokens, kv) == num_tokens
        async with TieredCache.from_config(node) as cache:
            await cache.store(tokens[: half * CHUNK_TOKENS], kv[:, :, : half * CHUNK_TOKENS])
            await cache.flush()
        dsts = list(np.empty((num_chunks, CHUNK_BYTES), dtype=np.uint8))

        def timed(lo: int, hi: int, concurrent: bool = True) -> Callable[[], Awaitable[float]]:
            async def one() -> float:
                drop_page_cache(sorted(p for p in (root / "lmdb").iterdir() if p.is_file()))
                config = {**reader, "concurrent_reads": concurrent}
                async with TieredCache.from_config(config) as cache:
                    keys = cache.keys(tokens)
                    assert await cache.lookup_keys(keys) == num_chunks
                    start = time.perf_counter()
                    found = await cache.get_chunks(keys[lo:hi], dsts[lo:hi])
                    seconds = time.perf_counter() - start
                    tiers = {t.name: t.hits for t in cache.stats().tiers}
                assert all(found), "a chunk was missing"  # (each one verified by its tier)
                assert tiers["lmdb"] == max(0, min(hi, half) - lo), tiers
                return seconds

            return one

        fns = [
            timed(0, num_chunks),
            timed(0, half),
            timed(half, num_chunks),
            timed(0, num_chunks, concurrent=False),
        ]
        samples: list[list[float]] = [[] for _ in fns]
        for fn in fns:
            await fn()  # warm-up: connections, imports
        for _ in range(repeats):
            for fn, acc in zip(fns, samples, strict=True):
                acc.append(await fn())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t_split, t_lmdb, t_remote, t_serial = (statistics.median(acc) for acc in samples)
    what = f"{num_chunks} chunks of {CHUNK_BYTES // MIB} MiB, {half} in lmdb (cold), "
    what += f"{num_chunks - half} in {where}"
    times = f"split {t_split * 1e3:.0f} ms, lmdb part {t_lmdb * 1e3:.0f} ms, "
    times += f"remote part {t_remote * 1e3:.0f} ms"
    return [
        Result.of_times(
            f"load split lmdb + {where} vs the parts one after the other",
            t_split,
            t_lmdb + t_remote,
            notes=f"{what}; {times}",
        ),
        Result.of_times(
            f"load split lmdb + {where} vs the slower part alone",
            t_split,
            max(t_lmdb, t_remote),
            target=Target("ratio", ">=", 0.8),
            notes="the best an overlap can do: the split load waits for the slower tier only",
        ),
        Result.of_times(
            f"load split lmdb + {where}, concurrent_reads on vs off",
            t_split,
            t_serial,
            notes=f"off: {t_serial * 1e3:.0f} ms (the tiers one after another, one call)",
        ),
    ]


def run(quick: bool) -> list[Result]:
    """Time a load of 64 chunks (32 with `quick`) split between lmdb and a loopback S3."""
    num_chunks, repeats = (32, 3) if quick else (64, 5)
    return asyncio.run(_bench_moto(num_chunks, repeats)) + asyncio.run(
        _bench_latency(num_chunks, repeats)
    )


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
