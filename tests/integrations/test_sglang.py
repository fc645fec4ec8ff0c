"""The SGLang storage backend against SGLang's real host pools (its own virtualenv).

The SGLang server cannot run on a CPU-only machine (it needs a CPU build of sgl-kernel),
but its storage layer can: each scenario builds real `MHATokenToKVPool`/`MLATokenToKVPool`
host pools on the CPU and creates the backend through SGLang's `StorageBackendFactory`,
in a subprocess with SGLang's python (see `sglang_scenarios.py`).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import HERE

pytestmark = pytest.mark.slow

LAYOUTS = [
    ("mha", "layer_first"),
    ("mha", "page_first"),
    ("mha", "page_first_direct"),
    ("mha", "page_head"),
    ("mla", "layer_first"),
    ("mla", "page_first"),
    ("mla", "page_first_direct"),
]


def run(
    python: Path, *args: str, script: str = "sglang_scenarios.py", timeout: float = 300
) -> dict[str, Any]:
    """Run a scenario of `script` with SGLang's python; return the result it printed."""
    proc = subprocess.run(
        [str(python), str(HERE / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,  # a hang guard
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


@pytest.fixture(scope="module")
def roundtrips(sglang_python, tmp_path_factory) -> dict[str, Any]:
    """Every layout's round trip, in one SGLang process."""
    pairs = [part for pair in LAYOUTS for part in pair]
    return run(sglang_python, "roundtrip", str(tmp_path_factory.mktemp("sglang")), *pairs)


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS, ids=[f"{k}-{lay}" for k, lay in LAYOUTS])
def test_pages_round_trip_by_every_path(roundtrips, kind, layout):
    out = roundtrips[f"{kind}-{layout}"]
    assert out["set_v1"] == out["get_v1"] == [True] * 4
    assert out["v1_exact"]
    assert out["payload_order"]  # stored in kvtiers' order, whatever the host layout
    assert out["set_v2"] == out["get_v2"] == [True] * 4
    assert out["v2_exact"]
    assert out["set_generic"] and out["get_generic"] == [True] * 4
    assert out["generic_exact"]
    assert out["exists_all"] == 4
    assert out["exists_gap"] == 2  # consecutive hits from the start only
    assert out["exists_v2"] == 4 and out["exists_one"] is True
    assert out["get_missing"] == [False] and out["missing_untouched"]
    assert out["metrics_pages"] == [8, 8]
    assert out["failures"] == {}


@pytest.mark.parametrize(
    ("kind", "layout", "tiers"),
    [("mha", "page_first", "local"), ("mla", "layer_first", "remote")],
    ids=["mha-lmdb", "mla-file-remote"],
)
def test_another_server_finds_and_loads_the_pages(sglang_python, tmp_path, kind, layout, tiers):
    stored = run(sglang_python, "store", str(tmp_path), kind, layout, tiers)
    assert stored["set"] == [True] * 12
    loaded = run(sglang_python, "load", str(tmp_path), kind, layout, tiers)
    assert loaded["exists"] == 12
    assert loaded["get"] == [True] * 12
    assert loaded["exact"]


def test_failures_are_misses_never_exceptions(sglang_python, tmp_path):
    out = run(sglang_python, "faults", str(tmp_path))
    assert out["unregistered"] == [0, [False, False], [False, False], [None]]
    assert out["set"] == [True] * 4
    assert out["short_indices"] == [False] * 4
    assert out["bad_target"] == [None]
    assert out["set_not_tensors"] is False
    assert out["objects_corrupted"] == 4
    assert out["get_corrupt"] == [False] * 4  # garbage is never served
    assert out["exists_after"] == 0
    assert out["corrupt_left"] == 0  # corrupt objects are deleted when found
    assert out["get_gone"] == [False] * 4


def test_decode_context_parallel_shards_never_read_each_other(sglang_python, tmp_path):
    """MLA with DCP 2: each rank stores its own slice of every page under the same page
    hashes into one shared pool, and each reads back its own; the same shard of another
    DCP group reads rank 0's."""
    out = run(sglang_python, "dcp", str(tmp_path))
    assert out["different_slices"]
    for rank in (0, 1):
        assert out[f"exists_{rank}"] == 4
        assert out[f"get_{rank}"] == [True] * 4
        assert out[f"own_{rank}"], f"DCP rank {rank} read another shard's pages"
    assert out["other_group_get"] == [True] * 4
    assert out["other_group_is_shard_0"]


def test_hybrid_models_extra_pools_round_trip_and_fold_hits(sglang_python, tmp_path):
    """Mamba states and SWA window pages beside the KV pages, in real SGLang host pools."""
    out = run(sglang_python, "hybrid", str(tmp_path))
    assert out["set_kv"] == [True] * 8
    assert out["set_extra"] == [{"mamba": [True]}, {"mamba": [True], "swa": [True, True]}]
    assert out["lmdb_dirs"] == ["lmdb", "lmdb-mamba", "lmdb-swa"]  # a cache per pool
    # an SWA pool is a KV pool: read and written in place; a Mamba state is copied
    assert out["page_kinds"] == {"mamba": "PoolPages", "swa": "PoolViews"}
    # states stored at pages 4 and 8, the SWA window at pages 7-8
    assert out["exists_both"] == [8, {"kv": 8, "mamba": 8, "swa": 8}, [8]]
    assert out["exists_mamba"] == [8, {"kv": 8, "mamba": 8}, [4, 8]]
    assert out["exists_cut"] == [4, {"kv": 6, "mamba": 4}, [4]]  # KV hit 6, last state at 4
    assert out["exists_all_pages"] == [0, {"kv": 8}, []]  # the window lacks pages 1-6
    assert out["get"] == {"kv": [True] * 8, "mamba": [True], "swa": [True, True]}
    assert out["kv_exact"] and out["mamba_exact"] and out["swa_exact"]
    assert out["get_missing"] == {"mamba": [False]} and out["missing_untouched"]
    assert out["unregistered"] == {"indexer": [False]}
    assert out["short_indices"] == {"swa": [False, False]}
    assert out["failures"] == {"batch_get_v2": 1, "batch_set_v2": 1}
    assert out["pool_loaded"] == {"mamba": 1, "swa": 2 * 16}  # a state (a 1-token page), 2 pages
    # the KV cache's endpoint serves the pools' counters too, each under its own model
    assert out["scraped_loaded"] == {
        "tiny/model": 8 * 16, "tiny/model#mamba": 1, "tiny/model#swa": 2 * 16
    }  # fmt: skip
    # a restarted server finds the states in the shared LMDB tier
    assert out["restarted"] == [8, [4, 8]]
    assert out["restarted_get"] == {"mamba": [True]} and out["restarted_exact"]
    assert out["cleared"] and out["after_clear"] == [0, []]
