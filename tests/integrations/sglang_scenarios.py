"""SGLang storage-layer scenarios, run with the SGLang virtualenv's python.

Each scenario builds SGLang's real KV pools on the CPU (`MHATokenToKVPool` or
`MLATokenToKVPool` and their host pools), creates the kvtiers backend through SGLang's own
`StorageBackendFactory.create_backend("dynamic", ...)` and registers the host pool the way
HiCache's cache controller does. It prints one JSON object: what it checked and found.

    python sglang_scenarios.py roundtrip WORKDIR KIND LAYOUT [KIND LAYOUT ...]
    python sglang_scenarios.py store|load WORKDIR KIND LAYOUT local|remote
    python sglang_scenarios.py faults WORKDIR
    python sglang_scenarios.py hybrid WORKDIR
"""

from __future__ import annotations

import json
import logging
import sys
import urllib.request
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

PAGE = 16
LAYERS = 4
TOKENS = 1024
NUM_PAGES = 12


def make_host(kind: str, layout: str) -> Any:
    """Return a real SGLang host pool (on the CPU) of `kind` ("mha"/"mla") and `layout`."""
    if kind == "mha":
        dev = MHATokenToKVPool(
            TOKENS,
            PAGE,
            torch.bfloat16,
            2,
            64,
            LAYERS,
            "cpu",
            False,
            start_layer=0,
            end_layer=LAYERS - 1,
        )
        return MHATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
            pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
            start_layer=0, end_layer=LAYERS - 1,
            write_back_staging=dev.hicache_write_back_staging,
        )  # fmt: skip
    dev = MLATokenToKVPool(
        TOKENS,
        PAGE,
        torch.bfloat16,
        32,
        16,
        LAYERS,
        "cpu",
        False,
        start_layer=0,
        end_layer=LAYERS - 1,
    )
    return MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
        pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
        start_layer=0, end_layer=LAYERS - 1, target_layer_num=LAYERS,
    )  # fmt: skip


def make_backend(
    host: Any, tiers: dict[str, Any], *, kind: str, v1: bool = True, **parallel: int
) -> Any:
    """Create the kvtiers backend the way SGLang's cache controller does.

    `parallel` overrides the storage config's ranks and sizes (TP rank 0 of 1 otherwise).
    """
    ranks = {"tp_rank": 0, "tp_size": 1, **parallel}
    config = HiCacheStorageConfig(
        **ranks, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=kind == "mla", enable_storage_metrics=True,
        is_page_first_layout=host.layout != "layer_first", model_name="tiny/model",
        extra_config={
            "backend_name": "kvtiers",
            "module_path": "kvtiers.integrations.sglang",
            "class_name": "KVTiersStorage",
            "interface_v1": int(v1),
            "config": tiers,
        },
    )  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


def scraped(url: str, family: str) -> dict[str, float]:
    """Return one family's samples on the metrics endpoint at `url`, by model label."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    found = [f for f in text_string_to_metric_families(text) if f.name == family]
    return {s.labels["model"]: s.value for f in found for s in f.samples}


def lmdb_tiers(workdir: Path, *, remote: bool = False) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {"kind": "lmdb", "path": str(workdir / "lmdb"), "capacity": "256MiB"}
    ]
    if remote:
        tiers = [
            {"kind": "dram", "capacity": "8MiB"},
            {"kind": "remote", "url": f"file://{workdir / 'pool'}", "capacity": "256MiB"},
        ]
    return {"tiers": tiers}


def slots(host: Any, first_page: int, count: int) -> torch.Tensor:
    """Return the host token indices of `count` pages from page `first_page`."""
    start = first_page * PAGE
    return torch.arange(start, start + count * PAGE, dtype=torch.int64)


def page_bytes(host: Any, indices: torch.Tensor, count: int) -> list[bytes]:
    return [
        host.get_data_page(int(indices[i * PAGE]), flat=True).view(torch.uint8).numpy().tobytes()
        for i in range(count)
    ]


def fill_random(host: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(host.dtype))


def keys_for(n: int, tag: str = "p") -> list[str]:
    return [f"{tag}{i:063x}" for i in range(n)]


def _rows(buf: torch.Tensor, kind: str, layout: str, at: tuple[int, int, int, int]) -> Any:
    """One layer's (and plane's) page rows, by hand, for each host layout."""
    kv, layer, start, page = at
    end = start + PAGE
    if kind == "mla":
        if layout == "layer_first":
            return buf[layer, start:end, 0]
        if layout == "page_first":
            return buf[start:end, layer, 0]
        return buf[page, layer, :, 0]  # page_first_direct
    if layout == "layer_first":
        return buf[kv, layer, start:end]
    if layout == "page_first":
        return buf[kv, start:end, layer]
    if layout == "page_first_direct":
        return buf[kv, page, layer]
    return buf[kv, page, :, :, layer].transpose(0, 1)  # page_head: (H, P, D)


def expected_payload(host: Any, kind: str, layout: str, start: int) -> torch.Tensor:
    """Return the page at token `start` in kvtiers' payload order, indexed by hand."""
    buf, page = host.kv_buffer, start // PAGE
    planes = 1 if kind == "mla" else 2
    return torch.stack(
        [
            torch.stack([_rows(buf, kind, layout, (p, layer, start, page)) for p in range(planes)])
            for layer in range(LAYERS)
        ]
    )


def roundtrip(workdir: Path, kind: str, layout: str) -> dict[str, Any]:
    """Pages set from some host slots come back byte-exact into others, by every path."""
    out: dict[str, Any] = {}
    host = make_host(kind, layout)
    fill_random(host, 1)
    backend = make_backend(host, lmdb_tiers(workdir), kind=kind)
    n = 4
    src, dst = slots(host, 1, n), slots(host, 30, n)
    want = page_bytes(host, src, n)
    keys = keys_for(n)
    out["set_v1"] = backend.batch_set_v1(keys, src)
    out["get_v1"] = backend.batch_get_v1(keys, dst)
    out["v1_exact"] = page_bytes(host, dst, n) == want
    # what the tiers hold is kvtiers' payload order, whatever the host layout
    cache = backend.cache
    chunk = torch.empty(cache.layout.chunk_shape(), dtype=host.dtype)
    key = cache.chunk_keys(keys[:1])
    backend._entry.loop.run(cache.get_chunks(key, [chunk]))
    out["payload_order"] = torch.equal(chunk, expected_payload(host, kind, layout, int(src[0])))
    # the v2 path, through PoolTransfer on the registered KV pool
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    keys2 = keys_for(n, "q")
    src2, dst2 = slots(host, 5, n), slots(host, 40, n)
    want2 = page_bytes(host, src2, n)
    setr = backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=src2, keys=keys2)])
    getr = backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=dst2, keys=keys2)])
    out["set_v2"], out["get_v2"] = setr[PoolName.KV], getr[PoolName.KV]
    out["v2_exact"] = page_bytes(host, dst2, n) == want2
    # the generic path: flat pages copied in and out
    keys3 = keys_for(n, "r")
    flat = [host.get_data_page(int(src[i * PAGE]), flat=True) for i in range(n)]
    out["set_generic"] = backend.batch_set(keys3, flat)
    targets = [host.get_dummy_flat_data_page() for _ in range(n)]
    got = backend.batch_get(keys3, targets)
    out["get_generic"] = [g is not None for g in got]
    out["generic_exact"] = all(
        torch.equal(t.reshape(-1).view(torch.uint8), f.view(torch.uint8))
        for t, f in zip(targets, flat, strict=True)
    )
    # prefix semantics: a missing middle page stops the count
    out["exists_all"] = backend.batch_exists(keys)
    out["exists_gap"] = backend.batch_exists([keys[0], keys[1], "missing" * 9, keys[2]])
    out["exists_v2"] = backend.batch_exists_v2(keys).kv_hit_pages
    out["exists_one"] = backend.exists(keys[3])
    # a miss leaves its slot untouched and reports False
    before = page_bytes(host, slots(host, 50, 1), 1)
    out["get_missing"] = backend.batch_get_v1(["nothing" * 9], slots(host, 50, 1))
    out["missing_untouched"] = page_bytes(host, slots(host, 50, 1), 1) == before
    stats = backend.get_stats()
    out["metrics_pages"] = [sum(stats.prefetch_pgs), sum(stats.backup_pgs)]
    cache_stats = backend.kvtiers_stats()
    out["failures"] = dict(backend.failures)
    out["hit_tokens"] = cache_stats.hit_tokens
    backend.close()
    return out


def store(workdir: Path, kind: str, layout: str, remote: bool) -> dict[str, Any]:
    """Store pages with prefix_keys extra info, as HiCache's backup thread does."""
    host = make_host(kind, layout)
    fill_random(host, 7)
    backend = make_backend(host, lmdb_tiers(workdir, remote=remote), kind=kind)
    keys = keys_for(NUM_PAGES)
    half = NUM_PAGES // 2
    first = backend.batch_set_v1(keys[:half], slots(host, 0, half))
    rest = backend.batch_set_v1(
        keys[half:], slots(host, half, half), HiCacheStorageExtraInfo(prefix_keys=keys[:half])
    )
    want = page_bytes(host, slots(host, 0, NUM_PAGES), NUM_PAGES)
    (workdir / f"want-{kind}-{layout}.json").write_text(json.dumps([w.hex() for w in want]))
    backend.close()
    return {"set": first + rest}


def load(workdir: Path, kind: str, layout: str, remote: bool) -> dict[str, Any]:
    """A fresh process (a restarted or other server) finds and loads the stored pages."""
    host = make_host(kind, layout)
    backend = make_backend(host, lmdb_tiers(workdir, remote=remote), kind=kind)
    keys = keys_for(NUM_PAGES)
    hit = backend.batch_exists(keys)
    dst = slots(host, 20, NUM_PAGES)
    got = backend.batch_get_v1(keys[:hit], dst)
    stored = json.loads((workdir / f"want-{kind}-{layout}.json").read_text())
    want = [bytes.fromhex(w) for w in stored]
    exact = page_bytes(host, dst, NUM_PAGES) == want
    backend.close()
    return {"exists": hit, "get": got, "exact": exact}


def faults(workdir: Path) -> dict[str, Any]:
    """Failures are misses or False, never exceptions."""
    out: dict[str, Any] = {}
    host = make_host("mha", "layer_first")
    fill_random(host, 3)
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="tiny/model",
        extra_config={"backend_name": "kvtiers", "module_path": "kvtiers.integrations.sglang",
                      "class_name": "KVTiersStorage", "config": lmdb_tiers(workdir, remote=True)},
    )  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    # before the host pool is registered: misses, not exceptions
    out["unregistered"] = [
        backend.batch_exists(keys_for(2)),
        backend.batch_get_v1(keys_for(2), slots(host, 0, 2)),
        backend.batch_set_v1(keys_for(2), slots(host, 0, 2)),
        backend.batch_get(keys_for(1), [host.get_dummy_flat_data_page()]),
    ]
    backend.register_mem_pool_host(host)
    keys = keys_for(4)
    out["set"] = backend.batch_set_v1(keys, slots(host, 0, 4))
    # too few host indices, a wrong target size: False, nothing raised
    out["short_indices"] = backend.batch_get_v1(keys, slots(host, 0, 2))
    out["bad_target"] = backend.batch_get(keys[:1], [torch.zeros(3)])
    out["set_not_tensors"] = backend.batch_set(keys[:2], [None, "page"])
    backend.close()  # write-through copies reach the remote pool
    # garbage written over every stored object in the remote pool: misses, never served
    pool = workdir / "pool"
    objects = sorted(p for p in pool.rglob("*") if p.is_file() and len(p.name) == 32)
    for obj in objects:
        raw = bytearray(obj.read_bytes())
        raw[-10:] = b"\xff" * 10
        obj.write_bytes(bytes(raw))
    # a fresh backend (empty DRAM) must go to the remote tier and find garbage
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    out["objects_corrupted"] = len(objects)
    out["get_corrupt"] = backend.batch_get_v1(keys, slots(host, 30, 4))
    out["exists_after"] = backend.batch_exists(keys)
    # corrupt objects are deleted when found; the rest of the store is taken away too
    out["corrupt_left"] = sum(obj.exists() for obj in objects)
    for obj in objects:
        obj.unlink(missing_ok=True)
    out["get_gone"] = backend.batch_get_v1(keys_for(4, "z"), slots(host, 30, 4))
    out["failures"] = dict(backend.failures)
    backend.close()
    backend.close()  # idempotent
    return out


def make_mamba_host(slots_: int = 8) -> Any:
    """Return a real SGLang Mamba state host pool on the CPU (fp32 SSM, bf16 conv states)."""
    temporal = torch.zeros(LAYERS, slots_, 4, 8, 8, dtype=torch.float32)
    conv = (torch.zeros(LAYERS, slots_, 16, 3, dtype=torch.bfloat16),)
    host = MambaPoolHost(
        MambaStateBufferInfo(temporal=temporal, conv=conv), 2.0, 0,
        device_capacity=slots_, pin_memory=False, device="cpu", layout="page_first",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    host.temporal_buffer.copy_(torch.randn(host.temporal_buffer.shape, generator=gen))
    for buf in host.conv_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    return host


def state_bytes(host: Any, slot: int) -> bytes:
    return bytes(host.get_data_page(slot, flat=True).numpy().tobytes())


def trailing(name: PoolName, keys: list[str], indices: Any = None, **kw: Any) -> PoolTransfer:
    policy = kw.pop("hit_policy", PoolHitPolicy.TRAILING_PAGES)
    return PoolTransfer(name=name, keys=keys, host_indices=indices, hit_policy=policy, **kw)


def hybrid(workdir: Path) -> dict[str, Any]:
    """A hybrid model's Mamba states and SWA window pages beside its KV pages."""
    out: dict[str, Any] = {}
    mb, sw = PoolName.MAMBA, PoolName.SWA
    kv, swa = make_host("mha", "page_first"), make_host("mha", "layer_first")
    mamba = make_mamba_host()
    fill_random(kv, 5)
    fill_random(swa, 6)
    tiers = {**lmdb_tiers(workdir), "metrics": {"port": 0}}
    backend = make_backend(kv, tiers, kind="mha")
    for name, pool in ((PoolName.KV, kv), (mb, mamba), (sw, swa)):
        backend.register_mem_host_pool_v2(pool, name)
    keys = keys_for(8, "h")
    one = lambda i: torch.tensor([i], dtype=torch.int64)  # noqa: E731
    # the backup thread: KV pages by v1, the states at pages 4 and 8 and the window by v2
    out["set_kv"] = backend.batch_set_v1(keys, slots(kv, 0, 8))
    out["set_extra"] = [
        backend.batch_set_v2([trailing(mb, [keys[3]], one(1))]),
        backend.batch_set_v2(
            [trailing(mb, [keys[7]], one(2)), trailing(sw, keys[6:], slots(swa, 3, 2))]
        ),
    ]
    out["lmdb_dirs"] = sorted(p.name for p in workdir.iterdir() if p.name.startswith("lmdb"))
    out["page_kinds"] = {n: type(e[1]).__name__ for n, e in backend._extras._pools.items()}

    def exists(query: list[str], *transfers: PoolTransfer) -> list[Any]:
        r = backend.batch_exists_v2(query, list(transfers))
        hits = {str(k): v for k, v in r.extra_pool_hit_pages.items()}
        return [r.kv_hit_pages, hits, r.restorable_prefix_pages]

    out["exists_both"] = exists(keys, trailing(mb, [keys[7]]), trailing(sw, keys[6:]))
    out["exists_mamba"] = exists(keys, trailing(mb, [keys[7]]))
    out["exists_cut"] = exists(keys[:6], trailing(mb, [keys[5]]))
    out["exists_all_pages"] = exists(
        keys, trailing(sw, keys[6:], hit_policy=PoolHitPolicy.ALL_PAGES)
    )
    # the prefetch thread: KV pages, then the state and the window into other slots
    got = backend.batch_get_v2(
        [
            PoolTransfer(name=PoolName.KV, keys=keys, host_indices=slots(kv, 20, 8)),
            trailing(mb, [keys[7]], one(5)),
            trailing(sw, keys[6:], slots(swa, 30, 2)),
        ]
    )
    out["get"] = {str(k): v for k, v in got.items()}
    out["kv_exact"] = page_bytes(kv, slots(kv, 20, 8), 8) == page_bytes(kv, slots(kv, 0, 8), 8)
    out["mamba_exact"] = state_bytes(mamba, 5) == state_bytes(mamba, 2)
    out["swa_exact"] = page_bytes(swa, slots(swa, 30, 2), 2) == page_bytes(swa, slots(swa, 3, 2), 2)
    before = state_bytes(mamba, 6)
    out["get_missing"] = backend.batch_get_v2([trailing(mb, [keys[5]], one(6))])
    out["missing_untouched"] = state_bytes(mamba, 6) == before
    out["unregistered"] = backend.batch_get_v2([trailing(PoolName.INDEXER, [keys[0]], one(0))])
    out["short_indices"] = backend.batch_set_v2([trailing(sw, keys[6:], slots(swa, 3, 1))])
    out["failures"] = dict(backend.failures)
    out["pool_loaded"] = {n: st.loaded_tokens for n, st in backend.pool_stats().items()}
    out["scraped_loaded"] = scraped(backend._entry.cache.metrics_url, "kvtiers_loaded_tokens")
    backend.close()
    # a restarted server finds the states in the shared LMDB tiers (its index is empty)
    other = make_backend(kv, tiers, kind="mha")
    for name, pool in ((PoolName.KV, kv), (mb, mamba)):
        other.register_mem_host_pool_v2(pool, name)
    r = other.batch_exists_v2(keys, [trailing(mb, [keys[7]])])
    out["restarted"] = [r.kv_hit_pages, r.restorable_prefix_pages]
    out["restarted_get"] = other.batch_get_v2([trailing(mb, [keys[3]], one(7))])
    out["restarted_exact"] = state_bytes(mamba, 7) == state_bytes(mamba, 1)
    out["cleared"] = other.clear()
    r = other.batch_exists_v2(keys, [trailing(mb, [keys[7]])])
    out["after_clear"] = [r.kv_hit_pages, r.restorable_prefix_pages]
    other.close()
    return out


def dcp(workdir: Path) -> dict[str, Any]:
    """Decode context parallelism on an MLA model: each DCP rank stores its own slice of
    every page under the same page hashes; each reads back its own, never the other's."""
    tiers = lmdb_tiers(workdir, remote=True)  # one shared `file://` pool for every rank
    keys = keys_for(4)
    shard = {"tp_size": 2, "dcp_size": 2, "logical_page_size": 2 * PAGE}
    hosts, backends, want = [], [], []
    for rank in (0, 1):
        host = make_host("mla", "layer_first")
        fill_random(host, 11 + rank)  # each rank's slice of the pages differs
        backend = make_backend(host, tiers, kind="mla", tp_rank=rank, dcp_rank=rank, **shard)
        backend.batch_set_v1(keys, slots(host, 1, 4))
        hosts.append(host)
        backends.append(backend)
        want.append(page_bytes(host, slots(host, 1, 4), 4))
    out: dict[str, Any] = {"different_slices": want[0] != want[1]}
    for rank, (host, backend) in enumerate(zip(hosts, backends, strict=True)):
        out[f"exists_{rank}"] = backend.batch_exists(keys)
        out[f"get_{rank}"] = backend.batch_get_v1(keys, slots(host, 30, 4))
        out[f"own_{rank}"] = page_bytes(host, slots(host, 30, 4), 4) == want[rank]
    # The same shard in another DCP group (TP 4, rank 2 holds DCP shard 0) reads rank 0's.
    host = make_host("mla", "layer_first")
    other = make_backend(host, tiers, kind="mla", tp_rank=2, dcp_rank=0, **{**shard, "tp_size": 4})
    out["other_group_get"] = other.batch_get_v1(keys, slots(host, 30, 4))
    out["other_group_is_shard_0"] = page_bytes(host, slots(host, 30, 4), 4) == want[0]
    for backend in (*backends, other):
        backend.close()
    return out


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    name, workdir = sys.argv[1], Path(sys.argv[2])
    args = sys.argv[3:]
    if name == "roundtrip":
        # pairs of KIND LAYOUT, one process for all (SGLang takes seconds to import)
        result = {}
        for kind, layout in zip(args[::2], args[1::2], strict=True):
            sub = workdir / f"{kind}-{layout}"
            sub.mkdir(parents=True, exist_ok=True)
            result[f"{kind}-{layout}"] = roundtrip(sub, kind, layout)
    elif name in ("store", "load"):
        fn = store if name == "store" else load
        result = fn(workdir, args[0], args[1], args[2] == "remote")
    elif name == "faults":
        result = faults(workdir)
    elif name == "hybrid":
        result = hybrid(workdir)
    elif name == "dcp":
        result = dcp(workdir)
    else:
        raise SystemExit(f"unknown scenario {name!r}")
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
