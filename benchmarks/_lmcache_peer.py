"""The measuring side of `bench_lmcache`: runs under `.venv-lmcache`, prints the timings.

Both sides live in this process: kvtiers (installed editable in LMCache's virtualenv) and
LMCache's `LocalDiskBackend`. See `bench_lmcache` for what is measured and why.

Run by `bench_lmcache`: `.venv-lmcache/bin/python -m benchmarks._lmcache_peer [--quick]`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import GIB
from benchmarks.bench_lmcache import _MARK, CHUNK_TOKENS, OPS, SHAPES, SIDES, SIZES
from benchmarks.bench_lmdb import drop_page_cache, resident_fraction
from kvtiers import TieredCache

MODEL = "bench/model"


def _payloads(num_chunks: int, chunk_bytes: int) -> np.ndarray:
    """Return `num_chunks` chunks: one random chunk repeated, each marked by its index."""
    out = np.empty((num_chunks, chunk_bytes), dtype=np.uint8)
    out[:] = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8)
    out[:, :8] = np.arange(num_chunks, dtype=np.uint64)[:, None].view(np.uint8)
    return out


class _LMCacheSide:
    """LMCache's CPU allocator and disk backend, on an event loop of their own."""

    def __init__(self, root: Path, shape: tuple[int, int, int], total: int, odirect: bool):
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        layers, heads, dim = shape
        self.root, self.torch = root, torch
        self.chunk_shape = torch.Size((2, layers, CHUNK_TOKENS, heads * dim))
        # room for the sources and one batch of staging objects; disk never evicts
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS, local_cpu=False, local_disk=f"file://{root}",
            max_local_cpu_size=2.5 * total / GIB + 0.25, max_local_disk_size=8 * total / GIB,
            extra_config={"use_odirect": odirect},
        )  # fmt: skip
        meta = LMCacheMetadata(
            MODEL, 1, 1, 0, 0, torch.bfloat16, (layers, 2, CHUNK_TOKENS, heads, dim)
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cpu = LocalCPUBackend(cfg, meta, dst_device="cpu")
        self.disk = LocalDiskBackend(cfg, self.loop, self.cpu, dst_device="cpu", metadata=meta)

    def sources(self, payloads: np.ndarray) -> list[Any]:
        """Return one memory object per chunk, holding the chunk's bytes."""
        from lmcache.v1.memory_management import MemoryFormat

        objs = []
        for row in payloads:
            obj = self.cpu.allocate(self.chunk_shape, self.torch.bfloat16, MemoryFormat.KV_2LTD)
            np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = row
            objs.append(obj)
        return objs

    def keys(self, tag: int, n: int) -> list[Any]:
        from lmcache.utils import CacheEngineKey

        dtype = self.torch.bfloat16
        return [CacheEngineKey(MODEL, 1, 0, tag * 1_000_000 + i, dtype) for i in range(n)]

    def store(self, keys: list[Any], objs: list[Any]) -> None:
        left, done = [len(keys)], threading.Event()
        lock = threading.Lock()

        def written(_key: Any) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        self.disk.batched_submit_put_task(keys, objs, on_complete_callback=written)
        if not done.wait(600):
            raise RuntimeError(f"LMCache: {left[0]} puts still pending after 600 s")

    def load(self, keys: list[Any]) -> list[Any]:
        """Return the staging objects that a get filled; `release` them."""
        return list(self.disk.batched_get_blocking(keys))

    def release(self, got: list[Any], check: np.ndarray) -> None:
        """Check the bytes of a get's objects against `check`, then free them."""
        try:
            if any(obj is None for obj in got):
                raise RuntimeError("LMCache: a chunk was missing")
            for row, obj in zip(check, got, strict=True):
                if not np.array_equal(np.frombuffer(obj.byte_array, dtype=np.uint8), row):
                    raise RuntimeError("LMCache: a chunk came back with other bytes")
        finally:
            for obj in got:
                if obj is not None:
                    obj.ref_count_down()

    def files(self) -> list[Path]:
        return [p for p in self.root.iterdir() if p.is_file()]

    def clear(self, keys: list[Any]) -> None:
        for key in keys:
            self.disk.remove(key)

    def close(self) -> None:
        self.disk.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


class _KVTiersSide:
    """A `TieredCache` with one lmdb tier, driven by `put_chunks` / `get_chunks`."""

    def __init__(self, root: Path, shape: tuple[int, int, int], total: int) -> None:
        layers, heads, dim = shape
        layout = {
            "model": MODEL, "num_layers": layers, "num_kv_heads": heads, "head_size": dim,
            "dtype": "bfloat16", "chunk_size": CHUNK_TOKENS,
        }  # fmt: skip
        tier = {"kind": "lmdb", "path": str(root), "capacity": 2 * total, "read_threads": 4}
        if os.environ.get(WRITEMAP_VAR) == "1":
            tier["writemap"] = True
        self.config = {"layout": layout, "tiers": [tier]}
        self.root = root
        self.cache: Any = None

    async def open(self) -> None:
        self.cache = TieredCache.from_config(self.config)
        await self.cache.open()

    async def close(self) -> None:
        await self.cache.close()

    def keys(self, tag: int, n: int) -> list[bytes]:
        return list(self.cache.chunk_keys([f"{tag}-{i}" for i in range(n)]))

    async def store(self, keys: list[bytes], srcs: list[np.ndarray]) -> None:
        if not all(await self.cache.put_chunks(keys, srcs)):
            raise RuntimeError("kvtiers: a chunk was not stored")

    async def load(self, keys: list[bytes], dsts: list[np.ndarray]) -> None:
        if not all(await self.cache.get_chunks(keys, dsts)):
            raise RuntimeError("kvtiers: a chunk was missing")

    def files(self) -> list[Path]:
        return [p for p in self.root.iterdir() if p.is_file()]


WRITEMAP_VAR = "KVTIERS_BENCH_WRITEMAP"  # "1": the lmdb tier takes `writemap = true`


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


async def _atimed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


def _lmcache_round(
    side: _LMCacheSide, tag: int, objs: list[Any], payloads: np.ndarray
) -> dict[str, Any]:
    keys = side.keys(tag, len(objs))
    os.sync()  # the sync below then flushes this store's writes only
    t_store, _ = _timed(lambda: side.store(keys, objs))
    t_sync, _ = _timed(os.sync)
    side.release(side.load(keys), payloads)
    t_warm, got = _timed(lambda: side.load(keys))
    side.release(got, payloads)
    files = side.files()
    method = drop_page_cache(files)
    left = resident_fraction(files)
    t_cold, got = _timed(lambda: side.load(keys))
    side.release(got, payloads)
    side.clear(keys)
    return {
        "store": t_store,
        "sync": t_sync,
        "warm": t_warm,
        "cold": t_cold,
        "drop": (method, left),
    }


async def _kvtiers_round(
    side: _KVTiersSide, tag: int, payloads: np.ndarray, dst: np.ndarray
) -> dict[str, Any]:
    keys, srcs, dsts = side.keys(tag, len(payloads)), list(payloads), list(dst)
    os.sync()
    t_store = await _atimed(lambda: side.store(keys, srcs))
    t_sync, _ = _timed(os.sync)
    await side.load(keys, dsts)
    t_warm = await _atimed(lambda: side.load(keys, dsts))
    await side.close()  # mapped pages cannot be dropped
    files = side.files()
    method = drop_page_cache(files)
    left = resident_fraction(files)
    await side.open()
    dst.fill(0)
    t_cold = await _atimed(lambda: side.load(keys, dsts))
    if not np.array_equal(dst, payloads):
        raise RuntimeError("kvtiers: a chunk came back with other bytes")
    await side.cache.clear()
    return {
        "store": t_store,
        "sync": t_sync,
        "warm": t_warm,
        "cold": t_cold,
        "drop": (method, left),
    }


async def _bench_shape(label: str, total: int, rounds: int, root: Path) -> dict[str, Any]:
    """Run `rounds` interleaved rounds of every side at one chunk size."""
    layers, heads, dim = SHAPES[label]
    chunk_bytes = 2 * layers * CHUNK_TOKENS * heads * dim * 2
    num_chunks = total // chunk_bytes
    payloads = _payloads(num_chunks, chunk_bytes)
    dst = np.ones_like(payloads)  # touched: no page faults in the loads
    for side in SIDES:
        (root / side).mkdir()
    kv = _KVTiersSide(root / "kvtiers", SHAPES[label], total)
    await kv.open()
    lm = {s: _LMCacheSide(root / s, SHAPES[label], total, s.endswith("odirect")) for s in SIDES[1:]}
    objs = {s: side.sources(payloads) for s, side in lm.items()}
    times: dict[str, dict[str, list[float]]] = {s: {op: [] for op in OPS} for s in SIDES}
    drops: list[tuple[str, float]] = []
    try:
        # NOTE: round 0 is untimed: first-touch costs (the LMDB file growing, LMCache's
        # allocator and disk threads starting) would weigh on the first side only.
        for r in range(rounds + 1):
            for name in SIDES[r % 3 :] + SIDES[: r % 3]:
                _log(f"{label} round {r}{' (warm-up)' if r == 0 else ''}: {name}")
                if name == "kvtiers":
                    res = await _kvtiers_round(kv, r, payloads, dst)
                else:
                    res = _lmcache_round(lm[name], r, objs[name], payloads)
                if r == 0:
                    continue
                drops.append(res.pop("drop"))
                for op, sec in res.items():
                    times[name][op].append(sec)
    finally:
        await kv.close()
        for name, side in lm.items():
            for obj in objs[name]:
                obj.ref_count_down()
            side.close()
    return {
        "total_bytes": num_chunks * chunk_bytes,
        "num_chunks": num_chunks,
        "chunk_bytes": chunk_bytes,
        "times": times,
        "drop_method": drops[0][0],
        "resident_max": max(left for _, left in drops),
    }


async def _bench(quick: bool) -> dict[str, Any]:
    total, rounds = SIZES[quick]
    runs = {}
    for label in SHAPES:
        root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-lmcache-", dir="/tmp"))
        try:
            runs[label] = await _bench_shape(label, total, rounds, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    versions = {d: version(d) for d in ("lmcache", "kvtiers", "torch", "numpy", "lmdb")}
    return {"versions": versions, "runs": runs}


if __name__ == "__main__":
    result = asyncio.run(_bench("--quick" in sys.argv[1:]))
    print(_MARK + json.dumps(result), flush=True)
