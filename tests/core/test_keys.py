"""Tests of chained chunk keys (`kvtiers.core.keys`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers.core.errors import TokenError
from kvtiers.core.keys import KEY_BYTES, ChunkHasher, as_token_array
from kvtiers.core.layout import KVLayout
from tests.core._cross_process import DET_LAYOUT, DET_SALT, DET_TOKENS, HASH_SEEDS

FINGERPRINT = bytes(range(16))

token_ids = st.integers(min_value=0, max_value=2**63 - 1)
small_token_ids = st.integers(min_value=0, max_value=2**16 - 1)
salts = st.one_of(st.none(), st.text(max_size=8), st.binary(max_size=8))


def _ref_salt(salt: str | bytes | None) -> bytes:
    if salt is None:
        return b"\x00"
    if isinstance(salt, str):
        return b"\x01" + salt.encode("utf-8")
    return b"\x02" + bytes(salt)


def reference_keys(
    fingerprint: bytes, chunk_size: int, tokens: list[int], salt: str | bytes | None = None
) -> list[bytes]:
    """Compute the keys the slow, obvious way: one chunk at a time."""
    arr = np.asarray(tokens, dtype=np.int64)
    prev = xxhash.xxh3_128_digest(fingerprint + _ref_salt(salt))
    out = []
    for i in range(len(arr) // chunk_size):
        chunk = arr[i * chunk_size : (i + 1) * chunk_size]
        prev = xxhash.xxh3_128_digest(prev + chunk.astype("<i8").tobytes())
        out.append(prev)
    return out


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(token_ids, max_size=80),
    chunk_size=st.integers(min_value=1, max_value=16),
    salt=salts,
)
def test_keys_match_reference(tokens: list[int], chunk_size: int, salt: str | bytes | None) -> None:
    hasher = ChunkHasher(FINGERPRINT, chunk_size)
    keys = hasher.keys(tokens, salt)
    assert keys == reference_keys(FINGERPRINT, chunk_size, tokens, salt)
    assert len(keys) == len(tokens) // chunk_size
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)


def test_root_is_parent_of_first_chunk() -> None:
    hasher = ChunkHasher(FINGERPRINT, 2)
    root = hasher.root("tenant")
    assert root == xxhash.xxh3_128_digest(FINGERPRINT + b"\x01tenant")
    first = hasher.keys([7, 8], "tenant")[0]
    assert first == xxhash.xxh3_128_digest(root + np.array([7, 8], "<i8").tobytes())


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 4, 5, 7, 8, 9])
def test_only_full_chunks_get_keys(num_tokens: int) -> None:
    hasher = ChunkHasher(FINGERPRINT, 4)
    tokens = list(range(num_tokens))
    assert len(hasher.keys(tokens)) == num_tokens // 4


def test_partial_tail_does_not_change_keys() -> None:
    hasher = ChunkHasher(FINGERPRINT, 4)
    assert hasher.keys(list(range(8))) == hasher.keys(list(range(11)))


@pytest.mark.parametrize(
    ("max_chunks", "expected"), [(None, 5), (0, 0), (1, 1), (3, 3), (5, 5), (9, 5)]
)
def test_max_chunks(max_chunks: int | None, expected: int) -> None:
    hasher = ChunkHasher(FINGERPRINT, 3)
    tokens = list(range(17))
    full = hasher.keys(tokens)
    keys = hasher.keys(tokens, max_chunks=max_chunks)
    assert keys == full[:expected]


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(small_token_ids, max_size=40), chunk_size=st.integers(1, 8))
def test_input_types_give_same_keys(tokens: list[int], chunk_size: int) -> None:
    hasher = ChunkHasher(FINGERPRINT, chunk_size)
    expected = hasher.keys(tokens)
    variants: list[tuple[int, ...] | np.ndarray] = [
        tuple(tokens),
        np.array(tokens, dtype=np.int32),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint16),
        np.array(tokens, dtype=">i8"),
        np.repeat(np.array(tokens, dtype=np.int64), 2)[::2],  # a non-contiguous view
    ]
    for variant in variants:
        assert hasher.keys(variant) == expected, type(variant)


def test_input_array_is_not_modified() -> None:
    arr = np.array([3, 1, 2, 5], dtype=np.int32)
    ChunkHasher(FINGERPRINT, 2).keys(arr)
    assert arr.tolist() == [3, 1, 2, 5]
    assert arr.dtype == np.int32


def test_large_ids_within_int64() -> None:
    hasher = ChunkHasher(FINGERPRINT, 2)
    tokens = [2**63 - 1, 0]
    assert hasher.keys(tokens) == hasher.keys(np.array(tokens, dtype=np.uint64))
    assert hasher.keys(tokens) == reference_keys(FINGERPRINT, 2, tokens)


def test_salts_are_disjoint() -> None:
    hasher = ChunkHasher(FINGERPRINT, 2)
    tokens = list(range(10))
    keysets = [set(hasher.keys(tokens, salt)) for salt in (None, "", b"", "a", b"a", "b")]
    for i, a in enumerate(keysets):
        assert len(a) == 5
        for b in keysets[i + 1 :]:
            assert a.isdisjoint(b)


def test_bytes_like_salts_agree() -> None:
    hasher = ChunkHasher(FINGERPRINT, 2)
    tokens = list(range(6))
    expected = hasher.keys(tokens, b"ten")
    assert hasher.keys(tokens, bytearray(b"ten")) == expected  # type: ignore[arg-type]
    assert hasher.keys(tokens, memoryview(b"ten")) == expected  # type: ignore[arg-type]


def test_bad_salt_type() -> None:
    with pytest.raises(TokenError, match="salt"):
        ChunkHasher(FINGERPRINT, 2).keys([1, 2], 5)  # type: ignore[arg-type]


def test_fingerprints_are_disjoint() -> None:
    tokens = list(range(12))
    a = set(ChunkHasher(FINGERPRINT, 3).keys(tokens))
    b = set(ChunkHasher(bytes(16), 3).keys(tokens))
    assert len(a) == len(b) == 4
    assert a.isdisjoint(b)


def test_layouts_are_disjoint() -> None:
    tokens = list(range(32))
    base = KVLayout(model="m", num_layers=2, num_kv_heads=1, head_size=4, chunk_size=8)
    other = KVLayout(model="m", num_layers=2, num_kv_heads=1, head_size=4, chunk_size=8, tp_size=2)
    a = ChunkHasher(base.fingerprint, base.chunk_size).keys(tokens)
    b = ChunkHasher(other.fingerprint, other.chunk_size).keys(tokens)
    assert set(a).isdisjoint(b)


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(small_token_ids, max_size=60),
    chunk_size=st.integers(1, 8),
    salt=salts,
    data=st.data(),
)
def test_prefix_property(
    tokens: list[int], chunk_size: int, salt: str | bytes | None, data: st.DataObject
) -> None:
    hasher = ChunkHasher(FINGERPRINT, chunk_size)
    full = hasher.keys(tokens, salt)
    k = data.draw(st.integers(0, len(full)))
    assert hasher.keys(tokens[: k * chunk_size], salt) == full[:k]


def test_changing_one_token_changes_its_chunk_and_all_later() -> None:
    hasher = ChunkHasher(FINGERPRINT, 4)
    tokens = list(range(16))
    changed = list(tokens)
    changed[5] += 1000
    a, b = hasher.keys(tokens), hasher.keys(changed)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


@pytest.mark.parametrize(
    "tokens",
    [
        np.zeros((2, 4), dtype=np.int64),
        [[1, 2], [3, 4]],
        [1.0, 2.0],
        [1, 2.5],
        np.array([1.0, 2.0]),
        np.array([True, False]),
        [5, True, 7],
        (0, False),
        [1, -1],
        np.array([0, -5], dtype=np.int32),
        ["a", "b"],
        "abcd",
        np.array([2**63], dtype=np.uint64),
        [2**63],
        np.int64(5),
    ],
    ids=[
        "2d-array",
        "nested-list",
        "float-list",
        "mixed-list",
        "float-array",
        "bool-array",
        "bool-in-list",
        "bool-in-tuple",
        "negative-list",
        "negative-array",
        "str-list",
        "str",
        "uint64-too-big",
        "int-too-big",
        "scalar",
    ],
)
def test_bad_tokens(tokens: object) -> None:
    with pytest.raises(TokenError):
        ChunkHasher(FINGERPRINT, 2).keys(tokens)  # type: ignore[arg-type]
    with pytest.raises(TokenError):
        as_token_array(tokens)  # type: ignore[arg-type]


def test_as_token_array() -> None:
    arr = as_token_array(np.array([1, 2, 3], dtype=np.uint8))
    assert arr.dtype == np.dtype("<i8")
    assert arr.flags.c_contiguous
    assert arr.tolist() == [1, 2, 3]
    assert as_token_array([]).shape == (0,)
    assert as_token_array(()).dtype == np.dtype("<i8")
    assert as_token_array(range(4)).tolist() == [0, 1, 2, 3]


def test_keys_are_deterministic_across_processes(
    cross_process_results: dict[str, dict[str, Any]],
) -> None:
    layout = KVLayout(**DET_LAYOUT)
    keys = ChunkHasher(layout.fingerprint, layout.chunk_size).keys(DET_TOKENS, salt=DET_SALT)
    expected = {"fingerprint": layout.fingerprint.hex(), "keys": [k.hex() for k in keys]}
    assert len(expected["keys"]) == 4
    assert set(cross_process_results) == set(HASH_SEEDS)
    for seed, result in cross_process_results.items():
        assert result["fingerprint"] == expected["fingerprint"], seed
        assert result["keys"] == expected["keys"], seed
