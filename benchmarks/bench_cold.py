"""Cold loads from LMDB and from a `file://` remote tier with 1, 4 and 16 reads in flight.

Each tier is the cache's only tier, so `TieredCache.load` reads every chunk through it.
The baseline is the disk's own parallel read rate, measured in the same run: the same
payloads back to back in one flat file on the same disk, read with `os.preadv` by as many
threads as the tier keeps reads in flight (LMDB `read_threads`, remote `max_in_flight`),
each thread its share of the chunks, through the page cache and with `O_DIRECT` (no page
cache: the device's rate). Before every timed read the page cache is dropped
(`/proc/sys/vm/drop_caches` where writable, else `posix_fadvise`; `mincore` checks it).
Each cold LMDB load opens a fresh cache (mapped pages cannot be dropped); the remote tier
keeps one cache open across rounds, as a server does.

Chunks are 8 MiB (bench_dram's layout, 64 tokens); 512 MiB in all (128 MiB with
`--quick`). Target: the tier at >= 0.8 of the flat file read the same way (buffered).
Run alone: `python -m benchmarks.bench_cold [--quick]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import MIB, Result, Target, main
from benchmarks.bench_dram import VOCAB, make_kv
from benchmarks.bench_lmdb import FlatFile, drop_page_cache, resident_fraction
from benchmarks.bench_remote import CHUNK_BYTES, CHUNK_TOKENS, REMOTE_LAYOUT
from kvtiers import TieredCache

IN_FLIGHT = (1, 4, 16)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


async def _median_cold(
    fn: Callable[[], Awaitable[float]], files: list[Path], repeats: int
) -> tuple[float, float]:
    """Return the median seconds of `fn` after dropping `files`, and the most left resident."""
    times, left = [], []
    for _ in range(repeats):
        drop_page_cache(files)
        left.append(resident_fraction(files))
        times.append(await fn())
    return statistics.median(times), max(left)


def _read_objects(paths: list[Path], num_threads: int) -> float:
    """Read whole files with `num_threads` threads (each its share, one at a time): seconds.

    The baseline of a store with one file per object: the same files the remote tier
    reads, opened and read into a reused buffer each, with nothing verified or copied.
    """

    def read(share: list[Path]) -> None:
        buf = bytearray(max(p.stat().st_size for p in share))
        for path in share:
            with open(path, "rb", buffering=0) as f:
                f.readinto(buf)

    shares = [paths[i::num_threads] for i in range(num_threads)]
    start = time.perf_counter()
    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(read, shares))
    return time.perf_counter() - start


async def _bench(total: int, repeats: int) -> list[Result]:
    num_chunks = total // CHUNK_BYTES
    num_tokens = num_chunks * CHUNK_TOKENS
    tokens = np.random.default_rng(2).integers(0, VOCAB, num_tokens, dtype=np.int64)
    kv = make_kv(num_tokens)
    dst = torch.ones_like(kv)
    root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-cold-", dir=os.getcwd()))
    flat_path = root / "flat.bin"
    tiers: dict[str, Callable[[int], dict[str, Any]]] = {
        "lmdb": lambda n: {
            "kind": "lmdb",
            "path": str(root / "lmdb"),
            "capacity": 2 * total,
            "read_threads": n,
        },
        "remote file://": lambda n: {
            "kind": "remote",
            "url": f"file://{root}/pool",
            "capacity": 2 * total,
            "max_in_flight": n,
        },
    }
    results: list[Result] = []
    try:
        with open(flat_path, "wb") as f:
            for i in range(num_chunks):  # the same bytes a chunk's payload holds
                chunk = kv[:, :, i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS].contiguous()
                f.write(chunk.view(-1).view(torch.uint8).numpy().tobytes())
        flat_rates: dict[tuple[int, bool], float] = {}
        for n in IN_FLIGHT:
            for direct in (False, True):
                flat = FlatFile(flat_path, num_chunks, n, CHUNK_BYTES, direct)

                async def read(flat: FlatFile = flat) -> float:
                    start = time.perf_counter()
                    flat.read_all()
                    return time.perf_counter() - start

                try:
                    seconds, _ = await _median_cold(read, [flat_path], repeats)
                finally:
                    flat.close()
                flat_rates[(n, direct)] = total / seconds
        for name, tier in tiers.items():
            async with TieredCache.from_config(
                {"layout": REMOTE_LAYOUT, "tiers": [tier(4)]}
            ) as cache:
                assert await cache.store(tokens, kv) == num_tokens
            files = _files(root / ("lmdb" if name == "lmdb" else "pool"))
            for n in IN_FLIGHT:
                cfg = {"layout": REMOTE_LAYOUT, "tiers": [tier(n)]}
                # NOTE: LMDB's map keeps pages mapped, so each cold LMDB load gets a fresh
                # cache; a remote tier's files are not mapped, so one cache serves every
                # round, as in a long-running server (after one untimed load).
                kept = TieredCache.from_config(cfg) if name != "lmdb" else None

                async def load(cfg: dict[str, Any] = cfg, kept: Any = kept) -> float:
                    async with contextlib.AsyncExitStack() as stack:
                        cache = kept or await stack.enter_async_context(
                            TieredCache.from_config(cfg)
                        )
                        start = time.perf_counter()
                        out = await cache.load(tokens, out=dst)
                        seconds = time.perf_counter() - start
                    assert out.shape[2] == num_tokens, "a chunk was missing"
                    return seconds

                if kept is not None:
                    await kept.open()
                    await load()
                try:
                    seconds, left = await _median_cold(load, files, repeats)
                finally:
                    if kept is not None:
                        await kept.close()
                rate, buffered, direct = (
                    total / seconds,
                    flat_rates[(n, False)],
                    flat_rates[(n, True)],
                )
                notes = (
                    f"flat file O_DIRECT with {n} threads: {direct / MIB:,.0f} MiB/s "
                    f"(kvtiers {rate / direct:.2f}x of it); {left:.1%} of pages left "
                    "resident at most"
                )
                if name != "lmdb":
                    objects = [p for p in files if p.stat().st_size >= CHUNK_BYTES]

                    async def raw(objects: list[Path] = objects, n: int = n) -> float:
                        return _read_objects(objects, n)

                    raw_rate = total / (await _median_cold(raw, objects, repeats))[0]
                    notes += (
                        f"; the same {len(objects)} object files read raw by {n} threads: "
                        f"{raw_rate / MIB:,.0f} MiB/s (kvtiers {rate / raw_rate:.2f}x of it)"
                    )
                results.append(
                    Result.of_rates(
                        f"{name} cold load, {n} in flight vs flat file buffered",
                        rate / MIB,
                        buffered / MIB,
                        unit="MiB/s",
                        target=Target("ratio", ">=", 0.8),
                        notes=notes,
                    )
                )
        assert torch.equal(dst.view(torch.uint8), kv.view(torch.uint8)), "wrong bytes loaded"
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(root)
    return results


def run(quick: bool) -> list[Result]:
    """Cold loads of 512 MiB (128 MiB with `quick`) from LMDB and file:// remote."""
    if quick:
        return asyncio.run(_bench(128 * MIB, 2))
    return asyncio.run(_bench(512 * MIB, 3))


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
