"""Extra HiCache pools of hybrid models: the parts that need no SGLang.

The hit fold, the per-pool config and the backend's options are checked here with plain
stand-ins; the real `MambaPoolHost` and SWA pools run in `test_sglang.py`, in SGLang's own
virtualenv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtiers import ConfigError
from kvtiers.core.layout import KVLayout
from kvtiers.integrations._sglang_args import BadArgumentError
from kvtiers.integrations._sglang_options import BackendOptions, default_config
from kvtiers.integrations._sglang_pools import (
    ExtraPools,
    PoolPages,
    fold_hits,
    pool_config,
    pool_layout,
)


@dataclass
class Transfer:
    name: str
    hit_policy: str
    keys: list[str] = field(default_factory=list)


def fold(kv_pages: int, held: dict[str, set[int]], *transfers: Transfer) -> Any:
    """Fold with pool `name` holding the 1-based pages in `held[name]`."""
    return fold_hits(
        kv_pages,
        transfers,
        lambda name: [i + 1 in held.get(name, set()) for i in range(kv_pages)],
    )


def test_no_extra_pool_leaves_the_kv_hit():
    assert fold(5, {}) == (5, {"kv": 5}, [1, 2, 3, 4, 5])
    assert fold(0, {}) == (0, {}, [])


def test_trailing_pages_restore_only_where_the_window_is_held():
    mamba = Transfer("mamba", "trailing_pages", ["k"])
    assert fold(8, {"mamba": {4, 8}}, mamba) == (8, {"kv": 8, "mamba": 8}, [4, 8])
    assert fold(6, {"mamba": {4, 8}}, mamba) == (4, {"kv": 6, "mamba": 4}, [4])
    swa = Transfer("swa", "trailing_pages", ["a", "b"])  # a window of two pages
    assert fold(8, {"swa": {4, 7, 8}}, swa) == (8, {"kv": 8, "swa": 8}, [8])
    both = fold(8, {"mamba": {4, 8}, "swa": {3, 4, 8}}, mamba, swa)
    assert both == (4, {"kv": 8, "mamba": 8, "swa": 4}, [4])


def test_all_pages_cut_at_the_first_gap_and_unknown_policies_give_no_verdict():
    dsa = Transfer("indexer", "all_pages")
    assert fold(5, {"indexer": {1, 2, 4, 5}}, dsa) == (2, {"kv": 5, "indexer": 2}, [1, 2])
    assert fold(5, {}, dsa) == (0, {"kv": 5}, [])
    groups = Transfer("deepseek_v4_c4", "block_groups")
    assert fold(5, {}, groups) == (5, {"kv": 5}, [1, 2, 3, 4, 5])


def test_nothing_restorable_stops_the_fold():
    calls: list[str] = []

    def present(name: str) -> list[bool]:
        calls.append(name)
        return [False] * 3

    out = fold_hits(3, [Transfer("a", "all_pages"), Transfer("b", "all_pages")], present)
    assert out == (0, {"kv": 3}, []) and calls == ["a"]


class StandInStatePool:
    """The flat-page calls of SGLang's MambaPoolHost (one state per slot)."""

    page_size = 1

    def __init__(self, slots: int = 4, nbytes: int = 24) -> None:
        self.data = torch.arange(slots * nbytes, dtype=torch.int64).to(torch.uint8)
        self.data = self.data.reshape(slots, nbytes).clone()

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.data[index].clone()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.data.shape[1], dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
        self.data[index].copy_(page)


def storage(tp_rank: int = 1, tp_size: int = 2) -> Any:
    return SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size)


@pytest.mark.parametrize(
    ("kind", "name", "rank"),
    [("mha", "swa", (1, 2)), ("mla", "mamba", (1, 2)), ("mla", "indexer", (0, 1))],
)
def test_pool_layout_keys_opaque_pages_per_rank_where_sglang_shards(kind, name, rank):
    heads = 2 if kind == "mha" else 1
    kv = KVLayout("m", 4, heads, 8, "bfloat16", 16, kind=kind, tp_rank=0, tp_size=1)
    layout = pool_layout(StandInStatePool(), name, kv, storage())
    assert layout.model == f"m#{name}" and layout.dtype == "uint8"
    assert layout.chunk_bytes == 24 and layout.chunk_size == 1
    assert (layout.tp_rank, layout.tp_size) == rank
    assert layout.fingerprint != kv.fingerprint


def test_pool_layout_refuses_pools_without_whole_token_pages():
    class Odd(StandInStatePool):
        page_size = 5

    kv = KVLayout("m", 4, 2, 8)
    with pytest.raises(ConfigError, match="whole tokens"):
        pool_layout(Odd(), "swa", kv, storage())
    with pytest.raises(ConfigError, match="no flat pages"):
        pool_layout(object(), "swa", kv, storage())


def test_pool_pages_copy_out_and_back():
    pool = StandInStatePool()
    pages = PoolPages(pool, KVLayout("m#mamba", 1, 1, 24, "uint8", 1, kind="mla"))
    assert pages.starts(["a", "b"], torch.tensor([3, 1]), write=False) == [3, 1]
    with pytest.raises(BadArgumentError, match="host_indices: expected 2 pages of 1"):
        pages.starts(["a", "b"], torch.tensor([3]), write=False)
    with pytest.raises(BadArgumentError, match="host_indices: expected a tensor"):
        pages.starts(["a"], None, write=False)
    want = [bytes(page) for page in pages.sources([3, 1])]
    targets = pages.targets([0, 2, 1])
    for target, raw in zip(targets, want, strict=False):
        target[:] = bytearray(raw)  # as a tier fills a chunk
    before = bytes(pool.data[1].numpy())
    pages.finish([0, 2, 1], targets, [True, True, False])
    assert bytes(pool.data[0].numpy()) == want[0] and bytes(pool.data[2].numpy()) == want[1]
    assert bytes(pool.data[1].numpy()) == before  # a miss leaves its slot alone
    # staging pages are kept for the next read, up to a few
    again = pages.targets([0, 1, 2, 3])
    assert len(again) == 4 and all(a is t for a, t in zip(again, targets, strict=False))
    assert not any(again[3] is t for t in targets)
    pages.finish([0] * 20, pages.targets([0] * 20), [False] * 20)
    assert len(pages._spare) == PoolPages._SPARE


def test_pool_config_suffixes_lmdb_paths_and_drops_the_endpoints(tmp_path):
    source = {
        "tiers": [
            {"kind": "dram", "capacity": "8MiB"},
            {"kind": "lmdb", "path": f"{tmp_path}/kv/", "capacity": "64MiB"},
        ],
        "events": 16,
        "metrics": {"port": 9400},
    }
    config = pool_config(source, None, "mamba")
    assert config.tiers[1].options["path"] == f"{tmp_path}/kv-mamba"
    assert config.tiers[0].capacity_bytes == 8 << 20
    assert config.metrics is None and config.events == 0
    own = {"tiers": [{"kind": "dram", "capacity": "1MiB"}]}
    assert pool_config(source, own, "mamba").tiers[0].capacity_bytes == 1 << 20
    # a pool's own config may not reuse the KV cache's LMDB environment
    same = {"tiers": [{"kind": "lmdb", "path": f"{tmp_path}/kv", "capacity": "8MiB"}]}
    with pytest.raises(ConfigError, match="pools.mamba: lmdb path .* is the KV cache's"):
        pool_config(source, same, "mamba")


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"colour": 1}, "colour: unknown key"),
        ({"config": 3}, "config: expected"),
        ({"timeout": "soon"}, "timeout: expected seconds"),
        ({"timeout": "5"}, "timeout: expected seconds"),
        ({"timeout": True}, "timeout: expected seconds"),
        ({"timeout": 0}, "timeout: must be positive"),
        ({"timeout": float("inf")}, "timeout: must be positive and finite"),
        ({"config": ""}, "config: expected a file path or a non-empty table"),
        ({"config": {}}, "config: expected a file path or a non-empty table"),
        ({"salt": 3}, "salt: expected a string, got int"),
        ({"model_name": ["m"]}, "model_name: expected a string"),
        ({"pools": ["mamba"]}, "pools: expected"),
        ({"pools": []}, "pools: expected"),  # empty, still not a table
        ({"pools": ""}, "pools: expected"),
        ({"pools": {"mamba": 3}}, "pools: expected"),
    ],
)
def test_backend_options_refuse_bad_values(raw, match):
    with pytest.raises(ConfigError, match=match):
        BackendOptions.from_extra_config(raw)


def test_backend_options_defaults_and_pass_through():
    options = BackendOptions.from_extra_config({"backend_name": "kvtiers", "interface_v1": 1})
    assert options.source == default_config() and options.timeout == 60.0
    assert dict(options.pools) == {}
    options = BackendOptions.from_extra_config(
        {"config": "/etc/kvtiers.toml", "salt": "s", "pools": {"mamba": "/etc/m.toml"}}
    )
    assert options.source == "/etc/kvtiers.toml" and options.salt == "s"
    assert dict(options.pools) == {"mamba": "/etc/m.toml"}


def test_extra_pools_store_find_and_load_pages_without_sglang(tmp_path):
    kv_config = {"tiers": [{"kind": "lmdb", "path": f"{tmp_path}/kv", "capacity": "8MiB"}]}
    options = BackendOptions.from_extra_config({"config": kv_config})
    failures: list[str] = []
    pools = ExtraPools(
        options,
        lambda op, make, default, entry: entry.loop.run(make(entry.cache)),
        lambda op, why: failures.append(op),
        lambda *args: None,
    )
    kv = KVLayout("m", 4, 2, 8, "float16", 16)
    state = StandInStatePool(slots=6)
    try:
        pools.register("mamba", state, kv, storage())
        assert pools.transfer("set", "mamba", ["a", "b"], torch.tensor([0, 1]), True) == [True] * 2
        assert pools.present("mamba", ["a", "x", "b"]) == [True, False, True]
        want = [bytes(state.data[i].numpy()) for i in (0, 1)]
        got = pools.transfer("get", "mamba", ["b", "x", "a"], torch.tensor([3, 4, 5]), False)
        assert got == [True, False, True]
        assert bytes(state.data[3].numpy()) == want[1] and bytes(state.data[5].numpy()) == want[0]
        # not one page per key, or a pool never registered: misses, counted
        assert pools.transfer("get", "mamba", ["a"], torch.tensor([1, 2]), False) == [False]
        assert pools.transfer("get", "swa", ["a"], torch.tensor([1]), False) == [False]
        assert pools.present("swa", ["a"]) == [False]
        assert failures == ["get", "get", "batch_exists_v2"]
        assert (tmp_path / "kv-mamba" / "data.mdb").exists()  # its own LMDB environment
    finally:
        pools.close()
    pools.close()  # idempotent


def test_two_pools_may_not_share_an_lmdb_environment(tmp_path):
    own = {"tiers": [{"kind": "lmdb", "path": f"{tmp_path}/side", "capacity": "8MiB"}]}
    options = BackendOptions.from_extra_config(
        {
            "config": {"tiers": [{"kind": "dram", "capacity": "1MiB"}]},
            "pools": {"mamba": own, "swa": own},
        }
    )
    pools = ExtraPools(options, lambda *a: None, lambda *a: None, lambda *a: None)
    kv = KVLayout("m", 4, 2, 8, "float16", 16)
    try:
        pools.register("mamba", StandInStatePool(), kv, storage())
        with pytest.raises(ConfigError, match="pools.swa: lmdb path .* is pool 'mamba'"):
            pools.register("swa", StandInStatePool(), kv, storage())
        assert len(pools.entries()) == 1
    finally:
        pools.close()
