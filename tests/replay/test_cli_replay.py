"""`kvtiers replay` and `kvtiers plan` on the command line."""

from __future__ import annotations

import json

import pytest

from kvtiers.cli import main
from kvtiers.replay import TierSpec, optimum, read_trace, replay
from kvtiers.replay.hints import turn_hints
from tests._cli_errors import one_line_error
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


def test_replay_with_hints_adds_a_hinted_run_beside_each_policy(capsys):
    argv = [str(CONVERSATION), "--limit", LIMIT, "--capacity", "5%", "--policy", "lru,2q"]
    data = run_json(capsys, *argv, "--hints", "turns")
    trace = read_trace(CONVERSATION, limit=int(LIMIT))
    assert data["hints"] == "turns"
    assert [r["policy"] for r in data["runs"]] == ["lru", "lru+turns", "2q", "2q+turns"]
    capacity = data["runs"][1]["capacity_blocks"]
    hinted = replay(trace, [TierSpec("dram", capacity, "lru")], hints=turn_hints(trace))
    assert data["runs"][1]["hit_rate"] == hinted.hit_rate > data["runs"][0]["hit_rate"]
    assert main(["replay", *argv, "--hints", "future", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "\nlru+future " in out and "+future: the policy given reuse hints" in out
    assert run_json(capsys, *argv)["hints"] is None


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


# -- bad input: one line on stderr, no traceback -------------------------------------------

NINES = "9" * 400


def replay_error(capsys, *argv: str, status: int = 2) -> str:
    code = main(["replay", *argv, "--no-progress"])
    return one_line_error(capsys, code, status=status)


def plan_error(capsys, *argv: str) -> str:
    return one_line_error(capsys, main(["plan", *argv]), status=2)


def test_replay_json_nested_too_deep_names_the_line(tmp_path, capsys):
    path = write_lines(tmp_path / "deep.jsonl", [mooncake([1]), "[" * 100_000])
    assert "deep.jsonl line 2: not valid JSON: nested too deep" in replay_error(capsys, str(path))
    bench = tmp_path / "bench.json"
    bench.write_text("[" * 100_000)
    argv = [str(SYNTHETIC), "--limit", "5", "--model", "llama-3.1-8b", "--tiers-from", str(bench)]
    assert "not JSON: nested too deep" in replay_error(capsys, *argv)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"tokens":[1,2,3,4],"salt":"\\ud800"}', "line 1: salt: not encodable as UTF-8"),
        ('{"tokens":[' + "9" * 5000 + "]}", "line 1: not valid JSON: Exceeds the limit"),
        (json.dumps({**mooncake([1]), "timestamp": int(NINES)}), "expected a finite number"),
        (json.dumps({**mooncake([1]), "timestamp": 2**53 + 1}), "not held exactly by a float"),
        (json.dumps({**mooncake([1]), "input_length": int(NINES)}), "from 0 to 2**53"),
    ],
)
def test_replay_records_out_of_range_are_per_line_errors(tmp_path, capsys, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    assert message in replay_error(capsys, str(path))


@pytest.mark.parametrize(
    "capacity, message",
    [
        (NINES, "is more than 2**53 blocks"),
        (f"{NINES}%", "is more than 2**53 blocks"),
        (f"{NINES}GiB", "is more than 1 EiB"),
        ("1e400", "expected a size"),
    ],
)
def test_replay_refuses_absurd_capacities(capsys, capacity, message):
    argv = [str(SYNTHETIC), "--limit", "5", "--model", "llama-3.1-8b", "--capacity", capacity]
    assert message in replay_error(capsys, *argv)


@pytest.mark.parametrize(
    "name, message",
    [
        ("out.xyz", "matplotlib cannot write 'xyz' files; use one of"),
        ("missing/x.png", "no folder"),
        (".", "a directory"),
    ],
)
def test_replay_checks_the_plot_file_before_replaying(tmp_path, capsys, monkeypatch, name, message):
    pytest.importorskip("matplotlib")
    from kvtiers import _cli_replay

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed before checking --plot")

    monkeypatch.setattr(_cli_replay, "read_trace", no_replay)
    monkeypatch.chdir(tmp_path)
    assert message in replay_error(capsys, str(SYNTHETIC), "--plot", name)


def test_replay_plot_without_a_suffix_says_the_file_it_wrote(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["replay", str(SYNTHETIC), "--limit", "50", "--no-progress", "--json"]
    assert main([*argv, "--plot", str(tmp_path / "figure")]) == 0
    assert f"wrote {tmp_path / 'figure.png'}" in capsys.readouterr().err
    assert (tmp_path / "figure.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--measured", "1000:inf"], "SECONDS must be a finite number > 0"),
        (["--measured", "1000:1e400"], "SECONDS must be a finite number > 0"),
        (["--measured", "1000:1e-320"], "not a finite throughput"),
        (["--measured", f"{NINES}:1"], "TOKENS must be an integer in [1, 2147483647]"),
        (["--tflops", "inf"], "tflops: expected a finite number > 0"),
        (["--tflops", "1e300"], "tflops: expected a finite number > 0"),
        (["--tier", f"nvme:{NINES}GB/s"], "is not a finite bandwidth"),
        (["--tier", f"nvme:1GB/s:{NINES}s"], "is not a finite duration"),
    ],
)
def test_plan_refuses_non_finite_figures(capsys, argv, message):
    assert message in plan_error(capsys, "--model", "llama-3.1-8b", *argv)


HF_CONFIG = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
MODEL = {
    "name": "m",
    "num_params": 1000,
    "num_layers": 2,
    "num_heads": 4,
    "head_size": 16,
    "num_kv_heads": 2,
    "kv_head_size": 16,
}


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"model": 5}', "'model' must be a table"),
        (json.dumps({**HF_CONFIG, "num_attention_heads": 0}), "num_attention_heads: expected"),
        ('{"hidden_size": 1e400, "num_hidden_layers": 2}', "hidden_size: expected an integer"),
        (
            json.dumps({**HF_CONFIG, "max_position_embeddings": float("nan")}),
            "max_position_embeddings: expected an integer",
        ),
        (json.dumps({**MODEL, "num_params": int(NINES)}), "model.num_params: expected an integer"),
        (json.dumps({**MODEL, "v_head_size": -5}), "model.v_head_size: expected an integer"),
        (json.dumps({**MODEL, "total_params": "lots"}), "model.total_params: expected an integer"),
        (json.dumps({**MODEL, "dtype": []}), "model.dtype: [] is not one of"),
        ("[" * 100_000, "nested too deep"),
    ],
)
def test_plan_refuses_bad_model_files_naming_the_field(tmp_path, capsys, text, message):
    path = tmp_path / "m.json"
    path.write_text(text)
    assert message in plan_error(capsys, "--model", str(path))


@pytest.mark.parametrize(
    "figures, message",
    [
        ({"read_bandwidth": int(NINES), "read_latency": 0.001}, "must be finite numbers"),
        ({"read_bandwidth": float("inf"), "read_latency": 0.001}, "bandwidth must be a finite"),
        ({"read_bandwidth": 1e9, "read_latency": float("nan")}, "latency must be a finite"),
    ],
)
def test_plan_refuses_non_finite_bench_figures(tmp_path, capsys, figures, message):
    path = tmp_path / "bench.json"
    tier = {"name": "dram", "status": "measured", **figures}
    path.write_text(json.dumps({"kvtiers_bench": 1, "tiers": [tier]}))
    line = plan_error(capsys, "--model", "llama-3.1-8b", "--tiers-from", str(path))
    assert f"--tiers-from {path}" in line and message in line
