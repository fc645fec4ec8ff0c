"""Hostile config and input: only kvtiers' typed errors, no path escapes, private files."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtiers import TieredCache
from kvtiers.core.config import load_config
from kvtiers.core.errors import ConfigError, KVTiersError
from tests.conftest import SMALL_LAYOUT, make_kv, small_layout
from tests.reliability._factories import integrity

pytestmark = pytest.mark.reliability

FUZZ_EXAMPLES = int(os.environ.get("KVTIERS_FUZZ_EXAMPLES", "300"))  # more for a long hunt
_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# -- values of any shape ---------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=8),
    st.sampled_from(["16GiB", "0", "-1MiB", "1e9", "lru", "arc", "dram", "", "..", "/", "nan"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)
_LAYOUT_KEYS = [*SMALL_LAYOUT, "kind", "tp_rank", "tp_size", "revision"]
_TIER_KEYS = [
    "kind", "capacity", "name", "eviction", "write_policy", "path", "url", "map_size",
    "read_threads", "sync", "storage_options", "timeout", "retries", "ttl", "integrity",
    "integrity_key_env", "max_in_flight", "scan_interval", "device", "readahead",
]  # fmt: skip


_DELETE = "<delete>"  # a mutation that removes the key
_BASE_TIERS = [
    {"kind": "dram", "capacity": "64KiB"},
    {"kind": "lmdb", "capacity": "1MiB", "path": "rel/db"},
    {"kind": "remote", "capacity": "1MiB", "url": "memory://fuzz/pool"},
    {"kind": "hbm", "capacity": "1MiB"},
]


def _mutated(base: dict[str, Any], keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Return `base` with up to two keys replaced by random values, added or removed."""

    def apply(edits: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in edits.items():
            if value == _DELETE:
                out.pop(key, None)
            else:
                out[key] = value
        return out

    values = st.one_of(st.just(_DELETE), _values)
    return st.dictionaries(st.sampled_from(keys), values, max_size=2).map(apply)


_tiers = st.lists(
    st.one_of(*(_mutated(base, _TIER_KEYS) for base in _BASE_TIERS), _values),
    min_size=1,
    max_size=3,
)
_configs = st.one_of(
    _values,
    st.fixed_dictionaries(
        {
            "layout": st.one_of(_mutated(dict(SMALL_LAYOUT), _LAYOUT_KEYS), _values),
            "tiers": _tiers,
        },
        optional={
            "write_queue_chunks": _values,
            "events": _values,
            "metrics": st.one_of(_mutated({"port": 0}, ["port", "host", "path"]), _values),
            "extra": _values,
        },
    ),
    st.fixed_dictionaries(  # valid but for one tier option
        {"layout": st.just(dict(SMALL_LAYOUT)), "tiers": _tiers},
    ),
)


def test_fuzzed_configs_raise_only_config_errors(tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)  # nothing is opened, but relative paths land here if they ever were
    tried = {"cases": 0, "accepted": 0, "built": 0}

    @_SETTINGS
    @given(_configs)
    def check(raw: Any) -> None:
        tried["cases"] += 1
        try:
            config = load_config(raw)
        except KVTiersError:
            return
        tried["accepted"] += 1
        try:
            TieredCache.from_config(config)  # builds every tier: their options are checked
        except KVTiersError:
            return
        tried["built"] += 1

    try:
        check()
    finally:
        os.chdir(cwd)
    print(f"config fuzz: {tried}")


def test_config_loader_rejects_non_mapping_sources(tmp_path: Path) -> None:
    for source in (None, 3, [], b"x", "conf\0ig.toml", str(tmp_path / "missing.toml")):
        with pytest.raises(ConfigError):
            load_config(source)  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
@pytest.mark.parametrize("text", ["\x00\x01", "[[tiers]]\nkind = 1", "- a\n- b", "a: [", "\ufeff="])
def test_fuzzed_config_files_raise_only_config_errors(
    tmp_path: Path, suffix: str, text: str
) -> None:
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_config(path)


# -- the public API ------------------------------------------------------------------------

_tokens = st.one_of(
    _values,
    st.lists(st.integers(min_value=-5, max_value=2**64), max_size=40),
    st.lists(st.integers(min_value=0, max_value=50), min_size=16, max_size=70),
    st.builds(
        lambda n, dtype: np.arange(n).astype(dtype),
        st.integers(0, 70),
        st.sampled_from(["int8", "uint8", "int32", "uint64", "float32", "bool", "complex64", "U1"]),
    ),
    st.builds(
        lambda n, dtype: torch.arange(n).to(dtype),
        st.integers(0, 70),
        st.sampled_from([torch.int64, torch.int32, torch.float16, torch.bool, torch.uint8]),
    ),
    st.builds(lambda a, b: np.zeros((a, b), np.int64), st.integers(0, 3), st.integers(0, 20)),
)
_LAY = small_layout()
_kvs = st.one_of(
    _values,
    st.builds(lambda n: make_kv(_LAY, n), st.integers(0, 70)),
    st.builds(
        lambda shape, dtype: torch.zeros(shape, dtype=dtype),
        st.lists(st.integers(0, 17), max_size=6),
        st.sampled_from([torch.float16, torch.float32, torch.bfloat16, torch.int8, torch.uint8]),
    ),
    st.builds(lambda n: make_kv(_LAY, n).transpose(0, 2), st.integers(0, 40)),
    st.builds(lambda n: make_kv(_LAY, n).numpy(), st.integers(0, 40)),
)
_salts = st.one_of(st.none(), st.text(max_size=8), st.binary(max_size=8), _values)
_ops = st.sampled_from(["lookup", "load", "store", "prefetch", "keys", "load_out"])


def test_fuzzed_api_calls_raise_only_typed_errors(tmp_path: Path) -> None:
    cfg = {
        "layout": SMALL_LAYOUT,
        "tiers": [
            {"kind": "dram", "capacity": 8 * _LAY.chunk_bytes},
            {"kind": "lmdb", "path": str(tmp_path / "db"), "capacity": "1MiB"},
        ],
    }
    tried = {"calls": 0, "ok": 0, "typed_errors": 0}
    with asyncio.Runner() as runner:
        cache = TieredCache.from_config(cfg)
        runner.run(cache.open())

        async def call(op: str, tokens: Any, kv: Any, salt: Any) -> None:
            if op == "lookup":
                await cache.lookup(tokens, salt=salt)
            elif op == "load":
                await cache.load(tokens, salt=salt)
            elif op == "load_out":
                await cache.load(tokens, salt=salt, out=kv)
            elif op == "store":
                await cache.store(tokens, kv, salt=salt)
            elif op == "prefetch":
                await cache.prefetch(tokens, salt=salt)
            else:
                cache.keys(tokens, salt=salt)

        @_SETTINGS
        @given(_ops, _tokens, _kvs, _salts, st.booleans())
        def check(op: str, tokens: Any, kv: Any, salt: Any, coherent: bool) -> None:
            tried["calls"] += 1
            if (
                coherent
                and isinstance(tokens, list)
                and all(isinstance(t, int) and 0 <= t < 2**63 for t in tokens)
            ):
                kv = make_kv(_LAY, len(tokens))  # a valid pair: the call goes all the way
            try:
                runner.run(call(op, tokens, kv, salt))
            except KVTiersError:
                tried["typed_errors"] += 1
                return
            tried["ok"] += 1

        try:
            check()
            # NOTE: after the write-through queues are done: a copy still being written
            # holds its top-tier blocks (a pin in use, not a leak).
            runner.run(cache.flush())
            assert cache.pin_count() == 0
        finally:
            runner.run(cache.close())
    print(f"api fuzz: {tried}")


# -- paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["../db", "a/../../db", "/tmp/x/../../etc/kv", "a/..", "db\0x"])
def test_lmdb_path_escapes_are_refused(path: str) -> None:
    tier = {"kind": "lmdb", "capacity": "1MiB", "path": path}
    cfg = {"layout": SMALL_LAYOUT, "tiers": [{"kind": "dram", "capacity": "64KiB"}, tier]}
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.path:"):
        TieredCache.from_config(cfg)


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/../other-bucket/kv",
        "s3://bucket/prefix/../../other",
        "file:///srv/kv/../../etc",
        "memory://pool/..",
        "file://../outside",
        "s3://bucket/kv\0x",
    ],
)
def test_remote_prefix_escapes_are_refused(url: str) -> None:
    tier = {"kind": "remote", "capacity": "1MiB", "url": url}
    cfg = {"layout": SMALL_LAYOUT, "tiers": [{"kind": "dram", "capacity": "64KiB"}, tier]}
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.url:"):
        TieredCache.from_config(cfg)


# -- permissions ---------------------------------------------------------------------------


def _modes(root: Path) -> dict[str, int]:
    modes = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        modes[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return modes


async def test_files_and_folders_kvtiers_creates_are_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIERS_TEST_INTEGRITY_KEY", "0123456789abcdef0123456789abcdef")
    old = os.umask(0o022)  # a common, permissive umask: files would be 0644 by default
    try:
        root = tmp_path / "state"
        cfg = {
            "layout": SMALL_LAYOUT,
            "tiers": [
                {"kind": "dram", "capacity": 4 * _LAY.chunk_bytes},
                {"kind": "lmdb", "capacity": "1MiB", "path": str(root / "nested" / "db")},
                {
                    "kind": "remote",
                    "capacity": "1MiB",
                    "url": f"file://{root}/pool/kv",
                    **integrity(),
                },
            ],
        }
        tokens = list(range(64))
        async with TieredCache.from_config(cfg) as cache:
            await cache.store(tokens, make_kv(_LAY, 64))
            await cache.flush()
            assert await cache.load(tokens) is not None
    finally:
        os.umask(old)
    modes = _modes(root)
    lmdb_files = [p for p in modes if p.endswith(".mdb")]
    objects = [p for p in modes if p.startswith("pool/kv/") and "/_access/" not in p]
    logs = [p for p in modes if "/_access/" in p]  # the access-log sidecar
    assert len(lmdb_files) == 2 and objects and logs
    wrong = {p: oct(m) for p, m in modes.items() if m != (0o700 if (root / p).is_dir() else 0o600)}
    assert not wrong, wrong
