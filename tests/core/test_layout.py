"""Tests of `kvtiers.core.layout`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import DTYPE_SIZES, KVLayout
from tests.core._cross_process import GOLDEN_LAYOUT


def make_layout(**overrides: Any) -> KVLayout:
    values: dict[str, Any] = {
        "model": "test-model",
        "num_layers": 4,
        "num_kv_heads": 2,
        "head_size": 8,
        "dtype": "bfloat16",
        "chunk_size": 16,
    }
    values.update(overrides)
    return KVLayout(**values)


def test_defaults() -> None:
    layout = KVLayout(model="m", num_layers=1, num_kv_heads=1, head_size=1)
    assert (layout.dtype, layout.chunk_size, layout.kind) == ("bfloat16", 256, "mha")
    assert (layout.model_revision, layout.tp_rank, layout.tp_size) == ("", 0, 1)


def test_sizes_mha() -> None:
    layout = make_layout(num_layers=32, num_kv_heads=8, head_size=128, chunk_size=256)
    assert layout.num_kv == 2
    assert layout.itemsize == 2
    assert layout.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert layout.chunk_bytes == 32 * 2 * 8 * 128 * 2 * 256
    assert layout.layer_bytes == 2 * 8 * 128 * 2 * 256
    assert layout.kv_shape(5) == (32, 2, 5, 8, 128)
    assert layout.chunk_shape() == (32, 2, 256, 8, 128)


def test_sizes_mla() -> None:
    layout = make_layout(
        kind="mla", num_layers=61, num_kv_heads=1, head_size=576, dtype="float8_e4m3fn"
    )
    assert layout.num_kv == 1
    assert layout.itemsize == 1
    assert layout.bytes_per_token == 61 * 576
    assert layout.chunk_bytes == 61 * 576 * 16
    assert layout.layer_bytes == 576 * 16
    assert layout.kv_shape(3) == (61, 1, 3, 576)
    assert layout.chunk_shape() == (61, 1, 16, 576)


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_chunk_shape_matches_chunk_bytes(dtype: str, kind: str) -> None:
    layout = make_layout(dtype=dtype, kind=kind, num_kv_heads=1 if kind == "mla" else 4)
    assert math.prod(layout.chunk_shape()) * layout.itemsize == layout.chunk_bytes
    assert layout.layer_bytes * layout.num_layers == layout.chunk_bytes
    assert layout.bytes_per_token * layout.chunk_size == layout.chunk_bytes


def test_kv_shape_zero_tokens() -> None:
    assert make_layout().kv_shape(0) == (4, 2, 0, 2, 8)


def test_fingerprint_is_stable() -> None:
    a = make_layout().fingerprint
    b = make_layout().fingerprint
    assert a == b
    assert isinstance(a, bytes)
    assert len(a) == 16
    assert make_layout() == make_layout()
    assert hash(make_layout()) == hash(make_layout())


# NOTE: a golden value. Entries in shared tiers (lmdb, remote) are keyed by this fingerprint, so
# it must not change by accident; change the fingerprint's input only together with
# _FINGERPRINT_VERSION, and update this value in the same commit.
GOLDEN_FINGERPRINT = "432a0fda606b38e10c895e94971365be"


def test_fingerprint_golden_value() -> None:
    assert KVLayout(**GOLDEN_LAYOUT).fingerprint.hex() == GOLDEN_FINGERPRINT


def test_fingerprint_is_stable_across_processes(
    cross_process_results: dict[str, dict[str, Any]],
) -> None:
    for seed, result in cross_process_results.items():
        assert result["golden_fingerprint"] == GOLDEN_FINGERPRINT, seed


# Each variant differs from its base in exactly one field.
_FIELD_VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "model": ({}, {"model": "other-model"}),
    "model_revision": ({}, {"model_revision": "rev2"}),
    "num_layers": ({}, {"num_layers": 5}),
    "num_kv_heads": ({}, {"num_kv_heads": 4}),
    "head_size": ({}, {"head_size": 16}),
    # float16 and bfloat16 have the same size: the dtype itself must reach the fingerprint.
    "dtype": ({}, {"dtype": "float16"}),
    "chunk_size": ({}, {"chunk_size": 32}),
    "kind": ({"num_kv_heads": 1}, {"num_kv_heads": 1, "kind": "mla"}),
    "tp_rank": ({"tp_size": 2}, {"tp_size": 2, "tp_rank": 1}),
    "tp_size": ({}, {"tp_size": 2}),
}


def test_variants_cover_every_field() -> None:
    assert set(_FIELD_VARIANTS) == {f.name for f in dataclasses.fields(KVLayout)}


@pytest.mark.parametrize("field", sorted(_FIELD_VARIANTS))
def test_fingerprint_changes_with_each_field(field: str) -> None:
    base_overrides, changed_overrides = _FIELD_VARIANTS[field]
    base = make_layout(**base_overrides)
    changed = make_layout(**changed_overrides)
    assert getattr(base, field) != getattr(changed, field)
    assert base.fingerprint != changed.fingerprint


def test_fingerprints_pairwise_distinct() -> None:
    layouts = {make_layout()} | {make_layout(**v) for _, v in _FIELD_VARIANTS.values()}
    layouts |= {make_layout(**b) for b, _ in _FIELD_VARIANTS.values()}
    fingerprints = {layout.fingerprint for layout in layouts}
    assert len(fingerprints) == len(layouts)


def test_layout_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_layout().num_layers = 3  # type: ignore[misc]


_INT_FIELDS = ["num_layers", "num_kv_heads", "head_size", "chunk_size", "tp_size"]


@pytest.mark.parametrize("field", _INT_FIELDS)
@pytest.mark.parametrize("value", [0, -1, True, 1.5, 2.0, "3", None])
def test_invalid_ints(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^layout\.{field}:"):
        make_layout(**{field: value})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"tp_rank": -1}, "tp_rank"),
        ({"tp_rank": 1}, "tp_rank"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"tp_rank": False}, "tp_rank"),
        ({"dtype": "float64"}, "dtype"),
        ({"dtype": "bf16"}, "dtype"),
        ({"dtype": ["bfloat16"]}, "dtype"),
        ({"dtype": None}, "dtype"),
        ({"kind": "gqa"}, "kind"),
        ({"kind": None}, "kind"),
        ({"kind": "mla", "num_kv_heads": 2}, "num_kv_heads"),
        ({"model": ""}, "model"),
        ({"model": 3}, "model"),
        ({"model": None}, "model"),
        ({"model_revision": None}, "model_revision"),
        ({"model_revision": 2}, "model_revision"),
    ],
)
def test_invalid_values_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^layout\.{field}:"):
        make_layout(**overrides)


def test_tensor_parallel_shard_ok() -> None:
    layout = make_layout(tp_rank=3, tp_size=4)
    assert (layout.tp_rank, layout.tp_size) == (3, 4)


def test_from_dict() -> None:
    data = {"model": "m", "num_layers": 2, "num_kv_heads": 1, "head_size": 4, "dtype": "float16"}
    layout = KVLayout.from_dict(data)
    assert layout == KVLayout(model="m", num_layers=2, num_kv_heads=1, head_size=4, dtype="float16")


def test_from_dict_unknown_key() -> None:
    data = {"model": "m", "num_layers": 2, "num_kv_heads": 1, "head_size": 4, "heads": 3}
    with pytest.raises(ConfigError, match=r"^layout\.heads: unknown key"):
        KVLayout.from_dict(data)
    with pytest.raises(ConfigError, match=r"^engine\.layout\.heads: unknown key"):
        KVLayout.from_dict(data, where="engine.layout")


def test_from_dict_keys_of_mixed_types_name_the_stray_one() -> None:
    data = {"model": "m", "num_layers": 2, "num_kv_heads": 1, "head_size": 4, 1: 0}
    with pytest.raises(ConfigError, match=r"^layout\.1: unknown key"):
        KVLayout.from_dict(data)


@pytest.mark.parametrize("name", ["num_layers", "chunk_size", "tp_size"])
def test_dimensions_past_32_bits_are_refused(name: str) -> None:
    data = {"model": "m", "num_layers": 2, "num_kv_heads": 1, "head_size": 4, name: 2**64}
    with pytest.raises(ConfigError, match=rf"^layout\.{name}: expected an integer in"):
        KVLayout.from_dict(data)


@pytest.mark.parametrize("missing", ["model", "num_layers", "num_kv_heads", "head_size"])
def test_from_dict_missing_key(missing: str) -> None:
    data = {"model": "m", "num_layers": 2, "num_kv_heads": 1, "head_size": 4}
    del data[missing]
    with pytest.raises(ConfigError, match=rf"^layout\.{missing}: required key is missing"):
        KVLayout.from_dict(data)


def test_from_dict_invalid_value() -> None:
    data = {"model": "m", "num_layers": 0, "num_kv_heads": 1, "head_size": 4}
    with pytest.raises(ConfigError, match=r"^layout\.num_layers:"):
        KVLayout.from_dict(data)
