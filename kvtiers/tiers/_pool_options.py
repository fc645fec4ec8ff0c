"""The config keys of the pool tiers (`redis`, `mooncake`), validated."""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

from kvtiers.core.checks import check_int, describe
from kvtiers.core.config import TierConfig, parse_size
from kvtiers.core.errors import ConfigError
from kvtiers.tiers._integrity import OPTION_NAMES as INTEGRITY_OPTIONS
from kvtiers.tiers.base import check_option_keys

__all__ = ["MAX_SECONDS", "MooncakeOptions", "RedisOptions", "seconds"]

_MiB = 2**20
REDIS_MAX_VALUE_BYTES = 512 * _MiB
"""Redis' and Valkey's default `proto-max-bulk-len`: the largest value they accept."""

_BREAKER = ("breaker_cooldown", "breaker_failures")
_REDIS_OPTIONS = (
    *_BREAKER,
    *INTEGRITY_OPTIONS,
    *("layer_reads", "max_connections", "max_value_bytes", "prefix", "retries", "timeout"),
    *("ttl", "url"),
)
_MOONCAKE_OPTIONS = (
    *_BREAKER,
    *INTEGRITY_OPTIONS,
    *("buffer_size", "local_hostname", "master", "max_in_flight", "metadata", "protocol"),
    *("prefix", "replicas", "segment_size", "timeout"),
)
_PREFIX = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
_PROTOCOLS = ("tcp", "rdma")
_SCHEMES = ("redis", "rediss", "unix")
_MASTER = re.compile(r"[^\s:]+:([0-9]{1,5})")
_MAX_PORT = 65535

MAX_SECONDS = 2**31 - 1
"""The most seconds a duration option takes (68 years): more overflows the C timeouts of
sockets and locks below the tiers (`socket.settimeout(1e10)` raises `OverflowError`)."""


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """The redis tier's own config keys."""

    url: str
    """`redis://[user:password@]host:port[/db]`, `rediss://` for TLS, or `unix://path`."""
    prefix: str = "kvtiers"
    """First part of every key: `<prefix>:<layout fingerprint hex>:...`."""
    ttl: float | None = None
    """Seconds after its last write or read that a chunk expires; `None`: never."""
    max_connections: int = 16
    """Connections, and so pipelined requests in flight, at once."""
    timeout: float = 5.0
    """Seconds the server may leave a request without an answer before it counts as failed."""
    retries: int = 1
    """Retries of a command whose connection failed (after a server restart, say)."""
    breaker_failures: int = 5
    """Consecutive failed requests that open the circuit breaker."""
    breaker_cooldown: float = 5.0
    """Seconds the breaker stays open before one probe request may try the server."""
    max_value_bytes: int = REDIS_MAX_VALUE_BYTES
    """The largest value the server accepts (its `proto-max-bulk-len`)."""
    layer_reads: bool = True
    """Whether `get_layers` reads byte ranges of values (GETRANGE) instead of whole values."""

    @classmethod
    def from_config(cls, config: TierConfig) -> RedisOptions:
        """Validate the kind options of `config`.

        Raises:
            ConfigError: an option is missing, unknown or invalid; the message names it.
        """
        where, raw = config.where, dict(config.options)
        check_option_keys(config, "redis", _REDIS_OPTIONS)
        url = raw.get("url")
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in _SCHEMES:
            raise ConfigError(
                f"{where}.url: required; expected a redis://, rediss:// or unix:// URL, "
                f"got {describe(url, 80)}"
            )
        prefix = key_prefix(raw, where)
        ttl = raw.get("ttl")
        return cls(
            url=url,
            prefix=prefix,
            ttl=None if ttl is None else seconds(raw, "ttl", 0.0, where),
            max_connections=integer(raw, "max_connections", 16, 1, where),
            timeout=seconds(raw, "timeout", 5.0, where),
            retries=integer(raw, "retries", 1, 0, where),
            breaker_failures=integer(raw, "breaker_failures", 5, 1, where),
            breaker_cooldown=seconds(raw, "breaker_cooldown", 5.0, where),
            max_value_bytes=size(raw, "max_value_bytes", REDIS_MAX_VALUE_BYTES, where),
            layer_reads=flag(raw, "layer_reads", True, where),
        )


@dataclass(frozen=True, slots=True)
class MooncakeOptions:
    """The mooncake tier's own config keys."""

    master: str
    """The master's RPC address, `host:port`."""
    metadata: str = "P2PHANDSHAKE"
    """The metadata server (`http://host:port/metadata`, `etcd://...`) or `P2PHANDSHAKE`."""
    protocol: str = "tcp"
    """Transfer protocol: `tcp` or `rdma`."""
    local_hostname: str = "127.0.0.1"
    """This process's address as other processes reach it."""
    prefix: str = "kvtiers"
    """First part of every key: `<prefix>/<layout fingerprint hex>/<key hex>`."""
    segment_size: int = 0
    """Bytes of this process's memory lent to the pool; 0: a pure client."""
    buffer_size: int = 0
    """Bytes of this process's registered transfer buffer; 0: sized from the chunk."""
    replicas: int = 1
    """Copies the store keeps of each chunk (on distinct segments)."""
    max_in_flight: int = 4
    """Batched store calls in flight at once (threads of the tier's pool)."""
    timeout: float = 10.0
    """Seconds one store call may take before it counts as failed."""
    breaker_failures: int = 5
    """Consecutive failed calls that open the circuit breaker."""
    breaker_cooldown: float = 5.0
    """Seconds the breaker stays open before one probe call may try the store."""

    @classmethod
    def from_config(cls, config: TierConfig) -> MooncakeOptions:
        """Validate the kind options of `config`.

        Raises:
            ConfigError: an option is missing, unknown or invalid; the message names it.
        """
        where, raw = config.where, dict(config.options)
        check_option_keys(config, "mooncake", _MOONCAKE_OPTIONS)
        master = raw.get("master")
        match = _MASTER.fullmatch(master) if isinstance(master, str) else None
        if not isinstance(master, str) or match is None or not 1 <= int(match[1]) <= _MAX_PORT:
            raise ConfigError(
                f"{where}.master: required; expected the master's 'host:port' (a port from 1 "
                f"to {_MAX_PORT}), got {describe(master, 80)}"
            )
        protocol = raw.get("protocol", "tcp")
        if protocol not in _PROTOCOLS:
            raise ConfigError(
                f"{where}.protocol: expected 'tcp' or 'rdma', got {describe(protocol, 40)}"
            )
        return cls(
            master=master,
            metadata=text(raw, "metadata", "P2PHANDSHAKE", where),
            protocol=protocol,
            local_hostname=text(raw, "local_hostname", "127.0.0.1", where),
            prefix=key_prefix(raw, where),
            segment_size=size(raw, "segment_size", 0, where),
            buffer_size=size(raw, "buffer_size", 0, where),
            replicas=integer(raw, "replicas", 1, 1, where),
            max_in_flight=integer(raw, "max_in_flight", 4, 1, where),
            timeout=seconds(raw, "timeout", 10.0, where),
            breaker_failures=integer(raw, "breaker_failures", 5, 1, where),
            breaker_cooldown=seconds(raw, "breaker_cooldown", 5.0, where),
        )


def key_prefix(raw: dict[str, Any], where: str) -> str:
    """Return the `prefix` option: 1-64 characters of letters, digits and `_.:/-`."""
    prefix = raw.get("prefix", "kvtiers")
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ConfigError(
            f"{where}.prefix: expected 1-64 characters of letters, digits and _.:/-, "
            f"got {describe(prefix, 80)}"
        )
    return prefix


def text(raw: dict[str, Any], name: str, default: str, where: str) -> str:
    """Return the non-empty string option `name`."""
    value = raw.get(name, default)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}.{name}: expected a non-empty string, got {describe(value, 80)}")
    return value.strip()


def flag(raw: dict[str, Any], name: str, default: bool, where: str) -> bool:
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{name}: expected true or false, got {describe(value)}")
    return value


def integer(raw: dict[str, Any], name: str, default: int, minimum: int, where: str) -> int:
    """Return the integer option `name`, from `minimum` to `MAX_DIM` (2**31 - 1)."""
    return check_int(f"{where}.{name}", raw.get(name, default), minimum)


def size(raw: dict[str, Any], name: str, default: int, where: str) -> int:
    """Return the size option `name` (a byte count or a string such as `"1GiB"`)."""
    return parse_size(raw.get(name, default), where=f"{where}.{name}")


def seconds(
    raw: dict[str, Any], name: str, default: float, where: str, *, allow_zero: bool = False
) -> float:
    """Return the option `name`, a number of seconds > 0 (>= 0 with `allow_zero`).

    At most `MAX_SECONDS`: an integer too large for a float is refused, not converted.
    """
    value = raw.get(name, default)
    # NOTE: comparisons of int and float are exact in Python and never overflow, and NaN
    # fails them all; so no float() or math.isfinite() of a huge integer is needed.
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and (value >= 0 if allow_zero else value > 0)
        and value <= MAX_SECONDS
    )
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(
            f"{where}.{name}: expected a number of seconds {bound} and at most "
            f"{MAX_SECONDS:,}, got {describe(value, 40)}"
        )
    return float(value)
