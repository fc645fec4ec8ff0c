"""`kvtiers replay` and `kvtiers plan` on the command line."""

from __future__ import annotations

import json

import pytest

from kvtiers.cli import main
from kvtiers.replay import TierSpec, optimum, read_trace, replay
from tests.replay._factories import CONVERSATION, SYNTHETIC, mooncake, write_lines

LIMIT = "300"


def run_json(capsys, *argv: str) -> dict:
    assert main(["replay", *argv, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_json_matches_the_library(capsys):
    data = run_json(capsys, str(SYNTHETIC), "--limit", LIMIT, "--capacity", "5%,10%")
    trace = read_trace(SYNTHETIC, limit=int(LIMIT))
    assert data["requests"] == 300
    assert data["unique_blocks"] == trace.unique_blocks
    capacities = [int(0.05 * trace.unique_blocks), int(0.10 * trace.unique_blocks)]
    assert [(r["policy"], r["capacity_blocks"]) for r in data["runs"]] == [
        (p, c) for c in capacities for p in ("lru", "2q", "arc")
    ]
    for run in data["runs"]:
        expected = replay(trace, [TierSpec("dram", run["capacity_blocks"], run["policy"])])
        assert run["hit_rate"] == expected.hit_rate
    assert [o["hit_rate"] for o in data["optimum"]] == [
        optimum(trace, c).hit_rate for c in capacities
    ]


def test_replay_prints_tables(capsys):
    argv = ["replay", str(CONVERSATION), "--limit", LIMIT, "--capacity", "100", "--no-progress"]
    assert main([*argv, "--policy", "lru,arc"]) == 0
    out = capsys.readouterr().out
    assert "capacity 100 blocks" in out
    assert "\nlru " in out
    assert "\narc " in out
    assert "\noptimum " in out
    assert "2q" not in out


def test_replay_with_a_model_reports_ttft(capsys):
    data = run_json(
        capsys,
        str(SYNTHETIC),
        "--limit",
        LIMIT,
        "--capacity",
        "500",
        "--policy",
        "lru",
        "--model",
        "qwen2.5-7b",
        "--gpu",
        "A100",
        "--tier",
        "dram:25GB/s:10us",
    )
    assert data["block_bytes"] == 57_344 * 512
    assert data["cost"]["tiers"][0]["bandwidth"] == 25e9
    assert data["runs"][0]["ttft"]["throughput_gain"] >= 1
    assert data["runs"][0]["tiers"][0]["bytes_read"] == data["runs"][0]["hits"] * 57_344 * 512


def test_replay_capacity_in_bytes_needs_a_layout(capsys):
    argv = ["replay", str(SYNTHETIC), "--limit", "20", "--capacity", "16GiB", "--no-progress"]
    assert main(argv) == 2
    assert "needs the KV layout" in capsys.readouterr().err
    assert main([*argv, "--model", "llama-3.1-8b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["runs"][0]["capacity_blocks"] == 16 * 2**30 // (131_072 * 512)


def test_replay_with_a_config(tmp_path, capsys):
    config = tmp_path / "tiers.toml"
    config.write_text(
        f"""
[layout]
model = "m"
num_layers = 2
num_kv_heads = 2
head_size = 8
dtype = "float16"
chunk_size = 16

[[tiers]]
kind = "dram"
capacity = "{64 * 128 * 512}"
eviction = "arc"

[[tiers]]
kind = "lmdb"
name = "disk"
path = "{tmp_path / "lmdb"}"
capacity = "{512 * 128 * 512}"
write_policy = "write_back"
"""
    )
    data = run_json(capsys, str(CONVERSATION), "--limit", LIMIT, "--config", str(config))
    (run,) = data["runs"]
    assert run["policy"] == "arc"
    assert [(t["name"], t["capacity_blocks"], t["write_policy"]) for t in run["tiers"]] == [
        ("dram", 64, "write_through"),
        ("disk", 512, "write_back"),
    ]
    assert run["capacity_blocks"] == 576
    assert data["optimum"][0]["capacity_blocks"] == 576
    data = run_json(
        capsys,
        str(CONVERSATION),
        "--limit",
        LIMIT,
        "--config",
        str(config),
        "--policy",
        "lru,2q",
        "--capacity",
        "10,20",
    )
    assert [(r["policy"], r["tiers"][0]["capacity_blocks"]) for r in data["runs"]] == [
        ("lru", 10),
        ("2q", 10),
        ("lru", 20),
        ("2q", 20),
    ]
    assert main(["replay", str(SYNTHETIC), "--config", str(config), "--tier", "nvme:1GB/s",
                 "--model", "llama-3.1-8b", "--limit", "5"]) == 2  # fmt: skip
    assert "no such tier; the replay has dram, disk" in capsys.readouterr().err


def test_replay_bad_trace_exits_2_naming_the_line(tmp_path, capsys):
    path = write_lines(tmp_path / "bad.jsonl", [mooncake([1], 5), mooncake([2], 3)])
    assert main(["replay", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err
    assert "earlier than the previous request's 5" in err


def test_replay_unknown_policy_exits_2(capsys):
    assert main(["replay", str(SYNTHETIC), "--limit", "5", "--policy", "mru"]) == 2
    assert "unknown policy 'mru'" in capsys.readouterr().err


def test_replay_writes_a_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "replay.png"
    argv = ["replay", str(SYNTHETIC), "--limit", "200", "--capacity", "5%,10%,20%"]
    assert main([*argv, "--model", "llama-3.1-8b", "--plot", str(out), "--no-progress"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in capsys.readouterr().err


def test_plan_prints_break_even_per_tier(capsys):
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "H200"]
    assert (
        main([*argv, "--tier", "dram:50GB/s", "--tier", "nvme:5GB/s", "--tier", "s3:1.5GB/s"]) == 0
    )
    out = capsys.readouterr().out
    assert "KV per token  128.00 KiB (131,072 B)" in out
    for name in ("dram", "nvme", "s3"):
        assert f"\n{name} " in out
    assert "break-even" in out


def test_plan_json_and_defaults(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["bytes_per_token"] == 70_272
    assert [t["link"]["name"] for t in data["tiers"]] == ["dram", "nvme", "s3"]
    assert data["prefill"][0]["tokens"] == 1024


def test_plan_needs_a_model(capsys):
    assert main(["plan"]) == 2
    assert main(["plan", "--model", "gpt-17"]) == 2
    assert "neither a preset" in capsys.readouterr().err
