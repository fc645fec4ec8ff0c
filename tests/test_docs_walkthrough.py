"""What README.md, docs/configuration.md and docs/replay.md promise of the command line.

Each test runs the real `kvtiers` commands (through `kvtiers.cli.main`, or a subprocess
where the process's own stdout matters) on real LMDB paths and `file://` pools, and checks
a promise that once failed: errors that name the key and the file, flags refused rather
than ignored, and a quiet exit when the reader of the output leaves.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtiers import ConfigError, load_config
from kvtiers.cli import main
from kvtiers.core.config import parse_size
from tests._cli_errors import one_line_error

pytest.importorskip("lmdb")

TRACE = Path(__file__).parent / "data" / "traces" / "synthetic_trace.jsonl"

LAYOUT = """
[layout]
model = "docs-test"
num_layers = 2
num_kv_heads = 2
head_size = 8
dtype = "float16"
chunk_size = 16
"""


def write_toml(tmp_path: Path, tiers: str, *, layout: bool = True) -> Path:
    """Write a config of `tiers` (TOML `[[tiers]]` tables) and return its path."""
    path = tmp_path / "tiers.toml"
    path.write_text((LAYOUT if layout else "") + tiers)
    return path


def lmdb_tier(tmp_path: Path, extra: str = "") -> str:
    return f"""
[[tiers]]
kind = "lmdb"
path = "{tmp_path / "lmdb"}"
capacity = "16MiB"
{extra}
"""


# -- config errors name the key and the file ---------------------------------------------


def test_explain_names_the_file_of_an_unknown_tier_kind(tmp_path, capsys):
    path = write_toml(tmp_path, '[[tiers]]\nkind = "ssd"\ncapacity = "1MiB"\n')
    line = one_line_error(capsys, main(["explain", str(path)]), status=2)
    assert "tiers[0].kind: unknown tier kind 'ssd'" in line
    assert line.endswith(f"(in {path})")


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ('capcity = "1MiB"', "capcity: unknown key; did you mean 'capacity'?"),
        ('capacity = "1MiB"\neviciton = "arc"', "eviciton: unknown key; did you mean 'eviction'?"),
        (
            'capacity = "1MiB"\nwritepolicy = "write_back"',
            "writepolicy: unknown key; did you mean 'write_policy'?",
        ),
    ],
)
def test_a_misspelt_tier_key_is_named_with_the_key_meant(tmp_path, capsys, typo, meant):
    path = write_toml(tmp_path, f'[[tiers]]\nkind = "dram"\n{typo}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"tiers[0].{meant} (in {path})"
    line = one_line_error(capsys, main(["explain", str(path)]), status=2)
    assert meant in line


def test_a_kind_option_is_not_taken_for_a_misspelt_common_key(tmp_path):
    config = load_config(
        {"tiers": [{"kind": "lmdb", "capacity": "1MiB", "path": str(tmp_path), "sync": True}]}
    )
    assert dict(config.tiers[0].options) == {"path": str(tmp_path), "sync": True}


@pytest.mark.parametrize(
    ("config", "start"),
    [
        ({"layout": {"\n": None}}, "layout.'\\n': unknown key; expected one of"),
        ({"tiers": [{"kind": "dram", "capacity": 1, "evictio\n": 1}]}, "tiers[0].'evictio\\n'"),
    ],
)
def test_a_key_with_a_line_break_is_named_on_one_line(config, start):
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"kind": "dram", "capacity": 1}], **config})
    assert str(info.value).startswith(start)
    assert "\n" not in str(info.value)


def test_sizes_read_as_configuration_md_says():
    assert parse_size("16 GB", where="x") == 16 * 10**9
    assert parse_size("16GiB", where="x") == 16 * 2**30
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.capacity: expected a non-negative size"):
        parse_size("-5GiB", where="tiers[0].capacity")
    with pytest.raises(ConfigError, match="expected a size such as"):
        parse_size("16 gigabytes", where="x")


def test_a_negative_capacity_in_a_file_names_key_and_file(tmp_path, capsys):
    path = write_toml(tmp_path, '[[tiers]]\nkind = "dram"\ncapacity = "-5GiB"\n')
    line = one_line_error(capsys, main(["explain", str(path)]), status=2)
    assert "tiers[0].capacity: expected a non-negative size, got '-5GiB'" in line
    assert line.endswith(f"(in {path})")


@pytest.mark.parametrize("command", [["demo", "--no-progress", "--config"], ["bench"]])
def test_demo_and_bench_name_the_file_of_a_bad_tier_option(tmp_path, capsys, command):
    path = write_toml(tmp_path, lmdb_tier(tmp_path, "read_thread = 2"))
    line = one_line_error(capsys, main([*command, str(path)]), status=2)
    assert "tiers[0].read_thread: unknown option for kind 'lmdb'" in line
    assert line.endswith(f"(in {path})")
    assert not (tmp_path / "lmdb").exists()  # refused before any tier opened


def test_demo_names_the_file_of_a_config_without_a_layout(tmp_path, capsys):
    path = write_toml(tmp_path, lmdb_tier(tmp_path), layout=False)
    line = one_line_error(capsys, main(["demo", "--config", str(path)]), status=2)
    assert (
        line == f"kvtiers demo: layout: required; give a [layout] table or a KVLayout (in {path})"
    )


# -- remote ls / purge --------------------------------------------------------------------


def test_remote_tier_flag_lists_the_remote_tiers_and_names_the_file(tmp_path, capsys):
    pool = tmp_path / "pool"
    path = write_toml(
        tmp_path, f'[[tiers]]\nkind = "remote"\nurl = "{pool.as_uri()}"\ncapacity = "1MiB"\n'
    )
    assert main(["remote", "ls", str(path)]) == 0
    assert "remote (kind remote)" in capsys.readouterr().out
    line = one_line_error(capsys, main(["remote", "ls", "--tier", "nope", str(path)]), status=2)
    assert "no tier named 'nope' in the config; remote tiers: remote" in line
    assert line.endswith(f"(in {path})")


def test_remote_without_a_remote_tier_names_the_file(tmp_path, capsys):
    path = write_toml(tmp_path, lmdb_tier(tmp_path))
    line = one_line_error(capsys, main(["remote", "purge", "--all", str(path)]), status=2)
    assert line == f"kvtiers remote: tiers: no tier of kind 'remote' in the config (in {path})"


# -- replay ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ("read_thread = 2", "tiers[0].read_thread: unknown option for kind 'lmdb'"),
        ('eviction = "arc"', "tiers[0].eviction: the lmdb tier evicts"),
    ],
)
def test_replay_checks_the_config_tiers_without_full(tmp_path, capsys, tier, message):
    path = write_toml(tmp_path, lmdb_tier(tmp_path, tier))
    code = main(["replay", str(TRACE), "--config", str(path), "--limit", "5", "--no-progress"])
    line = one_line_error(capsys, code, status=2)
    assert message in line
    assert line.endswith(f"(in {path})")


def test_replay_of_a_valid_config_still_runs(tmp_path, capsys):
    path = write_toml(tmp_path, lmdb_tier(tmp_path))
    code = main(["replay", str(TRACE), "--config", str(path), "--limit", "5", "--no-progress"])
    assert code == 0
    assert "optimum" in capsys.readouterr().out
    assert not (tmp_path / "lmdb").exists()  # the index-only mode opens no tier


def test_replay_names_the_file_of_a_capacity_below_one_block(tmp_path, capsys):
    path = write_toml(tmp_path, '[[tiers]]\nkind = "dram"\ncapacity = "1KiB"\n')
    code = main(["replay", str(TRACE), "--config", str(path), "--limit", "5", "--no-progress"])
    line = one_line_error(capsys, code, status=2)
    assert "tiers[0].capacity:" in line and "less than one" in line
    assert line.endswith(f"(in {path})")


@pytest.mark.parametrize(
    "flags",
    [
        ["--tier", "dram:1GB/s"],
        ["--tiers-from", "bench.json"],
        ["--tflops", "100"],
        ["--measured", "1000:0.1"],
    ],
)
def test_replay_refuses_cost_flags_without_a_model(capsys, flags):
    code = main(["replay", str(TRACE), "--limit", "5", "--no-progress", *flags])
    line = one_line_error(capsys, code, status=2)
    assert f"{flags[0]}: only with --model" in line


# -- output to a reader that leaves ---------------------------------------------------------


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_closed_output_pipe_ends_the_command_quietly(json_flag):
    argv = ["plan", "--model", "llama-3.1-8b", *json_flag]
    code = f"from kvtiers.cli import main; raise SystemExit(main({argv!r}))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes: every write finds no reader
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait() == 1
    assert err == b""
