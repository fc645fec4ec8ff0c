"""Typed configuration: parsed from TOML, YAML or a dict, validated on load.

Raw dicts stop here. Every error is a `ConfigError` whose message starts with the path of the
bad field (`tiers[1].capacity: ...`) and says what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from kvtiers.core.checks import is_int
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout

__all__ = [
    "CacheConfig",
    "MetricsConfig",
    "TierConfig",
    "WritePolicy",
    "format_size",
    "load_config",
    "parse_size",
]

WritePolicy = Literal["write_through", "write_back"]
_WRITE_POLICIES = ("write_through", "write_back")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

# Keys every tier takes; the rest go to the tier kind's own options, which the tier validates.
_COMMON_TIER_KEYS = frozenset({"kind", "name", "capacity", "eviction", "write_policy"})


_MAX_SIZE = 2**60  # 1 EiB: no tier holds more, and more overflows C sizes downstream


def parse_size(value: object, *, where: str) -> int:
    """Return a byte count from an int or a string such as `"16GiB"` or `"512 MB"`.

    Raises:
        ConfigError: the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size such as '16GiB', got {value!r}")
    size = None
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: expected a non-negative size, got {value}")
        size = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            number = float(match.group(1)) * _UNITS[match.group(2).lower()]
            size = int(number) if math.isfinite(number) else _MAX_SIZE + 1
    if size is not None:
        if size > _MAX_SIZE:
            raise ConfigError(f"{where}: {value!r:.40} is more than 1 EiB")
        return size
    raise ConfigError(
        f"{where}: expected a size such as '16GiB', '512MB' or a byte count, got {value!r}"
    )


def format_size(num_bytes: float) -> str:
    """Return `num_bytes` in binary units, e.g. `"1.50 GiB"`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier of the cascade, top (fastest) first."""

    kind: str
    """Registered tier kind: `"hbm"`, `"dram"`, `"lmdb"`, `"remote"` or a plugin's."""
    capacity_bytes: int
    """Bytes of chunk payload the tier may hold."""
    name: str = ""
    """Name in stats and logs; defaults to the kind (two tiers of one kind need names)."""
    eviction: str = "lru"
    """Eviction policy name (`"lru"`, `"arc"`)."""
    write_policy: WritePolicy = "write_through"
    """How chunks reach this tier from the one above; ignored for the top tier."""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Kind-specific keys (`path`, `url`, `device`, ...), validated by the tier itself."""
    index: int = 0
    """Position in the cascade, for error messages."""

    @property
    def where(self) -> str:
        """Return the config path of this tier, e.g. `"tiers[1]"`."""
        return f"tiers[{self.index}]"


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Where the cache serves its Prometheus metrics (`[metrics]` in the config)."""

    port: int
    """TCP port of the HTTP endpoint; 0 picks a free one (`TieredCache.metrics_url`)."""
    host: str = "127.0.0.1"
    """Address to listen on; `0.0.0.0` exposes it beyond this machine."""


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """A whole cache: the layout (unless an adapter supplies it) and the tier cascade."""

    tiers: tuple[TierConfig, ...]
    """Tiers, top (fastest) first."""
    layout: KVLayout | None = None
    """The KV layout; `None` when an engine adapter supplies it."""
    write_queue_chunks: int = 256
    """Chunks queued per write-through tier before `store` waits (back-pressure)."""
    events: int = 0
    """Capacity of the KV event queue (`TieredCache.take_events`); 0 turns events off."""
    metrics: MetricsConfig | None = None
    """The Prometheus endpoint; `None` serves none."""
    concurrent_reads: bool = True
    """A load split between lower tiers asks them all at once; `False`, one after another
    (for a client on few cores next to a store that competes for them)."""

    def with_layout(self, layout: KVLayout) -> CacheConfig:
        """Return a copy of this config with `layout` set."""
        return dataclasses.replace(self, layout=layout)


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> CacheConfig:
    """Load and validate a config from a TOML or YAML file, or a dict.

    Raises:
        ConfigError: the file cannot be read or parsed, or a field is invalid.
    """
    if isinstance(source, Mapping):
        return _parse(source)
    if not isinstance(source, str | os.PathLike):
        raise ConfigError(
            f"config: expected a path to a TOML or YAML file, or a table; "
            f"got {type(source).__name__}"
        )
    try:
        path = Path(source)
    except TypeError as exc:  # a PathLike of bytes
        raise ConfigError(f"config: expected a text path, got {source!r:.60}") from exc
    return _parse(_read_file(path))


def _read_file(path: Path) -> Mapping[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config: cannot read {path}: not UTF-8 ({exc})") from exc
    except ValueError as exc:  # a NUL byte in the path
        raise ConfigError(f"config: cannot read {str(path)!r:.200}: {exc}") from exc
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as exc:
                raise ConfigError("config: YAML needs PyYAML; install kvtiers[yaml]") from exc
            data = yaml.safe_load(text)
        elif suffix in (".toml", ""):
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"config: {path.name}: expected a .toml, .yaml or .yml file")
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config: cannot parse {path}: {exc}") from exc
    except Exception as exc:  # yaml.YAMLError has no common base we can import lazily
        raise ConfigError(f"config: cannot parse {path}: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: {path} must hold a table at the top level")
    return data


def _parse(data: Mapping[str, Any]) -> CacheConfig:
    keys = {"layout", "tiers", "write_queue_chunks", "events", "metrics", "concurrent_reads"}
    unknown = sorted(set(data) - keys, key=str)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key; expected {', '.join(sorted(keys))}")
    layout = None
    if "layout" in data:
        raw = data["layout"]
        if not isinstance(raw, Mapping):
            raise ConfigError("layout: expected a table")
        try:
            layout = KVLayout.from_dict(dict(raw))
        except TypeError as exc:
            raise ConfigError(f"layout: {exc}") from exc
    raw_tiers = data.get("tiers")
    if not isinstance(raw_tiers, list) or not raw_tiers:
        raise ConfigError("tiers: expected a non-empty list of tier tables")
    tiers = tuple(_parse_tier(i, raw) for i, raw in enumerate(raw_tiers))
    names = [t.name for t in tiers]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"tiers[{i}].name: {name!r} is used twice")
    depth = data.get("write_queue_chunks", 256)
    if not is_int(depth) or depth < 1:
        raise ConfigError(f"write_queue_chunks: expected an integer >= 1, got {depth!r}")
    events = data.get("events", 0)
    if not is_int(events) or not 0 <= events < 2**31:
        raise ConfigError(
            f"events: expected an integer in [0, 2**31) (the event queue's capacity; 0 is off), "
            f"got {events!r}"
        )
    metrics = _parse_metrics(data["metrics"]) if "metrics" in data else None
    concurrent = data.get("concurrent_reads", True)
    if not isinstance(concurrent, bool):
        raise ConfigError(f"concurrent_reads: expected true or false, got {concurrent!r}")
    return CacheConfig(tiers, layout, depth, events, metrics, concurrent)


def _parse_metrics(raw: object) -> MetricsConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError("metrics: expected a table with a port")
    unknown = sorted(set(raw) - {"port", "host"}, key=str)
    if unknown:
        raise ConfigError(f"metrics.{unknown[0]}: unknown key; expected port, host")
    port = raw.get("port")
    if not is_int(port) or not 0 <= port <= 65535:
        raise ConfigError(f"metrics.port: expected a TCP port 0-65535, got {port!r}")
    host = raw.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"metrics.host: expected an address, got {host!r}")
    return MetricsConfig(port, host)


def _parse_tier(i: int, raw: object) -> TierConfig:
    where = f"tiers[{i}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a table")
    kind = raw.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"{where}.kind: required; expected a tier kind such as 'dram'")
    if "capacity" not in raw:
        raise ConfigError(f"{where}.capacity: required; expected a size such as '16GiB'")
    capacity = parse_size(raw["capacity"], where=f"{where}.capacity")
    if capacity <= 0:
        raise ConfigError(f"{where}.capacity: must be greater than zero")
    eviction = raw.get("eviction", "lru")
    if not isinstance(eviction, str):
        raise ConfigError(f"{where}.eviction: expected a policy name such as 'lru' or 'arc'")
    write_policy = raw.get("write_policy", "write_through")
    if write_policy not in _WRITE_POLICIES:
        raise ConfigError(
            f"{where}.write_policy: expected 'write_through' or 'write_back', got {write_policy!r}"
        )
    name = raw.get("name", kind)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: expected a non-empty string")
    options = {k: v for k, v in raw.items() if k not in _COMMON_TIER_KEYS}
    return TierConfig(
        kind=kind,
        capacity_bytes=capacity,
        name=name,
        eviction=eviction,
        write_policy=write_policy,
        options=MappingProxyType(options),
        index=i,
    )
