"""Nasty trace files and arguments: a `TraceError` naming the file (and line), or kept as is."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtiers.replay import TraceError, read_prompts, read_trace
from tests.replay._factories import mooncake, write_lines


def one_line(tmp_path: Path, text: str | bytes, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# --- values JSON has that Python would take for numbers ------------------------------------


@pytest.mark.parametrize(
    "tokens", [[True, 2, 3], [1, False], [True] * 16], ids=["first", "last", "all"]
)
def test_bools_are_not_token_ids(tmp_path: Path, tokens: list[Any]) -> None:
    path = write_lines(tmp_path / "t.jsonl", [{"tokens": [1, 2]}, {"tokens": tokens}])
    with pytest.raises(TraceError, match=r"line 2: tokens: .*true or false") as info:
        read_trace(path)
    assert info.value.line == 2


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (
            '{"timestamp": 0, "input_length": 512, "input_length": 5120, "output_length": 1, '
            '"hash_ids": [1]}',
            "input_length",
        ),
        ('{"tokens": [1], "salt": "a", "salt": "b"}', "salt"),
        ('{"tokens": [1], "tokens": [2]}', "tokens"),
    ],
)
def test_a_field_given_twice_is_an_error(tmp_path: Path, line: str, field: str) -> None:
    # json.loads keeps the last value silently: the line would mean another request.
    path = one_line(tmp_path, json.dumps(mooncake([1])) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=rf"line 2: field '{field}' appears twice"):
        read_trace(path)


# --- the file itself ------------------------------------------------------------------


def test_a_utf8_bom_before_the_first_line_is_skipped(tmp_path: Path) -> None:
    text = json.dumps(mooncake([1])) + "\n" + json.dumps(mooncake([1, 2])) + "\n"
    trace = read_trace(one_line(tmp_path, b"\xef\xbb\xbf" + text.encode()))
    assert trace.requests == ((0,), (0, 1))


def test_a_bom_on_a_later_line_is_not_json(tmp_path: Path) -> None:
    text = json.dumps(mooncake([1])) + "\n\ufeff" + json.dumps(mooncake([1, 2])) + "\n"
    with pytest.raises(TraceError, match="line 2: not valid JSON"):
        read_trace(one_line(tmp_path, text))


@pytest.mark.parametrize(
    ("compress", "name"),
    [(gzip.compress, "gzip"), (lambda b: b"\x28\xb5\x2f\xfd" + b, "zstd")],
)
def test_a_compressed_trace_is_named_as_such(tmp_path: Path, compress: Any, name: str) -> None:
    data = compress((json.dumps(mooncake([1])) + "\n").encode())
    with pytest.raises(TraceError, match=rf"{name}-compressed; decompress it first") as info:
        read_trace(one_line(tmp_path, data, "t.jsonl.gz"))
    assert info.value.line is None


def test_no_newline_at_the_end_crlf_and_blank_lines(tmp_path: Path) -> None:
    lines = [json.dumps(mooncake([1], timestamp=3)), "", "  \t", json.dumps(mooncake([1, 2], 3))]
    trace = read_trace(one_line(tmp_path, "\r\n".join(lines)))  # no newline after the last
    assert trace.requests == ((0,), (0, 1))
    assert trace.timestamps == (3.0, 3.0)  # equal timestamps are in order


def test_hash_ids_of_any_size_are_distinct_blocks(tmp_path: Path) -> None:
    ids = [0, 2**64 - 1, 2**64, 10**4000]
    path = write_lines(tmp_path / "t.jsonl", [mooncake([i]) for i in ids] + [mooncake([0])])
    trace = read_trace(path)
    assert trace.requests == ((0,), (1,), (2,), (3,), (0,))
    assert len(set(trace.keys)) == 4


def test_a_directory_and_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path)
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")


@pytest.mark.parametrize(
    "path",
    [5, None, b"/tmp/t.jsonl", "/tmp/a\0b.jsonl"],
    ids=["int", "none", "bytes", "nul"],
)
def test_a_path_that_is_not_a_text_path(path: Any) -> None:
    with pytest.raises(TraceError, match="path|cannot read"):
        read_trace(path)


# --- arguments ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "5", 2**31, None], ids=repr)
@pytest.mark.parametrize("arg", ["block_tokens", "token_block_tokens"])
def test_tokens_per_block_must_be_a_32_bit_count(tmp_path: Path, arg: str, value: Any) -> None:
    path = write_lines(tmp_path / "t.jsonl", [mooncake([1])])
    if value is None:
        assert read_trace(path, **{arg: value}).block_tokens == 512
        return
    with pytest.raises(TraceError, match=rf"{arg}: tokens per block must be >= 1") as info:
        read_trace(path, **{arg: value})
    assert info.value.line is None


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "3"], ids=repr)
def test_limit_must_be_a_positive_integer(tmp_path: Path, limit: Any) -> None:
    path = write_lines(tmp_path / "t.jsonl", [mooncake([1])])
    with pytest.raises(TraceError, match="limit: expected an integer >= 1"):
        read_trace(path, limit=limit)


def test_read_prompts_refuses_what_is_not_a_trace() -> None:
    with pytest.raises(TraceError, match="expected a Trace"):
        list(read_prompts("t.jsonl"))  # type: ignore[arg-type]


def test_a_first_line_with_many_unknown_keys_gives_a_short_message(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [{f"k{i}": i for i in range(10_000)}])
    with pytest.raises(TraceError, match="line 1: expected a Mooncake record") as info:
        read_trace(path)
    assert len(str(info.value)) < 400


# --- Hypothesis: any line is a request or a TraceError naming it ----------------------

_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=6),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
_fields = st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids"])


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(field=_fields, value=_json, extra=st.booleans())
def test_a_mangled_mooncake_line_is_named(
    tmp_path: Path, field: str, value: Any, extra: bool
) -> None:
    good = mooncake([1, 2], timestamp=5)
    bad = {**mooncake([1, 3], timestamp=7), field: value}
    if extra:
        del bad[field]
    path = write_lines(tmp_path / "t.jsonl", [good, bad])
    try:
        trace = read_trace(path)
    except TraceError as exc:
        assert exc.line == 2 and str(path) in str(exc)
        assert "\n" not in str(exc) and len(str(exc)) < 1000
        return
    # Accepted: the line's values are the trace's, unchanged.
    assert trace.num_requests == 2
    assert trace.input_tokens[1] == bad["input_length"]
    assert trace.output_tokens[1] == bad["output_length"]
    assert trace.timestamps[1] == bad["timestamp"]
    assert len(trace.requests[1]) == len(bad["hash_ids"])


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=200))
def test_random_bytes_are_a_trace_error_or_a_trace(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    try:
        read_trace(path)
    except TraceError as exc:
        assert str(path) in str(exc)
