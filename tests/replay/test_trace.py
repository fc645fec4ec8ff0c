"""Reading traces: both formats, dense ids, and errors that name the line."""

from __future__ import annotations

import pytest

from kvtiers.core.errors import InvalidInputError
from kvtiers.core.keys import ChunkHasher
from kvtiers.replay import TraceError, read_prompts, read_trace
from kvtiers.replay.trace import _TOKEN_FINGERPRINT
from tests.replay._factories import CONVERSATION, SYNTHETIC, mooncake, trace_head, write_lines


def test_reads_the_whole_synthetic_trace():
    trace = read_trace(SYNTHETIC)
    assert trace.format == "mooncake"
    assert trace.block_tokens == 512
    assert trace.num_requests == 3_993
    assert trace.unique_blocks == 43_924
    assert trace.total_blocks == 121_877
    assert trace.timestamps == tuple(sorted(trace.timestamps))


def test_ids_are_dense_in_order_of_first_appearance():
    trace = read_trace(CONVERSATION, limit=50)
    seen = -1
    for ids in trace.requests:
        for i in ids:
            assert i <= seen + 1
            seen = max(seen, i)
    assert trace.unique_blocks == seen + 1
    # The Mooncake ids are dense too, so the first requests keep their own numbers.
    assert trace.requests[0] == tuple(range(14))
    assert trace.requests[1][0] == 0


def test_parents_follow_the_chains():
    trace = read_trace(CONVERSATION, limit=200)
    for ids in trace.requests:
        assert trace.parents[ids[0]] == -1
        for parent, child in zip(ids, ids[1:], strict=False):
            assert trace.parents[child] == parent


def test_head_equals_reading_with_a_limit():
    full = read_trace(CONVERSATION, limit=300)
    assert full.head(120) == read_trace(CONVERSATION, limit=120)


def test_keeps_lengths_and_timestamps(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [7, 8]},
            "",
            {"timestamp": 9.5, "input_length": 512, "output_length": 0, "hash_ids": [7]},
        ],
    )
    trace = read_trace(path)
    assert trace.requests == ((0, 1), (0,))
    assert trace.timestamps == (5.0, 9.5)
    assert trace.input_tokens == (700, 512)
    assert trace.output_tokens == (3, 0)


def test_token_trace_uses_the_library_chain_keys(tmp_path):
    shared = list(range(40))
    path = write_lines(
        tmp_path / "tokens.jsonl",
        [
            {"tokens": shared + [1, 2, 3]},
            {"tokens": shared + [9] * 20, "salt": "tenant-a"},
            {"tokens": shared + [9] * 20},
        ],
    )
    trace = read_trace(path, block_tokens=16)
    assert trace.format == "tokens"
    # Full blocks only: 43 tokens are 2 blocks, 60 tokens 3.
    assert [len(ids) for ids in trace.requests] == [2, 3, 3]
    assert trace.requests[2][:2] == trace.requests[0]  # same prefix, same salt
    assert set(trace.requests[1]).isdisjoint(trace.requests[0])  # another tenant
    hasher = ChunkHasher(_TOKEN_FINGERPRINT, 16)
    assert [trace.keys[i] for i in trace.requests[1]] == hasher.keys(shared + [9] * 20, "tenant-a")
    assert trace.input_tokens == (43, 60, 60)
    assert trace.timestamps == (0.0, 0.0, 0.0)


def test_token_trace_block_size_defaults(tmp_path):
    path = write_lines(tmp_path / "tokens.jsonl", [{"tokens": list(range(600))}])
    assert read_trace(path).block_tokens == 256
    assert read_trace(path, token_block_tokens=64).block_tokens == 64
    assert read_trace(path, block_tokens=100, token_block_tokens=64).block_tokens == 100


def test_limit_stops_before_a_bad_line(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake([1]), "{not json"])
    assert read_trace(path, limit=1).num_requests == 1


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (
            [mooncake([1]), {"timestamp": 1, "input_length": 512, "output_length": 1}],
            r"line 2: missing field 'hash_ids'",
        ),
        (
            [mooncake([1], timestamp=10), mooncake([2], timestamp=20), mooncake([3], timestamp=15)],
            r"line 3: timestamp 15 is earlier than the previous request's 20",
        ),
        ([mooncake([1]), "{oops"], r"line 2: not valid JSON"),
        ([mooncake([1]), "[1, 2]"], r"line 2: expected a JSON object"),
        (
            [{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}],
            r"line 1: 2 hash_ids for input_length 1100; with 512-token blocks expected 3",
        ),
        (
            [mooncake([1, 2]), mooncake([3, 2])],
            r"line 2: block 2 follows a different prefix here than on line 1",
        ),
        ([mooncake([4, 5, 4])], r"line 1: block 4 appears twice in one request"),
        ([{**mooncake([1]), "timestamp": -1}], r"line 1: timestamp: expected a number >= 0"),
        ([{**mooncake([1]), "timestamp": "now"}], r"line 1: timestamp: expected a number"),
        ([{**mooncake([1]), "output_length": 1.5}], r"line 1: output_length: expected an integer"),
        ([{**mooncake([1]), "hash_ids": [1, -2]}], r"line 1: hash_ids: expected a list of"),
        ([{"prompt": "hello"}], r"line 1: expected a Mooncake record .* or a token record"),
        ([{"tokens": [1, 2]}, {"tokens": [1, -2]}], r"line 2: tokens: ids must be non-negative"),
        ([{"tokens": "abc"}], r"line 1: tokens: expected a list of token ids"),
        ([{"tokens": [1], "salt": 7}], r"line 1: salt: expected a string, got int"),
        ([{"tokens": [1]}, mooncake([1])], r"line 2: missing field 'tokens'"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, lines, match):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError, match=match) as info:
        read_trace(path)
    assert str(path) in str(info.value)
    assert info.value.line is not None


def test_errors_are_invalid_input(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", ["{"])
    with pytest.raises(InvalidInputError):
        read_trace(path)
    with pytest.raises(ValueError):
        read_trace(path)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_trace_is_an_error(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match="empty: no request lines") as info:
        read_trace(path)
    assert info.value.line is None


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "nope.jsonl")


def test_non_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"tokens": [1]}\n{"tokens": [2], "salt": "\xe9"}\n')
    with pytest.raises(TraceError, match="line 2: not UTF-8"):
        read_trace(path)


def test_bad_block_size_is_an_error(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake([1])])
    with pytest.raises(TraceError, match="tokens per block must be >= 1"):
        read_trace(path, block_tokens=0)


def test_read_prompts_yields_the_tokens_and_salts_of_a_token_trace(tmp_path):
    records = [{"tokens": [1, 2, 3, 4], "salt": "a"}, {"tokens": [5, 6, 7, 8]}]
    trace = read_trace(write_lines(tmp_path / "t.jsonl", records), block_tokens=2, limit=1)
    assert list(read_prompts(trace)) == [([1, 2, 3, 4], "a")]
    with pytest.raises(TraceError, match="holds no tokens"):
        list(read_prompts(trace_head(SYNTHETIC, 1)))
