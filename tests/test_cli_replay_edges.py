"""`kvtiers` argument edges: an empty `--capacity`, integers that are not plain ASCII digits."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvtiers._cli_args import non_negative_int, parse_age, positive_int
from kvtiers.cli import main
from tests._cli_errors import one_line_error

TRACE = Path(__file__).parent / "data" / "traces" / "conversation_trace.jsonl"
LAYOUT_TOML = """
[layout]
model = "test-model"
num_layers = 2
num_kv_heads = 2
head_size = 8
dtype = "float16"
chunk_size = 16

[[tiers]]
kind = "dram"
capacity = "1MiB"
"""


def replay_error(capsys: Any, *argv: str) -> str:
    code = main(["replay", str(TRACE), "--limit", "20", "--no-progress", *argv])
    return one_line_error(capsys, code, status=2)


# -- replay --capacity --------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [",", "", " ", " , ,", ",,,"])
@pytest.mark.parametrize("model", [[], ["--model", "llama-3.1-8b"]], ids=["", "model"])
def test_replay_refuses_a_capacity_with_no_parts(
    capsys: Any, capacity: str, model: list[str]
) -> None:
    line = replay_error(capsys, "--capacity", capacity, *model)
    assert line.startswith("kvtiers replay: --capacity: expected"), line


@pytest.mark.parametrize("capacity", [",", ""])
def test_replay_with_a_config_refuses_a_capacity_with_no_parts(
    tmp_path: Path, capsys: Any, capacity: str
) -> None:
    config = tmp_path / "tiers.toml"
    config.write_text(LAYOUT_TOML, encoding="utf-8")
    line = replay_error(capsys, "--config", str(config), "--capacity", capacity)
    assert line.startswith("kvtiers replay: --capacity: expected"), line


def test_replay_ignores_empty_parts_beside_real_ones(capsys: Any) -> None:
    argv = ["replay", str(TRACE), "--limit", "20", "--no-progress", "--capacity", ",100,"]
    assert main(argv) == 0
    assert "capacity 100 blocks" in capsys.readouterr().out


# -- integers and ages ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["\u0665", "\uff15", "\u0661\u0660", "1_000", "+5", " 5", "5 ", "0x10", "", "-1"]
)
def test_integer_arguments_take_ascii_digits_only(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer >= 1"):
        positive_int(text)
    if text != "-1":
        with pytest.raises(argparse.ArgumentTypeError, match="expected an integer >= 0"):
            non_negative_int(text)


@pytest.mark.parametrize("text, value", [("1", 1), ("007", 7), ("1000", 1000)])
def test_integer_arguments_take_plain_numbers(text: str, value: int) -> None:
    assert positive_int(text) == value
    assert non_negative_int(text) == value
    assert non_negative_int("0") == 0


def test_integer_arguments_refuse_more_digits_than_python_converts() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer >= 1, got '9+"):
        positive_int("9" * 5000)


@pytest.mark.parametrize("text", ["\u0665h", "\uff13\uff10m", "1_0d"])
def test_ages_take_ascii_digits_only(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected an age"):
        parse_age(text)


def test_limit_in_unicode_digits_is_a_usage_error(capsys: Any) -> None:
    code = main(["replay", str(TRACE), "--limit", "\uff15", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "argument --limit: expected an integer >= 1" in err
    assert "Traceback" not in err


def test_ages_of_hundreds_of_digits_are_refused_not_infinite() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected an age of finite length"):
        parse_age("9" * 400 + "d")
    assert parse_age("1.5h") == 5400.0
