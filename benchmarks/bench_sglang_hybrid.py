"""SGLang HiCache, hybrid models: Mamba state pages in kvtiers beside SGLang's `HiCacheFile`.

A hybrid model's prefix is restorable only with its recurrent state: HiCache stores one
Mamba state per cached node and, before a prefetch, asks `batch_exists_v2` whether the KV
pages and the state at the end of the prefix are both there. Both backends work on the
same real host pools in one run: a `MambaPoolHost` (fp32 SSM state, bf16 conv state,
`page_first`, on the CPU) beside a small `MHATokenToKVPoolHost`, through the v2 calls
HiCache makes, one request at a time (one state per call, as its backup and prefetch
threads issue them):

- set+sync: each request's state written (`batch_set_v2`), then `os.sync()`.
- get cold: the files dropped from the page cache (as in `bench_sglang_storage`), then per
  request `batch_exists_v2` (4 KV pages and the trailing state) and `batch_get_v2` of the
  state.
- get warm: the same gets again.

Each request's 4 KV pages are stored first, untimed (kvtiers through its v1 path,
HiCacheFile through v2). Medians over `REPEATS` rounds, each with fresh keys.

Runs under SGLang's virtualenv: `.venv-sglang/bin/python -m benchmarks.bench_sglang_hybrid`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import Result, main
from benchmarks.bench_lmdb import resident_fraction
from benchmarks.bench_sglang_storage import _config, _drop_cache, _host_pool

REQUESTS = 64
PAGES = 4  # KV pages per request; the state sits at the last one
REPEATS = 3
# Mamba layers, SSM heads, state dim (a head's state is dim x dim fp32), conv channels
STATE = (16, 8, 64, 1024)
KV_SHAPE = (8, 2, 64, 16)  # 64 KiB KV pages


def _mamba_pool(slots: int) -> Any:
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    layers, heads, dim, channels = STATE
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, heads, dim, dim, dtype=torch.float32),
        conv=(torch.zeros(layers, slots, channels, 3, dtype=torch.bfloat16),),
    )
    host = MambaPoolHost(
        info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first"
    )
    gen = torch.Generator().manual_seed(0)
    host.temporal_buffer.copy_(torch.randn(host.temporal_buffer.shape, generator=gen))
    for buf in host.conv_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    return host


class _Side:
    """One backend, with the KV and the Mamba pools registered as HiCache registers them."""

    def __init__(self, name: str, root: Path, kv: Any, mamba: Any) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        self.name, self.root = name, root
        if name == "kvtiers":
            tier = {"kind": "lmdb", "path": str(root / "lmdb"), "capacity": "1GiB"}
            extra: dict[str, Any] = {
                "backend_name": "kvtiers",
                "module_path": "kvtiers.integrations.sglang",
                "class_name": "KVTiersStorage",
                "interface_v1": 1,
                "config": {"tiers": [tier]},
            }
            self.backend = StorageBackendFactory.create_backend("dynamic", _config(extra), kv)
        else:
            extra = {"file_storage_path": str(root / "files")}
            self.backend = StorageBackendFactory.create_backend("file", _config(extra), kv)
        self.backend.register_mem_pool_host(kv)
        self.backend.register_mem_host_pool_v2(kv, PoolName.KV)
        self.backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)

    def store_kv(self, keys: list[str], idx: Any) -> bool:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        if self.name == "kvtiers":
            return all(self.backend.batch_set_v1(keys, idx))
        res = self.backend.batch_set_v2([PoolTransfer(PoolName.KV, idx, keys=keys)])
        return all(res[PoolName.KV])

    def round(self, tag: str, kv_idx: Any, src: list[Any], dst: list[Any]) -> dict[str, float]:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        def state(key: str, slot: Any) -> list[PoolTransfer]:
            policy = PoolHitPolicy.TRAILING_PAGES
            return [PoolTransfer(PoolName.MAMBA, slot, keys=[key], hit_policy=policy)]

        reqs = [[f"{tag}-{r:04x}-{p:054x}" for p in range(PAGES)] for r in range(REQUESTS)]
        if not all(self.store_kv(keys, kv_idx) for keys in reqs):
            raise RuntimeError(f"{self.name}: a KV page failed in round {tag}")
        t0 = time.perf_counter()
        ok = [self.backend.batch_set_v2(state(k[-1], s)) for k, s in zip(reqs, src, strict=True)]
        os.sync()
        t1 = time.perf_counter()
        _drop_cache(self.root)
        left = resident_fraction([p for p in self.root.rglob("*") if p.is_file()])
        hits, cold, warm = [], [], []
        t2 = time.perf_counter()
        for keys, slot in zip(reqs, dst, strict=True):
            hits.append(self.backend.batch_exists_v2(keys, state(keys[-1], None)).kv_hit_pages)
            cold.append(self.backend.batch_get_v2(state(keys[-1], slot)))
        t3 = time.perf_counter()
        for keys, slot in zip(reqs, dst, strict=True):
            warm.append(self.backend.batch_get_v2(state(keys[-1], slot)))
        t4 = time.perf_counter()
        done = [r[PoolName.MAMBA] == [True] for r in ok + cold + warm]
        if hits != [PAGES] * REQUESTS or not all(done):
            raise RuntimeError(f"{self.name}: a state failed in round {tag}: {hits[:4]}")
        return {"set+sync": t1 - t0, "get cold": t3 - t2, "get warm": t4 - t3, "left": left}

    def close(self) -> None:
        self.backend.clear()
        if self.name == "kvtiers":
            self.backend.close()


def run(quick: bool) -> list[Result]:
    """Measure per-request state writes and cold and warm prefetches, both backends."""
    import torch

    repeats = 1 if quick else REPEATS
    kv, mamba = _host_pool(KV_SHAPE, PAGES), _mamba_pool(2 * REQUESTS)
    kv_idx = torch.arange(0, PAGES * KV_SHAPE[3], dtype=torch.int64)
    src = [torch.tensor([i], dtype=torch.int64) for i in range(REQUESTS)]
    dst = [torch.tensor([REQUESTS + i], dtype=torch.int64) for i in range(REQUESTS)]
    root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-hybrid-", dir=os.getcwd()))
    times: dict[str, dict[str, list[float]]] = {}
    try:
        sides = [_Side(n, root / n, kv, mamba) for n in ("kvtiers", "file")]
        for rep in range(repeats):
            for side in sides if rep % 2 == 0 else reversed(sides):
                for op, sec in side.round(f"r{rep}", kv_idx, src, dst).items():
                    times.setdefault(side.name, {}).setdefault(op, []).append(sec)
        same = torch.equal(mamba.get_data_page(REQUESTS), mamba.get_data_page(0))
        for side in sides:
            side.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not same:
        raise RuntimeError("a state read back differs from the one stored")
    state_bytes = mamba.get_dummy_flat_data_page().numel()
    mb = REQUESTS * state_bytes / 1e6
    left = max(max(t["left"]) for t in times.values())
    label = f"{state_bytes / 2**20:.1f} MiB Mamba states, {REQUESTS} requests, one per call"
    return [
        Result.of_rates(
            f"{op}, {label}",
            mb / statistics.median(times["kvtiers"][op]),
            mb / statistics.median(times["file"][op]),
            unit="MB/s",
            notes="vs HiCacheFile"
            + (f"; exists_v2 included; resident before at most {left:.1%}" if "cold" in op else ""),
        )
        for op in ("set+sync", "get cold", "get warm")
    ]


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
