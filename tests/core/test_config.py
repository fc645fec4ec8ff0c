"""Tests of config loading and validation (`kvtiers.core.config`)."""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from kvtiers.core.config import (
    CacheConfig,
    TierConfig,
    format_size,
    load_config,
    parse_size,
)
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout

LAYOUT: dict[str, Any] = {"model": "m", "num_layers": 32, "num_kv_heads": 8, "head_size": 128}


def config(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "layout": dict(LAYOUT),
        "tiers": [{"kind": "dram", "capacity": "16GiB"}],
    }
    data.update(overrides)
    return data


def raises_at(field: str) -> pytest.RaisesExc[ConfigError]:
    """Expect a ConfigError whose message starts with the path of `field`."""
    return pytest.raises(ConfigError, match="^" + re.escape(field) + ":")


# --- parse_size ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (1, 1),
        (123456789, 123456789),
        ("0", 0),
        ("42", 42),
        ("42B", 42),
        ("16GiB", 16 * 2**30),
        ("16gib", 16 * 2**30),
        ("16GIB", 16 * 2**30),
        ("512MB", 512 * 10**6),
        ("512 MB", 512 * 10**6),
        ("1.5 GiB", 3 * 2**29),
        ("  2TiB  ", 2 * 2**40),
        ("10k", 10 * 2**10),
        ("10K", 10 * 2**10),
        ("3m", 3 * 2**20),
        ("1g", 2**30),
        ("1t", 2**40),
        ("4kb", 4000),
        ("4KiB", 4096),
        ("2MiB", 2 * 2**20),
        ("7GB", 7 * 10**9),
        ("1TB", 10**12),
    ],
)
def test_parse_size(value: object, expected: int) -> None:
    assert parse_size(value, where="x") == expected


@pytest.mark.parametrize(
    "value",
    [
        "lots",
        -1,
        True,
        False,
        "5XB",
        "",
        "GiB",
        "-1GiB",
        "1e9",
        "1,000",
        "1.5.2GiB",
        1.5,
        None,
        [1],
        2**61,
        "1" * 400,
        "9" * 320 + "TB",
        "2000000EiB",
    ],
)
def test_parse_size_rejects(value: object) -> None:
    with raises_at("tiers[2].capacity"):
        parse_size(value, where="tiers[2].capacity")


# --- format_size --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (3 * 2**29, "1.50 GiB"),
        (16 * 2**30, "16.00 GiB"),
        (2**40, "1.00 TiB"),
        (2**50, "1024.00 TiB"),
    ],
)
def test_format_size(num_bytes: int, expected: str) -> None:
    assert format_size(num_bytes) == expected


@pytest.mark.parametrize("text", ["16GiB", "1.5 GiB", "3MiB", "1TiB", "512 B"])
def test_format_size_round_trips(text: str) -> None:
    num_bytes = parse_size(text, where="x")
    assert parse_size(format_size(num_bytes), where="x") == num_bytes


# --- load_config from a dict --------------------------------------------------------------


def test_load_from_dict() -> None:
    cfg = load_config(
        {
            "layout": dict(LAYOUT, dtype="float16", chunk_size=128),
            "tiers": [
                {"kind": "dram", "capacity": "16GiB", "eviction": "arc"},
                {
                    "kind": "lmdb",
                    "name": "nvme",
                    "path": "/nvme/kvtiers",
                    "capacity": "1TiB",
                    "write_policy": "write_back",
                },
            ],
            "write_queue_chunks": 64,
            "concurrent_reads": False,
            "copy_threads": 3,
        }
    )
    assert isinstance(cfg, CacheConfig)
    assert cfg.concurrent_reads is False
    assert cfg.copy_threads == 3
    assert cfg.layout == KVLayout(**LAYOUT, dtype="float16", chunk_size=128)
    assert cfg.write_queue_chunks == 64
    dram, lmdb = cfg.tiers
    assert dram == TierConfig(
        kind="dram", capacity_bytes=16 * 2**30, name="dram", eviction="arc", index=0
    )
    assert dram.write_policy == "write_through"
    assert dram.options == {}
    assert dram.where == "tiers[0]"
    assert (lmdb.kind, lmdb.name, lmdb.capacity_bytes) == ("lmdb", "nvme", 2**40)
    assert (lmdb.eviction, lmdb.write_policy, lmdb.index) == ("lru", "write_back", 1)
    assert lmdb.where == "tiers[1]"


def test_defaults_and_no_layout() -> None:
    cfg = load_config({"tiers": [{"kind": "hbm", "capacity": 1024}]})
    assert cfg.layout is None
    assert cfg.write_queue_chunks == 256
    assert cfg.concurrent_reads is True
    assert cfg.copy_threads == 0  # the usable cores, at most 4
    assert cfg.tiers[0].capacity_bytes == 1024


def test_kind_specific_keys_go_to_options() -> None:
    tier = {
        "kind": "remote",
        "capacity": "1TiB",
        "url": "s3://kv-pool/prod",
        "storage_options": {"endpoint_url": "http://127.0.0.1:9000"},
        "timeout_s": 2.5,
    }
    (cfg_tier,) = load_config(config(tiers=[tier])).tiers
    assert dict(cfg_tier.options) == {
        "url": "s3://kv-pool/prod",
        "storage_options": {"endpoint_url": "http://127.0.0.1:9000"},
        "timeout_s": 2.5,
    }
    assert isinstance(cfg_tier.options, MappingProxyType)
    with pytest.raises(TypeError):
        cfg_tier.options["url"] = "x"  # type: ignore[index]


def test_with_layout() -> None:
    cfg = load_config({"tiers": [{"kind": "dram", "capacity": 1}], "write_queue_chunks": 8})
    layout = KVLayout(**LAYOUT)
    new = cfg.with_layout(layout)
    assert new.layout == layout
    assert (new.tiers, new.write_queue_chunks) == (cfg.tiers, 8)
    assert cfg.layout is None


def test_input_dict_is_not_modified() -> None:
    data = config()
    snapshot = repr(data)
    load_config(data)
    assert repr(data) == snapshot


# --- every error names the bad field ------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"layout": dict(LAYOUT)}, "tiers"),
        (config(tiers=[]), "tiers"),
        (config(tiers={"kind": "dram", "capacity": 1}), "tiers"),
        (config(tiers=["dram"]), "tiers[0]"),
        (config(tiers=[{"capacity": "1GiB"}]), "tiers[0].kind"),
        (config(tiers=[{"kind": "", "capacity": "1GiB"}]), "tiers[0].kind"),
        (config(tiers=[{"kind": 3, "capacity": "1GiB"}]), "tiers[0].kind"),
        (config(tiers=[{"kind": "dram", "capacity": 1}, {"kind": "lmdb"}]), "tiers[1].capacity"),
        (config(tiers=[{"kind": "dram", "capacity": 0}]), "tiers[0].capacity"),
        (config(tiers=[{"kind": "dram", "capacity": "0GiB"}]), "tiers[0].capacity"),
        (config(tiers=[{"kind": "dram", "capacity": "lots"}]), "tiers[0].capacity"),
        (config(tiers=[{"kind": "dram", "capacity": -5}]), "tiers[0].capacity"),
        (
            config(tiers=[{"kind": "dram", "capacity": 1, "write_policy": "write_around"}]),
            "tiers[0].write_policy",
        ),
        (
            config(tiers=[{"kind": "dram", "capacity": 1, "write_policy": None}]),
            "tiers[0].write_policy",
        ),
        (config(tiers=[{"kind": "dram", "capacity": 1, "eviction": 3}]), "tiers[0].eviction"),
        (config(tiers=[{"kind": "dram", "capacity": 1, "name": ""}]), "tiers[0].name"),
        (config(tiers=[{"kind": "dram", "capacity": 1, "name": 7}]), "tiers[0].name"),
        (
            config(
                tiers=[
                    {"kind": "dram", "capacity": 1, "name": "fast"},
                    {"kind": "lmdb", "capacity": 1, "name": "slow"},
                    {"kind": "remote", "capacity": 1, "name": "fast"},
                ]
            ),
            "tiers[2].name",
        ),
        (config(cache={}), "cache"),
        (config(tier=[]), "tier"),
        (config(write_queue_chunks=0), "write_queue_chunks"),
        (config(write_queue_chunks=True), "write_queue_chunks"),
        (config(write_queue_chunks="8"), "write_queue_chunks"),
        (config(concurrent_reads="no"), "concurrent_reads"),
        (config(concurrent_reads=0), "concurrent_reads"),
        (config(copy_threads=-1), "copy_threads"),
        (config(copy_threads=257), "copy_threads"),
        (config(copy_threads=2.0), "copy_threads"),
        (config(copy_threads=True), "copy_threads"),
        (config(layout="m"), "layout"),
        (config(layout=None), "layout"),
        (config(layout=dict(LAYOUT, num_layers=0)), "layout.num_layers"),
        (config(layout=dict(LAYOUT, head_size="128")), "layout.head_size"),
        (config(layout=dict(LAYOUT, dtype="float64")), "layout.dtype"),
        (config(layout=dict(LAYOUT, dtype=["bfloat16"])), "layout.dtype"),
        (config(layout=dict(LAYOUT, kind="gqa")), "layout.kind"),
        (config(layout=dict(LAYOUT, tp_rank=1)), "layout.tp_rank"),
        (config(layout=dict(LAYOUT, heads=8)), "layout.heads"),
        (config(layout={"model": "m", "num_layers": 1, "num_kv_heads": 1}), "layout.head_size"),
    ],
)
def test_error_names_field(data: dict[str, Any], field: str) -> None:
    with raises_at(field):
        load_config(data)


def test_layout_error_comes_before_tier_error() -> None:
    with raises_at("layout.num_layers"):
        load_config(config(layout=dict(LAYOUT, num_layers=-1), tiers=[]))


def test_default_names_collide() -> None:
    # Two tiers of one kind need explicit names; the default name is the kind.
    data = config(tiers=[{"kind": "dram", "capacity": 1}, {"kind": "dram", "capacity": 2}])
    with raises_at("tiers[1].name"):
        load_config(data)
    data["tiers"][1]["name"] = "dram2"
    assert [t.name for t in load_config(data).tiers] == ["dram", "dram2"]


# --- files --------------------------------------------------------------------------------

_TOML = """
write_queue_chunks = 32

[layout]
model = "my-model"
num_layers = 32
num_kv_heads = 8
head_size = 128
dtype = "bfloat16"
chunk_size = 256

[[tiers]]
kind = "dram"
capacity = "16GiB"
eviction = "arc"

[[tiers]]
kind = "lmdb"
path = "/nvme/kvtiers"
capacity = "1TiB"
eviction = "lru"
write_policy = "write_back"

[[tiers]]
kind = "remote"
url = "s3://kv-pool/prod"
capacity = "10TiB"
storage_options = { endpoint_url = "http://127.0.0.1:9000" }
write_policy = "write_through"
"""

_YAML = """
write_queue_chunks: 32
layout:
  model: my-model
  num_layers: 32
  num_kv_heads: 8
  head_size: 128
  dtype: bfloat16
  chunk_size: 256
tiers:
  - kind: dram
    capacity: 16GiB
    eviction: arc
  - kind: lmdb
    path: /nvme/kvtiers
    capacity: 1TiB
    eviction: lru
    write_policy: write_back
  - kind: remote
    url: s3://kv-pool/prod
    capacity: 10TiB
    storage_options:
      endpoint_url: http://127.0.0.1:9000
    write_policy: write_through
"""


def _check_example(cfg: CacheConfig) -> None:
    assert cfg.layout == KVLayout(
        model="my-model", num_layers=32, num_kv_heads=8, head_size=128, chunk_size=256
    )
    assert cfg.write_queue_chunks == 32
    assert [t.kind for t in cfg.tiers] == ["dram", "lmdb", "remote"]
    assert [t.capacity_bytes for t in cfg.tiers] == [16 * 2**30, 2**40, 10 * 2**40]
    assert [t.write_policy for t in cfg.tiers] == ["write_through", "write_back", "write_through"]
    assert dict(cfg.tiers[1].options) == {"path": "/nvme/kvtiers"}
    assert dict(cfg.tiers[2].options) == {
        "url": "s3://kv-pool/prod",
        "storage_options": {"endpoint_url": "http://127.0.0.1:9000"},
    }


def test_load_toml(tmp_path: Path) -> None:
    path = tmp_path / "kvtiers.toml"
    path.write_text(_TOML, encoding="utf-8")
    _check_example(load_config(path))
    _check_example(load_config(str(path)))


def test_load_file_without_suffix_is_toml(tmp_path: Path) -> None:
    path = tmp_path / "kvtiers"
    path.write_text(_TOML, encoding="utf-8")
    _check_example(load_config(path))


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".YAML"])
def test_load_yaml(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / f"kvtiers{suffix}"
    path.write_text(_YAML, encoding="utf-8")
    _check_example(load_config(path))


def test_toml_and_yaml_agree(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    (tmp_path / "a.toml").write_text(_TOML, encoding="utf-8")
    (tmp_path / "a.yaml").write_text(_YAML, encoding="utf-8")
    assert load_config(tmp_path / "a.toml") == load_config(tmp_path / "a.yaml")


def test_file_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(_TOML.replace('capacity = "1TiB"', 'capacity = "1 lots"'), encoding="utf-8")
    with raises_at("tiers[1].capacity"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with raises_at("config") as info:
        load_config(tmp_path / "missing.toml")
    assert "cannot read" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


def test_directory_is_unreadable(tmp_path: Path) -> None:
    with raises_at("config"):
        load_config(tmp_path)


def test_unparseable_toml(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[layout\nmodel = ", encoding="utf-8")
    with raises_at("config") as info:
        load_config(path)
    assert "cannot parse" in str(info.value)


def test_unparseable_yaml(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "broken.yaml"
    path.write_text("tiers: [\n  - kind: dram\n", encoding="utf-8")
    with raises_at("config") as info:
        load_config(path)
    assert "cannot parse" in str(info.value)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "", "just a string\n"])
def test_yaml_top_level_must_be_a_table(tmp_path: Path, text: str) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "list.yaml"
    path.write_text(text, encoding="utf-8")
    with raises_at("config"):
        load_config(path)


def test_unknown_suffix(tmp_path: Path) -> None:
    path = tmp_path / "kvtiers.json"
    path.write_text("{}", encoding="utf-8")
    with raises_at("config"):
        load_config(path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[layout]\nmodel = "caf\xe9"\n')
    with raises_at("config"):
        load_config(path)


def test_keys_of_mixed_types_name_the_stray_one() -> None:
    base = {"layout": LAYOUT, "tiers": [{"kind": "dram", "capacity": "1MiB"}]}
    with raises_at("1"):
        load_config({**base, 1: 0, "x": 0})


@pytest.mark.parametrize("events", [2**31, 2**63, -1])
def test_events_out_of_range(events: int) -> None:
    base = {"layout": LAYOUT, "tiers": [{"kind": "dram", "capacity": "1MiB"}]}
    with raises_at("events"):
        load_config({**base, "events": events})
