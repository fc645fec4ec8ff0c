"""SGLang HiCache storage: kvtiers' backend (LMDB tier) beside SGLang's own `HiCacheFile`.

Both backends work on the same real host pools (`MHATokenToKVPoolHost`, layer_first, on
the CPU), the same pages and batches of 128 pages, in one run, through the calls HiCache
makes: `HiCacheFile` through its v2 path (`batch_set_v2` / `batch_get_v2`; it has no v1
path), kvtiers through the zero-copy v1 path (`interface_v1`), which reads into and writes
from the host pool's pages directly.

- set+sync: one batch set, then `os.sync()` (the data is on disk when it ends).
- get cold: the backend's files are dropped from the page cache first (this process's
  mappings of them undone with `madvise(MADV_DONTNEED)`, then `posix_fadvise(DONTNEED)` on
  each file after the sync: no root needed; `mincore` checks that nothing is left), then,
  as HiCache's prefetch does, `batch_exists` of the batch and the get: the time of both
  (the exists alone is reported too: for kvtiers it reads LMDB's tree pages and, by the
  kernel's read-around, much of the values; for HiCacheFile, one `stat` per file).
- get warm: the same batch again, page cache warm.
- get cold, index warm: a second batch, stored with the first (untimed) and read once: the
  page cache dropped again, then kvtiers' LMDB index (the tree pages of its databases, no
  value) read back by another process before its exists and get are timed. A running
  server keeps its index cached (every lookup touches it), as the kernel keeps
  `HiCacheFile`'s file metadata (dentries and inodes, which dropping file pages leaves
  cached in both cold rows); after a reboot both are cold. The kernel's read-around makes
  the difference large on disks with a large readahead window (`read_ahead_kb`): each cold
  tree page costs a read of that whole window.

kvtiers runs twice: with the LMDB tier's defaults, and with `writemap = true` (LMDB writes
values straight into its map: one copy and the per-commit buffers less), rows of their own.

Beside them, the disk's own ceiling in the same run: the same bytes written to one flat
file and synced, then read back cold, single-threaded (informative lines, kvtiers vs raw).
No backend can set+sync faster than the disk writes.

Two page sizes: 8 MiB (32 layers, 8 KV heads, head_dim 128, bf16, page 64) and 64 KiB
(8 layers, 2 KV heads, head_dim 64, bf16, page 16). Medians over `REPEATS` rounds, each
with fresh keys. Goals: at 8 MiB, cold get >= 2x and set+sync >= 3x HiCacheFile's; at
64 KiB, cold get >= 4x; warm get >= 1.5x.

Runs under SGLang's virtualenv (`.venv-sglang`, built by `python -m pytest
tests/integrations`): `.venv-sglang/bin/python -m benchmarks.bench_sglang_storage [--quick]`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import Result, Target, main
from benchmarks.bench_lmdb import resident_fraction

BATCH = 128
_MADV_DONTNEED = 4
REPEATS = 3
WRITEMAP = "kvtiers-writemap"  # the same backend, its lmdb tier with `writemap = true`
# name -> (layers, kv heads, head_dim, page tokens)
SHAPES = {"8MiB": (32, 8, 128, 64), "64KiB": (8, 2, 64, 16)}
_NOTES = {
    "get cold": "; every page of kvtiers' LMDB file dropped, its index too",
    "get cold, index warm": "; kvtiers' LMDB index read back before (values cold)",
}
GOALS = {
    ("8MiB", "set+sync"): 3.0,
    ("8MiB", "get cold"): 2.0,
    ("8MiB", "get warm"): 1.5,
    ("64KiB", "get cold"): 4.0,
    ("64KiB", "get warm"): 1.5,
}


def _host_pool(shape: tuple[int, int, int, int], pages: int) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    layers, heads, dim, page = shape
    dev = MHATokenToKVPool(
        pages * page, page, torch.bfloat16, heads, dim, layers, "cpu", False,
        start_layer=0, end_layer=layers - 1,
    )  # fmt: skip
    host = MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, "layer_first",
        pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=0,
        end_layer=layers - 1, write_back_staging=dev.hicache_write_back_staging,
    )  # fmt: skip
    del dev
    gen = torch.Generator().manual_seed(0)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(host.dtype))
    return host


def _config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="bench/model", extra_config=extra,
    )  # fmt: skip


def _unmap(root: Path) -> None:
    """Unmap this process's pages of the files under `root` (they stay in the page cache).

    The kernel drops no page a process has mapped, and kvtiers reads LMDB through a map:
    without this, pages read in an earlier round (and reused for this round's values)
    would stay resident, and the "cold" read would be partly warm. Memory pressure does
    the same to a running server: it unmaps, then evicts.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    prefix = str(root.resolve()) + os.sep
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().startswith(prefix):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                libc.madvise(lo, hi - lo, _MADV_DONTNEED)


def _drop_cache(root: Path) -> None:
    os.sync()
    _unmap(root)
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


_WARM_INDEX = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=16, readahead=False)
with env.begin() as txn:
    names = [bytes(name) for name, _ in txn.cursor()]
    for name in names:
        for _ in txn.cursor(env.open_db(name, txn=txn, create=False)).iternext(values=False):
            pass
"""
"""Read every tree page of the LMDB environment at argv[1], no value: keys only, and
`readahead=False` (LMDB's `MADV_RANDOM`), so a fault reads its own page and no neighbours."""


def _warm_index(path: Path) -> None:
    """Bring the LMDB index at `path` back into the page cache, from a process of its own.

    (LMDB forbids opening one environment twice in a process.)
    """
    subprocess.run([sys.executable, "-c", _WARM_INDEX, str(path)], check=True)


class _Side:
    """One backend with its set/get calls in HiCache's form."""

    def __init__(self, name: str, root: Path, host: Any, chunk_bytes: int) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        self.name, self.root, self.host = name, root, host
        if name.startswith("kvtiers"):
            tier = {
                "kind": "lmdb",
                "path": str(root / "lmdb"),
                "capacity": 4 * BATCH * (chunk_bytes + 4096),
                "read_threads": 4,
            }
            if name == WRITEMAP:
                tier["writemap"] = True
            tiers = {"tiers": [tier]}
            extra = {
                "backend_name": "kvtiers",
                "module_path": "kvtiers.integrations.sglang",
                "class_name": "KVTiersStorage",
                "interface_v1": 1,
                "config": tiers,
            }
            self.backend = StorageBackendFactory.create_backend("dynamic", _config(extra), host)
            self.backend.register_mem_pool_host(host)
            self.set = lambda keys, idx: self.backend.batch_set_v1(keys, idx)
            self.get = lambda keys, idx: self.backend.batch_get_v1(keys, idx)
        else:
            extra = {"file_storage_path": str(root / "files")}
            self.backend = StorageBackendFactory.create_backend("file", _config(extra), host)
            self.backend.register_mem_pool_host(host)
            self.backend.register_mem_host_pool_v2(host, PoolName.KV)

            def io(op: Callable[..., Any], keys: list[str], idx: Any) -> list[bool]:
                res = op([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys)])
                return list(res[PoolName.KV])

            self.set = lambda keys, idx: io(self.backend.batch_set_v2, keys, idx)
            self.get = lambda keys, idx: io(self.backend.batch_get_v2, keys, idx)

    def round(self, tag: str, src: Any, dst: Any) -> dict[str, float]:
        keys = [f"{tag}-{i:060x}" for i in range(BATCH)]
        others = [f"{tag}-b-{i:058x}" for i in range(BATCH)]  # read cold once, index warm
        t0 = time.perf_counter()
        ok = self.set(keys, src)
        os.sync()
        t1 = time.perf_counter()
        ok += self.set(others, src)
        _drop_cache(self.root)
        left = resident_fraction([p for p in self.root.rglob("*") if p.is_file()])
        t2 = time.perf_counter()
        found = self.backend.batch_exists(keys)  # HiCache's prefetch asks before it gets
        t3 = time.perf_counter()
        cold = self.get(keys, dst)
        t4 = time.perf_counter()
        warm = self.get(keys, dst)
        t5 = time.perf_counter()
        _drop_cache(self.root)
        if self.name.startswith("kvtiers"):
            _warm_index(self.root / "lmdb")
        t6 = time.perf_counter()
        found += self.backend.batch_exists(others)
        cold += self.get(others, dst)
        t7 = time.perf_counter()
        if not (found == 2 * BATCH and all(ok) and all(cold) and all(warm)):
            raise RuntimeError(f"{self.name}: a page failed in round {tag}")
        return {
            "set+sync": t1 - t0,
            "exists cold": t3 - t2,
            "get cold": t4 - t2,  # the prefetch: exists, then get
            "get warm": t5 - t4,
            "get cold, index warm": t7 - t6,
            "left": left,
        }

    def close(self) -> None:
        self.backend.clear()
        if self.name.startswith("kvtiers"):
            self.backend.close()


def _raw_round(root: Path, data: Any) -> dict[str, float]:
    """Write `data` to one flat file and sync, then read it back cold."""
    path = root / "raw.bin"
    view = memoryview(data.numpy())
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(view)
    os.sync()
    t1 = time.perf_counter()
    _drop_cache(root)
    t2 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        f.readinto(view)
    t3 = time.perf_counter()
    path.unlink()
    return {"set+sync": t1 - t0, "get cold": t3 - t2}


def _measure(label: str, shape: tuple[int, int, int, int], repeats: int) -> list[Result]:
    import torch

    layers, heads, dim, page = shape
    chunk_bytes = layers * 2 * heads * dim * 2 * page
    host = _host_pool(shape, BATCH)
    src = torch.arange(0, BATCH * page, dtype=torch.int64)
    dst = torch.arange(BATCH * page, 2 * BATCH * page, dtype=torch.int64)
    root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-sglang-", dir=os.getcwd()))
    times: dict[str, dict[str, list[float]]] = {}
    try:
        sides = [_Side(n, root / n, host, chunk_bytes) for n in ("kvtiers", WRITEMAP, "file")]
        for rep in range(repeats):
            for side in sides if rep % 2 == 0 else reversed(sides):
                for op, sec in side.round(f"{label}-{rep}", src, dst).items():
                    times.setdefault(side.name, {}).setdefault(op, []).append(sec)
            raw = host.kv_buffer.view(-1).view(torch.uint8)[: BATCH * chunk_bytes]
            for op, sec in _raw_round(root, raw.clone()).items():
                times.setdefault("raw", {}).setdefault(op, []).append(sec)
        for side in sides:
            side.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = BATCH * chunk_bytes / 1e6
    results = []
    results.append(
        Result.of_times(
            f"exists cold, {label} pages, batch {BATCH}",
            statistics.median(times["kvtiers"]["exists cold"]),
            statistics.median(times["file"]["exists cold"]),
            notes="vs HiCacheFile; the first part of a cold get (below)",
        )
    )
    for op in ("set+sync", "get cold", "get cold, index warm", "get warm"):
        ours = mb / statistics.median(times["kvtiers"][op])
        base = mb / statistics.median(times["file"][op])
        goal = GOALS.get((label, op.split(",")[0]))
        results.append(
            Result.of_rates(
                f"{op}, {label} pages, batch {BATCH}",
                ours,
                base,
                unit="MB/s",
                target=Target("ratio", ">=", goal) if goal else None,
                notes="vs HiCacheFile"
                + _NOTES.get(op, "")
                + (_left(times) if op == "get cold" else ""),
            )
        )
        results.append(
            Result.of_rates(
                f"{op}, {label} pages, batch {BATCH}, lmdb writemap = true",
                mb / statistics.median(times[WRITEMAP][op]),
                base,
                unit="MB/s",
                notes="vs HiCacheFile; the lmdb tier writing straight into its map",
            )
        )
        if op in times["raw"]:
            raw_rate = mb / statistics.median(times["raw"][op])
            results.append(
                Result.of_rates(
                    f"{op}, {label} pages: kvtiers vs one flat file",
                    ours,
                    raw_rate,
                    unit="MB/s",
                    notes="the disk's ceiling (raw write+sync; cold read, one thread)",
                )
            )
    return results


def _left(times: dict[str, dict[str, list[float]]]) -> str:
    """Say how much of each backend's files the page cache still held when a cold get began."""
    worst = {name: max(times[name]["left"]) for name in ("kvtiers", WRITEMAP, "file")}
    return "; resident before the cold get at most " + ", ".join(
        f"{name} {share:.1%}" for name, share in worst.items()
    )


def run(quick: bool) -> list[Result]:
    """Measure both page sizes (the 64 KiB one only with `quick`)."""
    repeats = 1 if quick else REPEATS
    results = []
    for label, shape in SHAPES.items():
        if quick and label == "8MiB":
            continue
        results += _measure(label, shape, repeats)
    return results


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
