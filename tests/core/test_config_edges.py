"""Nasty inputs to config loading: each one a typed error naming the field, or a value kept.

Hand-picked cases first (huge integers, deep nesting, bools, unicode digits, BOMs, duplicate
YAML keys, files that never end), then Hypothesis: random junk at every level is refused
with a `ConfigError` only, and every accepted config round-trips through TOML, YAML and
the dataclasses unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtiers.core import checks
from kvtiers.core.config import (
    CacheConfig,
    MetricsConfig,
    TierConfig,
    load_config,
    parse_size,
)
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from tests._hostile import deep_dict, deep_list

LAYOUT: dict[str, Any] = {"model": "m", "num_layers": 2, "num_kv_heads": 2, "head_size": 8}
HUGE = 10**5000  # past Python's 4,300-digit limit on int-to-str conversion


def config(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"layout": dict(LAYOUT), "tiers": [{"kind": "dram", "capacity": 1}]}
    data.update(overrides)
    return data


def tier(**overrides: Any) -> dict[str, Any]:
    return config(tiers=[{"kind": "dram", "capacity": "1MiB", **overrides}])


def raises_at(field: str) -> pytest.RaisesExc[ConfigError]:
    return pytest.raises(ConfigError, match="^" + re.escape(field) + ":")


# --- describe: the value in an error message --------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, "5"),
        ("lots", "'lots'"),
        (True, "True"),
        (None, "None"),
        (1.5, "1.5"),
        ([1, 2], "[1, 2]"),
    ],
)
def test_describe_small_values_as_repr(value: object, expected: str) -> None:
    assert checks.describe(value) == expected


@pytest.mark.parametrize(
    "value",
    [HUGE, -HUGE, [HUGE], {"a": HUGE}, deep_list(50_000), deep_dict(50_000), "x" * 10**6],
    ids=["huge", "-huge", "[huge]", "{huge}", "deep-list", "deep-dict", "long-str"],
)
def test_describe_is_short_and_never_raises(value: object) -> None:
    text = checks.describe(value)
    assert 0 < len(text) <= 80


def test_describe_names_a_huge_integer_by_its_size() -> None:
    assert "digits" in checks.describe(HUGE)


def test_describe_a_self_referential_list() -> None:
    loop: list[Any] = []
    loop.append(loop)
    assert checks.describe(loop).startswith("[")


def test_describe_an_object_whose_repr_raises() -> None:
    class Bad:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert "Bad" in checks.describe(Bad())


# --- values that broke the error message itself ------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (config(events=HUGE), "events"),
        (config(write_queue_chunks=deep_list(50_000)), "write_queue_chunks"),
        (config(concurrent_reads=deep_list(50_000)), "concurrent_reads"),
        (config(metrics={"port": HUGE}), "metrics.port"),
        (config(metrics={"port": 80, "host": deep_list(50_000)}), "metrics.host"),
        (tier(capacity=HUGE), "tiers[0].capacity"),
        (tier(write_policy=deep_dict(50_000)), "tiers[0].write_policy"),
        (tier(name=deep_list(50_000)), "tiers[0].name"),
        (config(layout=dict(LAYOUT, num_layers=HUGE)), "layout.num_layers"),
        (config(layout=dict(LAYOUT, dtype=deep_list(50_000))), "layout.dtype"),
        (config(layout=dict(LAYOUT, model=deep_list(50_000))), "layout.model"),
        (config(layout=dict(LAYOUT, kind=deep_dict(50_000))), "layout.kind"),
    ],
)
def test_huge_and_deep_values_name_the_field(data: dict[str, Any], field: str) -> None:
    with raises_at(field):
        load_config(data)


def test_a_chunk_past_1_eib_is_refused_at_load() -> None:
    # Each dimension is within 32 bits, their product is not within 64: the fingerprint
    # could not even be packed.
    big = dict(LAYOUT, num_layers=2**31 - 1, num_kv_heads=2**31 - 1, head_size=2**31 - 1)
    with raises_at("layout.chunk_size"):
        load_config(config(layout=big))


def test_the_largest_chunk_within_1_eib_is_kept() -> None:
    # 2**60 bytes: 2**22 layers x 2 x 2**21 heads x 2**13 x 2 bytes x 2**2 tokens.
    layout = dict(LAYOUT, num_layers=2**22, num_kv_heads=2**21, head_size=2**13, chunk_size=4)
    cfg = load_config(config(layout=layout))
    assert cfg.layout is not None and cfg.layout.chunk_bytes == 2**60
    with raises_at("layout.chunk_size"):
        load_config(config(layout=dict(layout, chunk_size=5)))


@pytest.mark.parametrize("depth", [0, 2**31])
def test_write_queue_chunks_is_bounded(depth: int) -> None:
    with raises_at("write_queue_chunks"):
        load_config(config(write_queue_chunks=depth))


def test_write_queue_chunks_bounds_are_kept() -> None:
    assert load_config(config(write_queue_chunks=1)).write_queue_chunks == 1
    assert load_config(config(write_queue_chunks=2**31 - 1)).write_queue_chunks == 2**31 - 1


# --- sizes: exact, ASCII, no silent rounding --------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (str(2**60 - 1), 2**60 - 1),  # a float would make it 2**60
        (str(2**53 + 1), 2**53 + 1),
        ("9007199254740993B", 2**53 + 1),
        ("0.1KB", 100),  # 0.1 is not exact in binary: 100.00000000000001 or 99.99...
        ("1.1MB", 1_100_000),
        ("0.3GB", 300_000_000),
        ("1.5", 1),  # a fraction of a byte is dropped
        ("1048576.9B", 1_048_576),
        ("00016GiB", 16 * 2**30),
        ("0" * 5000 + "1", 1),  # leading zeros are no digits past any limit
        ("1024TiB", 2**50),
        ("1048576TiB", 2**60),
    ],
)
def test_parse_size_is_exact(text: str, expected: int) -> None:
    assert parse_size(text, where="x") == expected


@pytest.mark.parametrize(
    "text",
    [
        "١٦GiB",  # Arabic-Indic digits
        "１６GiB",  # full-width digits
        "16\u00a0GiB",  # a no-break space is not a separator
        "16\uff27iB",  # a full-width G
        "1048577TiB",
        str(2**60 + 1),
        "1." + "0" * 5000 + "1GiB",
        "1" * 5000,
        "1e3",
        "5%",
        "16GiB/s",
        "+16GiB",
        ".5GiB",
        "5.GiB",
        "NaN",
        "inf",
        "",
        "   ",
    ],
)
def test_parse_size_refuses(text: str) -> None:
    with raises_at("x"):
        parse_size(text, where="x")


@pytest.mark.parametrize(
    "value",
    [True, False, 1.0, 1024.0, math.nan, math.inf, -1, HUGE],
    ids=lambda v: type(v).__name__,
)
def test_capacity_of_another_type_is_refused(value: object) -> None:
    with raises_at("tiers[0].capacity"):
        load_config(tier(capacity=value))


# --- the dataclasses validate themselves ----------------------------------------------


LAYOUT_OBJ = KVLayout(**LAYOUT)
DRAM = TierConfig("dram", 2**20)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: TierConfig("", 1), "tiers[0].kind"),
        (lambda: TierConfig(3, 1), "tiers[0].kind"),  # type: ignore[arg-type]
        (lambda: TierConfig("dram", "1GiB"), "tiers[0].capacity"),  # type: ignore[arg-type]
        (lambda: TierConfig("dram", True), "tiers[0].capacity"),
        (lambda: TierConfig("dram", -1, index=2), "tiers[2].capacity"),
        (lambda: TierConfig("dram", 2**61), "tiers[0].capacity"),
        (lambda: TierConfig("dram", 1, name=5), "tiers[0].name"),  # type: ignore[arg-type]
        (lambda: TierConfig("dram", 1, eviction=None), "tiers[0].eviction"),  # type: ignore[arg-type]
        (lambda: TierConfig("dram", 1, write_policy="x"), "tiers[0].write_policy"),  # type: ignore[arg-type]
        (lambda: TierConfig("dram", 1, options=[]), "tiers[0].options"),  # type: ignore[arg-type]
        (lambda: TierConfig("dram", 1, index=-1), "tiers[?].index"),
        (lambda: TierConfig("dram", 1, index=True), "tiers[?].index"),
        (lambda: MetricsConfig(-5), "metrics.port"),
        (lambda: MetricsConfig(True), "metrics.port"),
        (lambda: MetricsConfig(80, ""), "metrics.host"),
        (lambda: CacheConfig(()), "tiers"),
        (lambda: CacheConfig([]), "tiers"),  # type: ignore[arg-type]
        (lambda: CacheConfig("dram"), "tiers"),  # type: ignore[arg-type]
        (lambda: CacheConfig(({"kind": "dram"},)), "tiers[0]"),  # type: ignore[arg-type]
        (lambda: CacheConfig((DRAM, DRAM)), "tiers[1].name"),
        (lambda: CacheConfig((DRAM,), layout={}), "layout"),  # type: ignore[arg-type]
        (lambda: CacheConfig((DRAM,), write_queue_chunks=0), "write_queue_chunks"),
        (lambda: CacheConfig((DRAM,), events=-1), "events"),
        (lambda: CacheConfig((DRAM,), events="5"), "events"),  # type: ignore[arg-type]
        (lambda: CacheConfig((DRAM,), metrics=8080), "metrics"),  # type: ignore[arg-type]
        (lambda: CacheConfig((DRAM,), concurrent_reads="no"), "concurrent_reads"),  # type: ignore[arg-type]
    ],
)
def test_dataclasses_built_directly_are_checked(make: Any, field: str) -> None:
    with raises_at(field):
        make()


def test_cache_config_numbers_its_tiers_and_keeps_a_tuple() -> None:
    lmdb = TierConfig("lmdb", 2**30, options={"path": "/x"}, index=7)
    cfg = CacheConfig([DRAM, lmdb], LAYOUT_OBJ)  # type: ignore[arg-type]
    assert cfg.tiers == (DRAM, dataclasses.replace(lmdb, index=1))
    assert [t.where for t in cfg.tiers] == ["tiers[0]", "tiers[1]"]


def test_tier_options_are_a_read_only_copy() -> None:
    options = {"path": "/x"}
    tc = TierConfig("lmdb", 1, options=options)
    options["path"] = "/y"
    assert isinstance(tc.options, MappingProxyType)
    assert dict(tc.options) == {"path": "/x"}


def test_capacity_zero_is_allowed_on_a_tier_config_built_directly() -> None:
    # The full replay sizes a tier after building it; the tier refuses it if still 0.
    assert TierConfig("dram", 0).capacity_bytes == 0


# --- files ------------------------------------------------------------------------------

_TOML = '[layout]\nmodel = "m"\nnum_layers = 2\nnum_kv_heads = 2\nhead_size = 8\n\n'
_TOML += '[[tiers]]\nkind = "dram"\ncapacity = "1MiB"\n'
_YAML = "layout: {model: m, num_layers: 2, num_kv_heads: 2, head_size: 8}\n"
_YAML += "tiers:\n  - {kind: dram, capacity: 1MiB}\n"


@pytest.mark.parametrize(("name", "text"), [("c.toml", _TOML), ("c.yaml", _YAML)])
def test_a_utf8_bom_is_accepted(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_config(path).tiers[0].capacity_bytes == 2**20


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (_YAML + "tiers:\n  - {kind: dram, capacity: 2MiB}\n", 4),
        (_YAML.replace("capacity: 1MiB", "capacity: 1MiB, capacity: 2MiB"), 3),
        (_YAML.replace("model: m,", "model: m, model: n,"), 1),
    ],
)
def test_duplicate_yaml_keys_are_refused(tmp_path: Path, text: str, line: int) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "dup.yaml"
    path.write_text(text, encoding="utf-8")
    with raises_at("config") as info:
        load_config(path)
    message = str(info.value)
    assert "duplicate key" in message and f"line {line}" in message and str(path) in message


def test_yaml_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "merge.yaml"
    merged = "- {<<: {kind: dram, capacity: 1MiB}, capacity: 2MiB}"
    path.write_text(_YAML.replace("- {kind: dram, capacity: 1MiB}", merged), encoding="utf-8")
    assert load_config(path).tiers[0].capacity_bytes == 2 * 2**20


@pytest.mark.parametrize(
    "text",
    [
        "tiers: [\n  - kind: dram\n",
        "a: b: c\n",
        "tiers:\n\t- x\n",
        "- 1\n---\n- 2\n",
        "x: !!python/object:os.system ls\n",
        "x: *nope\n",
    ],
)
def test_yaml_errors_are_one_line_naming_the_path(tmp_path: Path, text: str) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with raises_at("config") as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message and "<unicode string>" not in message


def test_field_errors_in_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(_TOML.replace('"1MiB"', '"lots"'), encoding="utf-8")
    with raises_at("tiers[0].capacity") as info:
        load_config(path)
    assert str(info.value).endswith(f"(in {path})")


def test_field_errors_of_a_dict_name_no_file() -> None:
    with raises_at("tiers[0].capacity") as info:
        load_config(tier(capacity="lots"))
    assert "(in " not in str(info.value)


def test_a_file_that_never_ends_is_refused(tmp_path: Path) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    with raises_at("config") as info:
        load_config("/dev/zero")
    assert "/dev/zero" in str(info.value)


def test_a_big_file_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text(_TOML + "#" * (17 * 2**20) + "\n", encoding="utf-8")
    with raises_at("config") as info:
        load_config(path)
    assert "MiB" in str(info.value)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.toml", "x = " + "[" * 100_000 + "]" * 100_000 + "\n"),
        ("deep.yaml", "x: " + "[" * 100_000 + "]" * 100_000 + "\n"),
        ("int.toml", _TOML + "events = " + "9" * 5000 + "\n"),
        ("int.yaml", _YAML + "events: " + "9" * 5000 + "\n"),
        ("nul.toml", _TOML + "\0\n"),
        ("utf16.toml", _TOML.encode("utf-16").decode("latin-1")),
    ],
)
def test_unparseable_files(tmp_path: Path, name: str, text: str) -> None:
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    path = tmp_path / name
    path.write_bytes(text.encode("latin-1") if name == "utf16.toml" else text.encode())
    with raises_at("config") as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_huge_integer_in_a_toml_file_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("events = " + "9" * 4000 + "\n" + _TOML, encoding="utf-8")
    with raises_at("events"):
        load_config(path)


def test_a_path_that_is_not_text_or_has_nul(tmp_path: Path) -> None:
    with raises_at("config"):
        load_config(str(tmp_path / "a\0b.toml"))
    with raises_at("config"):
        load_config(b"/etc/kvtiers.toml")  # type: ignore[arg-type]
    with raises_at("config"):
        load_config(None)  # type: ignore[arg-type]


def test_a_latin1_file_name_with_valid_content_loads(tmp_path: Path) -> None:
    path = tmp_path / "caf\udce9.toml"  # the file name is not UTF-8; its content is
    try:
        path.write_text(_TOML, encoding="utf-8")
    except (UnicodeEncodeError, OSError):
        pytest.skip("the filesystem refuses a non-UTF-8 name")
    assert load_config(path).tiers[0].kind == "dram"


# --- Hypothesis: junk anywhere is a ConfigError; what loads round-trips ------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["16GiB", "5%", "1e3", "", "lru", "arc", "dram", "write_back", "١٦"]),
)
_junk = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)

_VALID = {
    "layout": dict(LAYOUT, dtype="float16", chunk_size=16),
    "tiers": [
        {"kind": "dram", "capacity": "1MiB", "eviction": "arc"},
        {
            "kind": "lmdb",
            "name": "disk",
            "capacity": 2**30,
            "path": "/x",
            "write_policy": "write_back",
        },
    ],
    "write_queue_chunks": 8,
    "events": 4,
    "metrics": {"port": 0, "host": "127.0.0.1"},
    "concurrent_reads": False,
    "copy_threads": 2,
}


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


_ALL_PATHS = [p for p in _paths(_VALID) if p]


def _replaced(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    data = json.loads(json.dumps(data))
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(_ALL_PATHS), value=_junk)
def test_junk_anywhere_is_a_config_error_or_kept(path: tuple[Any, ...], value: Any) -> None:
    data = _replaced(_VALID, path, value)
    try:
        cfg = load_config(data)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and len(message) < 1000
        return
    # Accepted: whatever was put there is in the config, unchanged.
    assert _same(_as_dict(cfg), _normalized(data))


@settings(max_examples=200, deadline=None)
@given(extra=st.dictionaries(st.text(max_size=10), _junk, min_size=1, max_size=3))
def test_unknown_top_level_keys_are_named(extra: dict[str, Any]) -> None:
    # A key is named as it is, or quoted when long or unprintable (a message is one line).
    def shown(key: str) -> str:
        return key if len(key) <= 60 and key.isprintable() else checks.describe(key)

    unknown = sorted(shown(key) for key in set(extra) - set(_VALID))
    data = {**_VALID, **extra}
    if not unknown:
        return
    with raises_at(unknown[0]):
        load_config(data)


_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
_sizes = st.one_of(
    st.integers(min_value=1, max_value=2**60),
    st.builds(
        lambda n, unit: f"{n}{unit}",
        st.integers(min_value=1, max_value=1000),
        st.sampled_from(["", "B", "KB", "MB", "GB", "KiB", "MiB", "GiB", "k", "M", "g"]),
    ),
)
_tiers = st.lists(
    st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["dram", "hbm", "lmdb", "remote", "my_plugin"]),
            "capacity": _sizes,
        },
        optional={
            "eviction": st.sampled_from(["lru", "arc", "2q"]),
            "write_policy": st.sampled_from(["write_through", "write_back"]),
            "path": _names,
        },
    ),
    min_size=1,
    max_size=4,
).map(lambda ts: [{**t, "name": f"t{i}-{t['kind']}"} for i, t in enumerate(ts)])
_configs = st.fixed_dictionaries(
    {"tiers": _tiers},
    optional={
        "layout": st.fixed_dictionaries(
            {
                "model": _names,
                "num_layers": st.integers(1, 2**10),
                "num_kv_heads": st.integers(1, 64),
                "head_size": st.integers(1, 512),
            },
            optional={
                "dtype": st.sampled_from(["bfloat16", "float16", "float32", "int8"]),
                "chunk_size": st.integers(1, 2**12),
                "model_revision": _names,
            },
        ),
        "write_queue_chunks": st.integers(1, 2**31 - 1),
        "events": st.integers(0, 2**31 - 1),
        "concurrent_reads": st.booleans(),
        "metrics": st.fixed_dictionaries({"port": st.integers(0, 65535)}),
    },
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_configs)
def test_valid_configs_round_trip_through_toml_yaml_and_dicts(
    tmp_path: Path, data: dict[str, Any]
) -> None:
    cfg = load_config(data)
    assert _as_dict(cfg) == _normalized(data)
    assert load_config(_as_dict(cfg)) == cfg
    toml = tmp_path / "c.toml"
    toml.write_text(_to_toml(data), encoding="utf-8")
    assert load_config(toml) == cfg
    yaml = pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    # NOTE: escaped, since PyYAML writes U+0085 (NEL) raw with allow_unicode and then
    # reads it back as a line break, folded to a space: the dumper's quirk, not the loader's.
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert load_config(path) == cfg


def _as_dict(cfg: CacheConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tiers": [
            {
                "kind": t.kind,
                "name": t.name,
                "capacity": t.capacity_bytes,
                "eviction": t.eviction,
                "write_policy": t.write_policy,
                **t.options,
            }
            for t in cfg.tiers
        ],
        "write_queue_chunks": cfg.write_queue_chunks,
        "events": cfg.events,
        "concurrent_reads": cfg.concurrent_reads,
    }
    if cfg.layout is not None:
        out["layout"] = cfg.layout.to_dict()
    if cfg.metrics is not None:
        out["metrics"] = {"port": cfg.metrics.port, "host": cfg.metrics.host}
    return out


def _normalized(data: dict[str, Any]) -> dict[str, Any]:
    """Return `data` with the defaults filled in and sizes in bytes."""
    out: dict[str, Any] = {
        "tiers": [
            {
                "name": t["kind"],
                "eviction": "lru",
                "write_policy": "write_through",
                **t,
                "capacity": parse_size(t["capacity"], where="x"),
            }
            for t in data["tiers"]
        ],
        "write_queue_chunks": data.get("write_queue_chunks", 256),
        "events": data.get("events", 0),
        "concurrent_reads": data.get("concurrent_reads", True),
    }
    if "layout" in data:
        out["layout"] = KVLayout.from_dict(dict(data["layout"])).to_dict()
    if "metrics" in data:
        out["metrics"] = {"host": "127.0.0.1", **data["metrics"]}
    return out


def _to_toml(data: dict[str, Any]) -> str:
    """Write the shapes `_configs` draws as TOML."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return _toml_str(v)
        return str(v)

    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict | list)]
    for table in ("layout", "metrics"):
        if table in data:
            lines.append(f"[{table}]")
            lines += [f"{_toml_str(k)} = {value(v)}" for k, v in data[table].items()]
    for t in data["tiers"]:
        lines.append("[[tiers]]")
        lines += [f"{_toml_str(k)} = {value(v)}" for k, v in t.items()]
    return "\n".join(lines) + "\n"


def _toml_str(text: str) -> str:
    """Return `text` as a TOML basic string: controls and DEL escaped, the rest literal."""
    body = "".join(
        f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else "\\" + c if c in '"\\' else c
        for c in text
    )
    return f'"{body}"'


def _same(a: Any, b: Any) -> bool:
    """Return whether two plain values are equal, NaN equal to NaN."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("where", ["top", "layout", "metrics"])
def test_an_unknown_key_past_the_digit_limit_is_named(where: str) -> None:
    stray = {HUGE: 1}
    data = config()
    if where == "top":
        data = {**data, **stray}
    elif where == "layout":
        data["layout"] = {**data["layout"], **stray}
    else:
        data["metrics"] = {"port": 0, **stray}
    prefix = {"top": "", "layout": "layout.", "metrics": "metrics."}[where]
    with pytest.raises(
        ConfigError,
        match="^" + re.escape(prefix) + r"<an integer of about [\d,]+ digits>: unknown key",
    ):
        load_config(data)


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"metrics": {"\n": None}}, "metrics.'\\n'"),  # found by the test above
        ({"a\nb": 1}, "'a\\nb'"),
        ({"layout": {"x\ty": 1}}, "layout.'x\\ty'"),
    ],
)
def test_an_unknown_key_with_a_line_break_is_named_on_one_line(
    extra: dict[str, Any], where: str
) -> None:
    config = {"tiers": [{"kind": "dram", "capacity": "1MiB"}], **extra}
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = str(info.value)
    assert message.startswith(f"{where}: unknown key") and "\n" not in message
