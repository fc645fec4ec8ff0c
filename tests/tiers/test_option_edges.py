"""Tier options at their edges: huge, deep or self-referencing values are `ConfigError`s.

A value from a config file or dict may be an integer past float range or Python's digit
limit, a list nested 50,000 deep, or a YAML anchor that contains itself; each must be
refused with a `ConfigError` naming the field, never another exception from the check or
from the message that reports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtiers.cli import main
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.tiers._integrity import auth_key_from_config
from kvtiers.tiers._pool_options import MooncakeOptions, RedisOptions
from kvtiers.tiers._remote_options import Redactor, RemoteOptions
from kvtiers.tiers.base import check_option_keys
from tests._cli_errors import one_line_error
from tests._hostile import deep_dict, deep_list

HUGE = int("9" * 400)  # past float range: math.isfinite and float() overflow
BIGGER = 10**5000  # past Python's 4,300-digit limit on int-to-text
DEEP = 50_000
LAYOUT_TOML = """[layout]
model = "m"
num_layers = 2
num_kv_heads = 2
head_size = 8
dtype = "float16"
chunk_size = 16
"""
LAYOUT_YAML = (
    "{model: m, num_layers: 2, num_kv_heads: 2, head_size: 8, dtype: float16, chunk_size: 16}"
)


HOSTILE = [HUGE, BIGGER, -BIGGER, deep_list(DEEP)]
HOSTILE_IDS = ["huge", "bigger", "-bigger", "deep"]


def refused(build: Any, config: TierConfig, field: str) -> str:
    """Return the message of the `ConfigError` that `build(config)` raises about `field`."""
    with pytest.raises(ConfigError) as info:
        build(config)
    message = str(info.value)
    assert message.startswith(f"{config.where}.{field}: "), message
    assert len(message) < 400, message
    return message


# -- seconds -------------------------------------------------------------------------------

REMOTE_SECONDS = ["timeout", "read_timeout", "ttl", "breaker_cooldown", "scan_interval"]
REDIS_SECONDS = ["timeout", "ttl", "breaker_cooldown"]
MOONCAKE_SECONDS = ["timeout", "breaker_cooldown"]
SECONDS_IDS = ["huge", "bigger", "1e300", "inf"]


@pytest.mark.parametrize(
    "value",
    [HUGE, BIGGER, 1e300, float("inf"), float("nan")],
    ids=["huge", "bigger", "1e300", "inf", "nan"],
)
@pytest.mark.parametrize("field", REMOTE_SECONDS)
def test_remote_seconds_past_float_range_are_config_errors(field: str, value: object) -> None:
    options = {"url": "memory://edges/pool", field: value}
    config = TierConfig("remote", 1 << 20, options=options, index=1)
    assert "expected a number of seconds" in refused(RemoteOptions.from_config, config, field)


@pytest.mark.parametrize("value", [HUGE, BIGGER, 1e300, float("inf")], ids=SECONDS_IDS)
@pytest.mark.parametrize("field", REDIS_SECONDS)
def test_redis_seconds_past_float_range_are_config_errors(field: str, value: object) -> None:
    options = {"url": "redis://localhost:6379", field: value}
    config = TierConfig("redis", 1 << 20, options=options, index=1)
    assert "expected a number of seconds" in refused(RedisOptions.from_config, config, field)


@pytest.mark.parametrize("value", [HUGE, BIGGER, 1e300, float("inf")], ids=SECONDS_IDS)
@pytest.mark.parametrize("field", MOONCAKE_SECONDS)
def test_mooncake_seconds_past_float_range_are_config_errors(field: str, value: object) -> None:
    options = {"master": "127.0.0.1:50051", field: value}
    config = TierConfig("mooncake", 1 << 20, options=options, index=1)
    assert "expected a number of seconds" in refused(MooncakeOptions.from_config, config, field)


def test_seconds_keep_accepting_ordinary_values() -> None:
    options = {"url": "memory://edges/pool", "timeout": 2**31 - 1, "ttl": 604800.5}
    remote = RemoteOptions.from_config(TierConfig("remote", 1 << 20, options=options))
    assert (remote.timeout, remote.ttl) == (2**31 - 1, 604800.5)
    redis = RedisOptions.from_config(
        TierConfig("redis", 1 << 20, options={"url": "redis://h:1", "ttl": 86400})
    )
    assert redis.ttl == 86400.0
    scan = {"url": "memory://edges/pool", "scan_interval": 0}
    assert RemoteOptions.from_config(TierConfig("remote", 1, options=scan)).scan_interval == 0.0


def test_explain_refuses_a_400_digit_timeout_in_a_toml_file(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "rt.toml"
    path.write_text(
        f"{LAYOUT_TOML}\n"
        '[[tiers]]\nkind = "dram"\ncapacity = "1MiB"\n\n'
        f'[[tiers]]\nkind = "remote"\ncapacity = "1MiB"\nurl = "memory://edges/rt"\n'
        f"timeout = {'9' * 400}\n",
        encoding="utf-8",
    )
    line = one_line_error(capsys, main(["explain", str(path)]), status=2)
    assert "tiers[1].timeout: expected a number of seconds" in line


# -- storage_options -------------------------------------------------------------------------


def remote_config(storage: object) -> TierConfig:
    options = {"url": "memory://edges/pool", "storage_options": storage}
    return TierConfig("remote", 1 << 20, options=options, index=1)


def test_storage_options_that_contain_themselves_are_config_errors() -> None:
    loop: dict[str, Any] = {}
    loop["k"] = loop
    message = refused(RemoteOptions.from_config, remote_config(loop), "storage_options")
    assert "contains itself" in message
    nested: dict[str, Any] = {"client_kwargs": {"config": []}}
    nested["client_kwargs"]["config"].append(nested["client_kwargs"])
    refused(RemoteOptions.from_config, remote_config(nested), "storage_options")


@pytest.mark.parametrize("depth", [100, DEEP])
def test_storage_options_nested_too_deep_are_config_errors(depth: int) -> None:
    message = refused(RemoteOptions.from_config, remote_config(deep_dict(depth)), "storage_options")
    assert "nested more than" in message


def test_storage_options_that_are_not_a_table_are_described_safely() -> None:
    refused(RemoteOptions.from_config, remote_config(deep_list(DEEP)), "storage_options")
    refused(RemoteOptions.from_config, remote_config(BIGGER), "storage_options")


def test_storage_options_may_share_a_value_and_nest_a_few_levels() -> None:
    shared = {"region": "eu", "secret_access_key": "s3cr3t-value"}
    levels = deep_dict(8)
    storage = {"a": shared, "b": shared, "client_kwargs": levels}
    options = RemoteOptions.from_config(remote_config(storage))
    assert options.storage_options["a"] is shared
    assert Redactor(options.storage_options, environ={})("x s3cr3t-value y") == "x *** y"


def test_redactor_takes_a_wide_shared_tree_in_linear_time() -> None:
    # NOTE: 30 levels of two references to one node: 2**30 paths, 31 distinct nodes.
    node: dict[str, Any] = {"password": "hunter22-secret"}
    for _ in range(30):
        node = {"left": node, "right": node}
    options = RemoteOptions.from_config(remote_config(node))
    assert Redactor(options.storage_options, environ={})("hunter22-secret") == "***"


def test_redactor_refuses_storage_options_nested_too_deep() -> None:
    with pytest.raises(ConfigError, match=r"^storage_options: nested more than"):
        Redactor(deep_dict(DEEP), environ={})


def test_redactor_ignores_keys_that_are_not_text() -> None:
    redact = Redactor({BIGGER: "plain", "token": ["tok-1234"]}, environ={})
    assert redact("tok-1234 plain") == "*** plain"


def test_explain_refuses_a_yaml_anchor_that_contains_itself(tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "rt.yaml"
    path.write_text(
        f"layout: {LAYOUT_YAML}\n"
        "tiers:\n"
        "  - {kind: dram, capacity: 1MiB}\n"
        "  - kind: remote\n"
        "    capacity: 1MiB\n"
        "    url: memory://edges/rt\n"
        "    storage_options: &a {k: *a}\n",
        encoding="utf-8",
    )
    line = one_line_error(capsys, main(["explain", str(path)]), status=2)
    assert "tiers[1].storage_options: " in line


# -- messages that show the bad value --------------------------------------------------------


@pytest.mark.parametrize("value", HOSTILE, ids=HOSTILE_IDS)
@pytest.mark.parametrize(
    "field", ["url", "max_in_flight", "retries", "timeout", "layer_reads", "breaker_failures"]
)
def test_remote_messages_survive_any_value(field: str, value: object) -> None:
    options: dict[str, Any] = {"url": "memory://edges/pool", field: value}
    refused(RemoteOptions.from_config, TierConfig("remote", 1, options=options), field)


@pytest.mark.parametrize("value", HOSTILE, ids=HOSTILE_IDS)
@pytest.mark.parametrize("field", ["url", "prefix", "max_connections", "retries", "timeout"])
def test_redis_messages_survive_any_value(field: str, value: object) -> None:
    options: dict[str, Any] = {"url": "redis://h:1", field: value}
    refused(RedisOptions.from_config, TierConfig("redis", 1, options=options), field)


@pytest.mark.parametrize("value", HOSTILE, ids=HOSTILE_IDS)
@pytest.mark.parametrize(
    "field", ["master", "protocol", "metadata", "local_hostname", "replicas", "timeout"]
)
def test_mooncake_messages_survive_any_value(field: str, value: object) -> None:
    options: dict[str, Any] = {"master": "h:1", field: value}
    refused(MooncakeOptions.from_config, TierConfig("mooncake", 1, options=options), field)


@pytest.mark.parametrize("value", HOSTILE, ids=HOSTILE_IDS)
@pytest.mark.parametrize("field", ["path", "sync", "readahead", "read_threads", "max_readers"])
def test_lmdb_messages_survive_any_value(tmp_path: Path, field: str, value: object) -> None:
    pytest.importorskip("lmdb")
    from kvtiers.tiers._lmdb_options import LMDBOptions

    options: dict[str, Any] = {"path": str(tmp_path / "db"), field: value}
    refused(LMDBOptions.from_config, TierConfig("lmdb", 1, options=options), field)


@pytest.mark.parametrize("value", HOSTILE, ids=HOSTILE_IDS)
def test_integrity_messages_survive_any_value(value: object) -> None:
    config = TierConfig("lmdb", 1, options={"integrity": value})
    refused(auth_key_from_config, config, "integrity")
    config = TierConfig("lmdb", 1, options={"integrity": "hmac-sha256", "integrity_key_env": value})
    refused(auth_key_from_config, config, "integrity_key_env")


@pytest.mark.parametrize("value", HOSTILE, ids=HOSTILE_IDS)
def test_hbm_device_messages_survive_any_value(value: object) -> None:
    pytest.importorskip("torch")
    from kvtiers.gpu.hbm import HBMTier
    from kvtiers.testing.tiers import SMALL_LAYOUT

    config = TierConfig("hbm", 1 << 20, options={"device": value})
    refused(lambda c: HBMTier(c, SMALL_LAYOUT), config, "device")


@pytest.mark.parametrize("key", [BIGGER, -BIGGER, 7], ids=["bigger", "-bigger", "7"])
def test_unknown_option_keys_that_are_huge_integers_are_named_safely(key: object) -> None:
    config = TierConfig("dram", 1 << 20, options={key: 1, "b": 2}, index=3)
    with pytest.raises(ConfigError) as info:
        check_option_keys(config, "dram", ("a",))
    message = str(info.value)
    assert message.startswith("tiers[3].") and "unknown option for kind 'dram'" in message
    assert len(message) < 200, message


def test_unknown_option_keys_keep_their_name_and_order() -> None:
    config = TierConfig("dram", 1 << 20, options={"zeta": 1, "beta": 2}, index=0)
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.beta: unknown option for kind 'dram'"):
        check_option_keys(config, "dram", ("alpha",))


# -- bounds --------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [2**32, 2**63, BIGGER], ids=["2**32", "2**63", "bigger"])
def test_lmdb_reader_counts_no_lmdb_takes_are_refused_at_load(tmp_path: Path, count: int) -> None:
    pytest.importorskip("lmdb")
    from kvtiers.tiers._lmdb_options import LMDBOptions

    config = TierConfig("lmdb", 1, options={"path": str(tmp_path), "max_readers": count})
    message = refused(LMDBOptions.from_config, config, "max_readers")
    assert "expected an integer in [1, " in message


@pytest.mark.parametrize("master", ["h:99999", "h:65536", "h:0", "h:\u0661\u0662"])
def test_mooncake_master_port_must_be_a_tcp_port(master: str) -> None:
    config = TierConfig("mooncake", 1, options={"master": master})
    refused(MooncakeOptions.from_config, config, "master")


@pytest.mark.parametrize("master", ["h:1", "10.0.0.1:65535", "master.local:50051"])
def test_mooncake_master_accepts_ports_up_to_65535(master: str) -> None:
    config = TierConfig("mooncake", 1, options={"master": master})
    assert MooncakeOptions.from_config(config).master == master
