"""`kvtiers bench`: measure a config's tiers, leave nothing behind, feed `plan`/`replay`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import mmap
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtiers import TieredCache, _page_cache
from kvtiers import _tierbench as tierbench
from kvtiers._inspect import inspect
from kvtiers.cli import main
from kvtiers.core.config import load_config
from kvtiers.costmodel import parse_tier_link
from tests.conftest import make_kv, same_bytes, small_layout

pytest.importorskip("lmdb")
pytest.importorskip("fsspec")

LAYOUT = small_layout()
CHUNK_BYTES = LAYOUT.chunk_bytes  # 2 KiB
TRACE = Path(__file__).parent / "data" / "traces" / "conversation_trace.jsonl"
LAYOUT_TOML = """
[layout]
model = "test-model"
num_layers = 2
num_kv_heads = 2
head_size = 8
dtype = "float16"
chunk_size = 16
"""


def write_config(tmp_path: Path, *, lmdb_capacity: str = "4MiB", top: str = "") -> Path:
    """Write a dram + lmdb + file:// remote config (all write-through) and return it.

    `top`: tier tables to put above the dram tier.
    """
    path = tmp_path / "tiers.toml"
    path.write_text(
        LAYOUT_TOML
        + top
        + f"""
[[tiers]]
kind = "dram"
capacity = "64KiB"

[[tiers]]
kind = "lmdb"
name = "disk"
path = "{tmp_path / "lmdb"}"
capacity = "{lmdb_capacity}"
read_threads = 2

[[tiers]]
kind = "remote"
name = "pool"
url = "file://{tmp_path / "pool"}"
capacity = "4MiB"
"""
    )
    return path


async def store_real(config: Path, num_tokens: int = 128) -> torch.Tensor:
    """Store real KV through every tier (drained at close) and return it."""
    kv = make_kv(LAYOUT, num_tokens)
    async with TieredCache.from_config(config) as cache:
        assert await cache.store(list(range(num_tokens)), kv) == num_tokens
    return kv


async def load_from(config: Path, tier: int, num_tokens: int) -> torch.Tensor:
    """Load the real tokens through a cache of one lower tier of `config` alone."""
    full = load_config(config)
    alone = dataclasses.replace(full.tiers[tier], index=0)
    async with TieredCache(dataclasses.replace(full, tiers=(alone,))) as cache:
        return await cache.load(list(range(num_tokens)))


def pool_files(tmp_path: Path) -> dict[str, int]:
    """Return every file below the remote pool with its size."""
    root = tmp_path / "pool"
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def lmdb_entries(tmp_path: Path) -> list[tuple[str, int, int]]:
    """Return what `kvtiers inspect` finds in the LMDB tier, per layout."""
    found = inspect(str(tmp_path / "lmdb"), verify=True)
    assert not found.bad
    return [(ns.fingerprint, ns.entries, ns.bytes) for ns in found.namespaces]


def bench_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["bench", *argv, "--json"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def test_bench_measures_every_tier_and_leaves_real_data_alone(tmp_path, capsys):
    config = write_config(tmp_path)
    kv = asyncio.run(store_real(config))
    files, entries = pool_files(tmp_path), lmdb_entries(tmp_path)
    assert entries and entries[0][1] == 8 and len(files) > 8  # 8 chunks, plus an access log

    data = bench_json(capsys, str(config), "--chunks", "16")

    assert data["kvtiers_bench"] == 1
    assert data["layout"]["chunk_bytes"] == CHUNK_BYTES
    assert [t["name"] for t in data["tiers"]] == ["dram", "disk", "pool"]
    for tier in data["tiers"]:
        assert tier["status"] == "measured", tier
        assert tier["chunks"] == 16
        assert tier["read_bandwidth"] > 0
        assert tier["write_bandwidth"] > 0
        assert tier["chunk_read_seconds"] > 0
        assert tier["read_latency"] >= 0
        assert tier["clean"] is True
    reads = {t["name"]: t["reads_from"] for t in data["tiers"]}
    assert reads == {"dram": "memory", "disk": "page cache", "pool": "page cache"}
    assert "removed every chunk" in data["tiers"][1]["cleanup"]
    # Nothing the bench wrote is left: the same LMDB entries, the same pool files (no
    # chunk objects, no access log of its own).
    assert lmdb_entries(tmp_path) == entries
    assert pool_files(tmp_path) == files
    # The real chunks still load, from each lower tier alone.
    for tier in (1, 2):
        loaded = asyncio.run(load_from(config, tier, 128))
        assert same_bytes(loaded, kv)


def skip_unless_droppable(tmp_path: Path) -> None:
    """Skip unless files under `tmp_path` can be dropped from the page cache and checked."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 65536)
    if not _page_cache.can_drop():
        pytest.skip("this platform has no posix_fadvise")
    _page_cache.drop([str(probe)])
    resident = _page_cache.resident_fraction([str(probe)])
    probe.unlink()
    if resident is None:
        pytest.skip("this platform has no mincore")
    if resident > 0.01:
        pytest.skip("the temporary directory keeps files in memory (tmpfs)")


def test_cold_reads_every_disk_tier_from_the_disk(tmp_path, capsys):
    skip_unless_droppable(tmp_path)
    config = write_config(tmp_path)
    kv = asyncio.run(store_real(config))
    files, entries = pool_files(tmp_path), lmdb_entries(tmp_path)

    data = bench_json(capsys, str(config), "--chunks", "16", "--cold")

    assert data["cold"] is True
    for tier in data["tiers"]:
        assert tier["status"] == "measured", tier
        assert tier["read_bandwidth"] > 0 and tier["write_bandwidth"] > 0
        assert tier["chunk_read_seconds"] > 0
        assert tier["clean"] is True
    reads = {t["name"]: (t["reads_from"], t["cold"]) for t in data["tiers"]}
    assert reads == {
        "dram": ("memory", False),
        "disk": ("disk (cold)", True),
        "pool": ("disk (cold)", True),
    }
    assert [t["resident_fraction"] for t in data["tiers"]][1:] == [pytest.approx(0, abs=0.01)] * 2
    assert lmdb_entries(tmp_path) == entries
    assert pool_files(tmp_path) == files
    for tier in (1, 2):
        assert same_bytes(asyncio.run(load_from(config, tier, 128)), kv)

    assert main(["bench", str(config), "--chunks", "4", "--cold"]) == 0
    out = capsys.readouterr().out
    assert "disk (cold)" in out and "page cache (warm)" not in out
    assert "cold (--cold): disk, pool" in out
    assert "not cold (measured as without --cold): dram" in out


def test_cold_says_partly_warm_when_another_map_holds_the_file(tmp_path, capsys):
    skip_unless_droppable(tmp_path)
    config = write_config(tmp_path)
    asyncio.run(store_real(config))
    with (
        (tmp_path / "lmdb" / "data.mdb").open("rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as held,
    ):
        sum(held[i] for i in range(0, len(held), mmap.PAGESIZE))  # every page mapped in
        data = bench_json(capsys, str(config), "--chunks", "4", "--cold")
    disk = data["tiers"][1]
    assert disk["status"] == "measured" and disk["clean"] is True
    assert disk["cold"] is False
    assert disk["resident_fraction"] > 0.01
    assert disk["reads_from"].startswith("partly warm (")
    assert disk["reads_from"].endswith("% resident: another process maps the file)")
    assert data["tiers"][2]["cold"] is True


def test_bench_text_prints_a_table_and_the_tier_flags(tmp_path, capsys):
    config = write_config(tmp_path)
    out_file = tmp_path / "bench.json"
    assert main(["bench", str(config), "--chunks", "4", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    saved = json.loads(out_file.read_text())
    assert "read BW" in out and "write BW" in out
    assert "page cache (warm)" in out
    assert "drops no caches" in out
    flag_line = out.strip().splitlines()[-1]
    flags = flag_line.split()
    assert flags[::2] == ["--tier"] * 3
    assert saved["flags"] == [f"--tier {f}" for f in flags[1::2]]
    for text, tier in zip(flags[1::2], saved["tiers"], strict=True):
        link = parse_tier_link(text)  # the flags paste into replay/plan as they are
        assert link.name == tier["name"]
        assert link.bandwidth == pytest.approx(tier["read_bandwidth"], rel=0.01)
        assert link.latency == pytest.approx(tier["read_latency"], rel=0.01, abs=1e-8)


def test_tiers_from_feeds_plan_and_tier_flags_override(tmp_path, capsys):
    config = write_config(tmp_path)
    out_file = tmp_path / "bench.json"
    assert main(["bench", str(config), "--chunks", "4", "--out", str(out_file)]) == 0
    measured = {t["name"]: t for t in json.loads(out_file.read_text())["tiers"]}
    capsys.readouterr()

    argv = ["plan", "--model", "llama-3.1-8b", "--tiers-from", str(out_file)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    dram_gbs = f"{measured['dram']['read_bandwidth'] / 1e9:.2f} GB/s"
    assert any(line.startswith("dram ") and dram_gbs in line for line in out.splitlines())

    assert main([*argv, "--tier", "disk:1GB/s:1ms", "--tier", "s3", "--json"]) == 0
    links = {t["link"]["name"]: t["link"] for t in json.loads(capsys.readouterr().out)["tiers"]}
    assert list(links) == ["dram", "disk", "pool", "s3"]
    assert links["dram"]["bandwidth"] == measured["dram"]["read_bandwidth"]
    assert links["pool"]["latency"] == measured["pool"]["read_latency"]
    assert links["disk"]["bandwidth"] == 1e9 and links["disk"]["latency"] == 1e-3


def test_tiers_from_feeds_replay_by_tier_name(tmp_path, capsys):
    config = write_config(tmp_path)
    out_file = tmp_path / "bench.json"
    assert main(["bench", str(config), "--chunks", "4", "--out", str(out_file)]) == 0
    measured = {t["name"]: t for t in json.loads(out_file.read_text())["tiers"]}
    capsys.readouterr()
    argv = ["replay", str(TRACE), "--config", str(config), "--limit", "20", "--no-progress"]
    argv += ["--model", "llama-3.1-8b", "--tiers-from", str(out_file)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    disk_gbs = f"{measured['disk']['read_bandwidth'] / 1e9:.2f} GB/s"
    assert f"disk: {disk_gbs}" in out


def test_tiers_from_must_name_a_tier_of_the_replay(tmp_path, capsys):
    report = tmp_path / "bench.json"
    tiers = [{"name": "elsewhere", "status": "measured", "read_bandwidth": 1e9, "read_latency": 0}]
    report.write_text(json.dumps({"kvtiers_bench": 1, "tiers": tiers}))
    argv = ["replay", str(TRACE), "--limit", "5", "--model", "llama-3.1-8b"]
    assert main([*argv, "--tiers-from", str(report)]) == 2
    assert "none of its tiers (elsewhere) is a tier of the replay (dram)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read it"),
        ("{not json", "not JSON"),
        ('{"tiers": []}', "not a kvtiers bench report"),
        ('{"kvtiers_bench": 1, "tiers": [{"name": "x", "status": "skipped"}]}', "measured no"),
        ('{"kvtiers_bench": 1, "tiers": [7]}', "tiers[0]: expected an object"),
        (
            '{"kvtiers_bench": 1, "tiers": [{"name": "x", "status": "measured", '
            '"read_bandwidth": "fast", "read_latency": 0}]}',
            "must be numbers",
        ),
        (
            '{"kvtiers_bench": 1, "tiers": [{"name": "x", "status": "measured", '
            '"read_bandwidth": 0, "read_latency": 0}]}',
            "bandwidth must be a finite number > 0",
        ),
    ],
)
def test_tiers_from_a_bad_file_is_a_config_error(tmp_path, capsys, content, message):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    assert main(["plan", "--model", "llama-3.1-8b", "--tiers-from", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"kvtiers plan: --tiers-from {path}: " in err
    assert message in err


def test_a_full_shared_tier_gets_only_its_free_room(tmp_path, capsys):
    # Room for the 8 real chunks and a few more: the bench must evict none of them.
    config = write_config(tmp_path, lmdb_capacity=str(8 * 2200 + 3 * 2400))
    asyncio.run(store_real(config))
    entries = lmdb_entries(tmp_path)

    data = bench_json(capsys, str(config), "--chunks", "16")

    disk = data["tiers"][1]
    assert disk["status"] == "measured", disk
    assert 1 <= disk["chunks"] < 16
    assert any("free room" in note for note in disk["notes"])
    assert not any("evicted" in note for note in disk["notes"])
    assert lmdb_entries(tmp_path) == entries


def test_a_tier_without_free_room_is_skipped(tmp_path, capsys):
    config = write_config(tmp_path, lmdb_capacity=str(8 * 2200))
    asyncio.run(store_real(config))
    entries = lmdb_entries(tmp_path)
    assert entries[0][1] == 8

    data = bench_json(capsys, str(config), "--chunks", "4")

    disk = data["tiers"][1]
    assert disk["status"] == "skipped"
    assert "writing would evict real chunks" in disk["reason"]
    assert lmdb_entries(tmp_path) == entries
    assert all(t["status"] == "measured" for t in (data["tiers"][0], data["tiers"][2]))


def test_hbm_is_skipped_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tierbench, "cuda_available", lambda: False)
    config = write_config(tmp_path, top='\n[[tiers]]\nkind = "hbm"\ncapacity = "64KiB"\n')

    data = bench_json(capsys, str(config), "--chunks", "4")

    assert [t["name"] for t in data["tiers"]] == ["hbm", "dram", "disk", "pool"]
    assert data["tiers"][0]["status"] == "skipped"
    assert data["tiers"][0]["reason"] == "no CUDA device is present"
    assert data["device"] == "host"
    assert [f.split(":")[0] for f in data["flags"]] == ["--tier dram", "--tier disk", "--tier pool"]


def test_hbm_on_its_cpu_test_seam_is_measured(tmp_path, capsys):
    config = tmp_path / "hbm.toml"
    hbm = '\n[[tiers]]\nkind = "hbm"\ncapacity = "64KiB"\ndevice = "cpu"\n'
    config.write_text(LAYOUT_TOML + hbm)
    data = bench_json(capsys, str(config), "--chunks", "64")
    hbm = data["tiers"][0]
    assert hbm["status"] == "measured"
    assert hbm["chunks"] == 32
    assert hbm["notes"] == ["32 chunks: what its capacity holds"]
    assert hbm["read_bandwidth"] > 0 and hbm["write_bandwidth"] > 0


def test_chunks_travel_as_tensors_on_a_device(tmp_path, capsys, monkeypatch):
    # The path a GPU takes (payload-shaped tensors, not host bytes), on the CPU.
    monkeypatch.setattr(tierbench, "_device", lambda: "cpu")
    config = write_config(tmp_path)
    data = bench_json(capsys, str(config), "--chunks", "4")
    assert data["device"] == "cpu"
    assert [t["status"] for t in data["tiers"]] == ["measured"] * 3
    assert all(t["clean"] for t in data["tiers"])


def test_bench_needs_a_layout(tmp_path, capsys):
    config = tmp_path / "tiers.toml"
    config.write_text('[[tiers]]\nkind = "dram"\ncapacity = "1MiB"\n')
    assert main(["bench", str(config)]) == 2
    assert "kvtiers bench: layout: required" in capsys.readouterr().err
    assert main(["bench", str(config), "--chunks", "0"]) == 2


def test_cold_a_failed_drop_fails_the_tier_and_still_cleans_up(tmp_path, capsys, monkeypatch):
    def refuse(paths: object) -> None:
        raise PermissionError(13, "refused")

    monkeypatch.setattr(_page_cache, "drop", refuse)
    config = write_config(tmp_path)
    assert main(["bench", str(config), "--chunks", "4", "--cold", "--json"]) == 1
    tiers = json.loads(capsys.readouterr().out)["tiers"]
    assert [t["status"] for t in tiers] == ["measured", "failed", "failed"]
    assert all("could not drop its files" in t["reason"] for t in tiers[1:])
    assert all(t["clean"] for t in tiers), tiers
    assert lmdb_entries(tmp_path) == []


def test_a_store_that_cannot_delete_fails_its_tier_in_one_line(tmp_path, capsys):
    # fsspec's HTTP filesystem writes and deletes nothing: its _rm_file is not implemented.
    pytest.importorskip("aiohttp")
    config = tmp_path / "tiers.toml"
    config.write_text(
        LAYOUT_TOML + '\n[[tiers]]\nkind = "remote"\nname = "web"\n'
        'url = "http://127.0.0.1:1/x"\ncapacity = "1MiB"\n'
    )
    assert main(["bench", str(config), "--chunks", "4"]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.out.splitlines()
    assert any(line.startswith("web ") and "failed: " in line for line in lines)
    (cleanup,) = [line for line in lines if line.startswith("web: could not remove")]
    assert "its store cannot delete (NotImplementedError)" in cleanup


def test_a_store_without_an_operation_fails_only_its_tier(tmp_path, capsys, monkeypatch):
    async def unsupported(*args: object, **kwargs: object) -> None:
        raise NotImplementedError

    monkeypatch.setattr(tierbench, "measure", unsupported)
    assert main(["bench", str(write_config(tmp_path)), "--chunks", "4", "--json"]) == 1
    tiers = json.loads(capsys.readouterr().out)["tiers"]
    assert [t["status"] for t in tiers] == ["failed"] * 3
    assert all("does not support an operation the bench needs" in t["reason"] for t in tiers)
    assert all(t["clean"] for t in tiers), tiers
