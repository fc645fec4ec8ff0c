"""The `kvtiers` command line: `explain`, `demo` and `--version`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtiers
from kvtiers import TieredCache, _cli_explain
from kvtiers.cli import main
from kvtiers.demo import ChatWorkload, chat_requests, pseudo_kv
from tests._cli_errors import one_line_error
from tests.conftest import small_layout

pytest.importorskip("lmdb")

# A small layout: 2 layers x 2 planes x 2 heads x 8 x 2 bytes = 128 B/token, 2 KiB/chunk.
LAYOUT_TOML = """
[layout]
model = "cli-test"
num_layers = 2
num_kv_heads = 2
head_size = 8
dtype = "float16"
chunk_size = 16
"""


def write_config(tmp_path: Path, dram: str = "64KiB", lmdb: str = "16MiB", extra: str = "") -> Path:
    """Write a DRAM + LMDB config under `tmp_path` and return its path."""
    path = tmp_path / "tiers.toml"
    path.write_text(
        LAYOUT_TOML
        + f"""
[[tiers]]
kind = "dram"
capacity = "{dram}"

[[tiers]]
kind = "lmdb"
name = "disk"
path = "{tmp_path / "lmdb"}"
capacity = "{lmdb}"
read_threads = 2
{extra}
"""
    )
    return path


def tier_hits(out: str, name: str) -> int:
    """Return the hits column of tier `name` in a demo report."""
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] == name and parts[2].isdigit():
            return int(parts[2])
    raise AssertionError(f"no row for tier {name!r} in:\n{out}")


# -- explain ---------------------------------------------------------------------------


def test_explain_prints_layout_and_every_tier(tmp_path, capsys):
    assert main(["explain", str(write_config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "bytes/token   128 B" in out
    assert "bytes/chunk   2.00 KiB (2,048 B)" in out
    assert "tiers[0]      dram (kind dram" in out
    assert "capacity    64.00 KiB = 32 chunks" in out
    assert "tiers[1]      disk (kind lmdb" in out
    assert f"path={tmp_path / 'lmdb'}" in out
    assert "eviction    lru, by the tier itself" in out
    assert "write       write_through" in out
    assert "of host memory" in out
    assert "of disk" in out
    assert "host copies   batches of 8 MiB and more on " in out
    assert "WARNING" not in out
    assert not (tmp_path / "lmdb").exists(), "explain must open nothing"


def test_explain_warns_when_memory_tiers_exceed_ram(tmp_path, capsys):
    assert main(["explain", str(write_config(tmp_path, dram="1000TiB"))]) == 0
    out = capsys.readouterr().out
    assert "WARNING: tiers[0] (dram) needs 1000.00 TiB of host memory" in out


def test_explain_warns_against_the_cgroup_limit(tmp_path, capsys, monkeypatch):
    limit = tmp_path / "memory.max"
    limit.write_text(f"{2**20}\n")
    monkeypatch.setattr(_cli_explain, "_CGROUP_LIMIT_FILES", (tmp_path / "absent", limit))
    assert main(["explain", str(write_config(tmp_path, dram="2MiB"))]) == 0
    out = capsys.readouterr().out
    assert "cgroup memory limit 1.00 MiB" in out
    assert "WARNING: tiers[0] (dram) needs 2.00 MiB of host memory; only 1.00 MiB" in out


def test_explain_warns_when_disk_tiers_exceed_free_space(tmp_path, capsys):
    assert main(["explain", str(write_config(tmp_path, lmdb="1000TiB"))]) == 0
    out = capsys.readouterr().out
    assert "WARNING: tiers[1] (disk) needs 1000.00 TiB of disk at" in out


@pytest.mark.parametrize(
    ("text", "limit"),
    [("max\n", None), ("9223372036854771712\n", None), ("1073741824\n", 2**30)],
)
def test_cgroup_limit_is_read_from_v2_or_v1_files(tmp_path, monkeypatch, text, limit):
    path = tmp_path / "limit"
    path.write_text(text)
    monkeypatch.setattr(_cli_explain, "_CGROUP_LIMIT_FILES", (tmp_path / "absent", path))
    machine = _cli_explain.read_machine()
    assert machine.cgroup_limit == limit
    assert machine.memory_bytes == min(machine.ram_bytes, limit or machine.ram_bytes)


@pytest.mark.parametrize(
    ("extra", "lmdb", "field"),
    [
        ("", "lots", "tiers[1].capacity"),
        ("colour = 'blue'", "16MiB", "tiers[1].colour"),
        ("eviction = 'arc'", "16MiB", "tiers[1].eviction"),
    ],
)
def test_explain_bad_config_exits_2_naming_the_field(tmp_path, capsys, extra, lmdb, field):
    assert main(["explain", str(write_config(tmp_path, lmdb=lmdb, extra=extra))]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert field in captured.err


@pytest.mark.parametrize("with_layout", [True, False], ids=["layout", "no-layout"])
@pytest.mark.parametrize(
    ("extra", "field"),
    [("colour = 'blue'", "tiers[1].colour"), ("eviction = 'arc'", "tiers[1].eviction")],
)
def test_explain_checks_every_tier_with_or_without_a_layout_and_names_the_file(
    tmp_path, capsys, extra, field, with_layout
):
    """An engine config has no [layout] (the adapter supplies it): its tiers are checked
    all the same, and a tier's error names the file, as every error from a file does."""
    path = write_config(tmp_path, extra=extra)
    if not with_layout:
        path.write_text(path.read_text().replace(LAYOUT_TOML, ""))
    assert main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err and f"(in {path})" in err
    assert not (tmp_path / "lmdb").exists()


def test_explain_missing_file_exits_2(tmp_path, capsys):
    assert main(["explain", str(tmp_path / "absent.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_explain_example_config_is_valid(capsys):
    example = Path(__file__).parent.parent / "docs" / "examples" / "tiers.toml"
    assert main(["explain", str(example)]) == 0
    out = capsys.readouterr().out
    assert "tiers[0]" in out and "tiers[1]" in out


# -- demo ------------------------------------------------------------------------------


def test_demo_spills_from_dram_to_lmdb_and_checks_kv(tmp_path, capsys):
    config = write_config(tmp_path, dram="32KiB")  # 16 chunks
    argv = ["demo", "--config", str(config), "--conversations", "6", "--turns", "4"]
    assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "requests          24" in out
    assert "prefix hit rate" in out
    assert tier_hits(out, "dram") > 0
    assert tier_hits(out, "disk") > 0
    assert "KV check: OK" in out


def test_demo_on_the_embedded_tiers(tmp_path, capsys):
    argv = ["demo", "--dir", str(tmp_path), "--conversations", "2", "--turns", "2"]
    assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "model 'kvtiers-demo'" in out
    assert "prefix hit rate" in out
    assert tier_hits(out, "dram") > 0  # the shared system prompt
    assert "KV check: OK" in out
    assert (tmp_path / "lmdb").is_dir()


def test_demo_exits_1_when_loaded_kv_is_wrong(tmp_path, capsys, monkeypatch):
    load = TieredCache.load

    async def corrupting_load(self, tokens, **kwargs):
        kv = await load(self, tokens, **kwargs)
        if kv.shape[2]:
            kv.view(torch.uint8)[0, 0, -1, 0, 0] ^= 0xFF  # last loaded chunk
        return kv

    monkeypatch.setattr(TieredCache, "load", corrupting_load)
    argv = ["demo", "--config", str(write_config(tmp_path)), "--conversations", "2"]
    assert main([*argv, "--turns", "3", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "KV check: FAILED" in out
    assert "mismatch: request" in out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize(("kind", "heads", "head_size"), [("mha", 2, 8), ("mla", 1, 3)])
def test_pseudo_kv_is_a_function_of_the_whole_prefix(dtype, kind, heads, head_size):
    layout = small_layout(dtype=dtype, kind=kind, num_kv_heads=heads, head_size=head_size)
    tokens = np.arange(40, dtype=np.int64)
    kv = pseudo_kv(layout, tokens).view(torch.uint8)
    assert torch.equal(pseudo_kv(layout, tokens[:16]).view(torch.uint8), kv[:, :, :16])
    swapped = tokens.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    other = pseudo_kv(layout, swapped).view(torch.uint8)
    assert torch.equal(other[:, :, :3], kv[:, :, :3])
    for t in range(3, 40):  # every later token sees the swap
        assert not torch.equal(other[:, :, t], kv[:, :, t])


def test_chat_requests_extend_their_conversation_and_interleave():
    work = ChatWorkload(conversations=4, turns=3, seed=7)
    requests = list(chat_requests(work, chunk_size=16))
    assert len(requests) == 12
    last: dict[int, np.ndarray] = {}
    for req in requests:
        assert len(req.tokens) > 4 * 16
        np.testing.assert_array_equal(req.tokens[:64], requests[0].tokens[:64])  # system
        if req.conversation in last:
            prev = last[req.conversation]
            np.testing.assert_array_equal(req.tokens[: len(prev)], prev)
        last[req.conversation] = req.tokens
    order = [req.conversation for req in requests]
    assert order != sorted(order)
    assert [r.tokens.tolist() for r in chat_requests(work, 16)] == [
        r.tokens.tolist() for r in requests
    ]


def test_demo_bad_config_exits_2(tmp_path, capsys):
    config = write_config(tmp_path, lmdb="lots")
    assert main(["demo", "--config", str(config), "--no-progress"]) == 2
    assert "tiers[1].capacity" in capsys.readouterr().err


@pytest.mark.parametrize(
    "where, message",
    [
        ("file", "a file, not a directory"),
        ("file/sub", "cannot create it: Not a directory"),
        ("/proc/kvtiers-demo", "cannot create it:"),
    ],
)
def test_demo_dir_that_cannot_be_a_directory_is_a_one_line_error(tmp_path, capsys, where, message):
    (tmp_path / "file").write_text("not a directory")
    path = where if where.startswith("/") else str(tmp_path / where)
    if where.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("no /proc")
    code = main(["demo", "--dir", path, "--no-progress", "--conversations", "1"])
    assert f"--dir {path}: {message}" in one_line_error(capsys, code, status=2)


def test_demo_refuses_a_negative_seed(capsys):
    code = main(["demo", "--seed=-1", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "argument --seed: expected an integer >= 0, got '-1'" in err


# -- remote ----------------------------------------------------------------------------


@pytest.mark.parametrize("action", [["purge", "--all"], ["ls"]])
def test_remote_tier_that_is_not_remote_is_named_so(tmp_path, capsys, action):
    config = write_config(tmp_path)
    code = main(["remote", *action, "--tier", "dram", str(config)])
    line = one_line_error(capsys, code, status=2)
    assert "--tier dram: tiers[0] is a 'dram' tier, not a remote one" in line
    code = main(["remote", *action, "--tier", "nope", str(config)])
    assert "no tier named 'nope' in the config" in one_line_error(capsys, code, status=2)


# -- the command itself ----------------------------------------------------------------


def test_version_and_usage(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvtiers {kvtiers.__version__}"
    assert main([]) == 2
    assert main(["demo", "--turns", "0"]) == 2
    assert "--turns" in capsys.readouterr().err


def test_console_script_prints_the_version():
    script = shutil.which("kvtiers", path=str(Path(sys.executable).parent)) or shutil.which(
        "kvtiers"
    )
    if script is None:
        pytest.skip("the kvtiers console script is not installed")
    result = subprocess.run(
        [script, "--version"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvtiers {kvtiers.__version__}"


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["demo"],
        ["explain"],
        ["remote"],
        ["remote", "ls"],
        ["remote", "purge"],
        ["inspect"],
        ["stats"],
        ["purge"],
        ["replay"],
        ["plan"],
        ["bench"],
    ],
)
def test_every_command_prints_its_help(command, capsys):
    assert main([*command, "--help"]) == 0
    assert "usage: kvtiers" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("head_size", "writemap", "hinted"),
    [(2048, False, True), (2048, True, False), (8, False, False)],
)
def test_explain_suggests_writemap_for_large_chunks(tmp_path, capsys, head_size, writemap, hinted):
    layout = LAYOUT_TOML.replace("head_size = 8", f"head_size = {head_size}")
    layout = layout.replace("chunk_size = 16", "chunk_size = 256")  # 8 MiB chunks at 2048
    path = tmp_path / "tiers.toml"
    path.write_text(
        layout
        + f"""
[[tiers]]
kind = "lmdb"
path = "{tmp_path / "lmdb"}"
capacity = "64MiB"
writemap = {str(writemap).lower()}
"""
    )
    assert main(["explain", str(path)]) == 0
    assert ("writemap = true writes chunks this large" in capsys.readouterr().out) is hinted
