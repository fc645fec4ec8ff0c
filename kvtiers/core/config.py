"""Typed configuration: parsed from TOML, YAML or a dict, validated on load.

Raw dicts stop here. Every error is a `ConfigError` whose message starts with the path of the
bad field (`tiers[1].capacity: ...`) and says what was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from kvtiers.core.checks import MAX_BYTES, MAX_DIM, check_int, describe, is_int
from kvtiers.core.config_files import read_config_file
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
# NOTE: ASCII only: `\d` would take other scripts' digits ("١٦GiB") and `\s` a no-break space.
_SIZE_RE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([a-zA-Z]*)\s*$", re.ASCII)
_MAX_DECIMALS = 20  # below a byte of any unit; more is a typo, not a size

# Keys every tier takes; the rest go to the tier kind's own options, which the tier validates.
_COMMON_TIER_KEYS = frozenset({"kind", "name", "capacity", "eviction", "write_policy"})

_NEAR_MISS = 0.8  # difflib's similarity above which a key is taken for a misspelt one
_MAX_KEY_SHOWN = 60  # characters of an unknown key that a message shows as it is
_MAX_COPY_THREADS = 256  # threads copying one batch; more is a typo


def parse_size(value: object, *, where: str) -> int:
    """Return a byte count from an int or a string such as `"16GiB"` or `"512 MB"`.

    A fraction is exact (`"0.1KB"` is 100 bytes); a fraction of a byte is dropped.

    Raises:
        ConfigError: the value is not a size from 0 to 1 EiB; `True` and floats are not.
    """
    size = None
    if is_int(value):
        if value < 0:
            raise ConfigError(f"{where}: expected a non-negative size, got {describe(value)}")
        size = value
    elif isinstance(value, str) and (match := _SIZE_RE.match(value)):
        size = _size_of(*match.groups(), where=where)
    elif isinstance(value, str) and _SIZE_RE.match(value.strip().removeprefix("-")):
        raise ConfigError(f"{where}: expected a non-negative size, got {describe(value)}")
    if size is None:
        raise ConfigError(
            f"{where}: expected a size such as '16GiB', '512MB' or a byte count, "
            f"got {describe(value)}"
        )
    if size > MAX_BYTES:
        raise ConfigError(f"{where}: {describe(value, 40)} is more than 1 EiB")
    return size


def _size_of(whole: str, decimals: str | None, unit: str, *, where: str) -> int | None:
    """Return the bytes of a matched size, exactly; `None` for an unknown unit."""
    scale = _UNITS.get(unit.lower())
    if scale is None:
        return None
    # NOTE: exact arithmetic: a float turns "1152921504606846975" into 2**60.
    whole = whole.lstrip("0") or "0"
    decimals = (decimals or "").rstrip("0")
    if len(whole) > len(str(MAX_BYTES)):  # also keeps int() within its digit limit
        return MAX_BYTES + 1
    if len(decimals) > _MAX_DECIMALS:
        raise ConfigError(f"{where}: more than {_MAX_DECIMALS} decimals in a size")
    number = Fraction(int(whole + decimals), 10 ** len(decimals))
    return math.floor(number * scale)


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
    """Registered tier kind: `"hbm"`, `"dram"`, `"lmdb"`, `"remote"`, `"redis"`,
    `"mooncake"` or a plugin's."""
    capacity_bytes: int
    """Bytes of chunk payload the tier may hold."""
    name: str = ""
    """Name in stats and logs; defaults to the kind (two tiers of one kind need names)."""
    eviction: str = "lru"
    """Eviction policy name (`"lru"`, `"arc"`, `"2q"`); tiers that evict by themselves
    take only `"lru"`."""
    write_policy: WritePolicy = "write_through"
    """How chunks reach this tier from the one above; ignored for the top tier."""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Kind-specific keys (`path`, `url`, `device`, ...), validated by the tier itself."""
    index: int = 0
    """Position in the cascade, for error messages (`CacheConfig` numbers its tiers)."""

    def __post_init__(self) -> None:
        if not is_int(self.index) or self.index < 0:
            raise ConfigError(
                f"tiers[?].index: expected an integer >= 0, got {describe(self.index)}"
            )
        where = self.where
        if not isinstance(self.kind, str) or not self.kind:
            raise ConfigError(
                f"{where}.kind: required; expected a tier kind such as 'dram', "
                f"got {describe(self.kind)}"
            )
        # NOTE: 0 is allowed here (a tier refuses a capacity below one chunk itself); a
        # loaded config's capacity is > 0.
        if not is_int(self.capacity_bytes) or not 0 <= self.capacity_bytes <= MAX_BYTES:
            raise ConfigError(
                f"{where}.capacity: expected a byte count from 0 to 2**60, "
                f"got {describe(self.capacity_bytes)}"
            )
        if not isinstance(self.name, str):
            raise ConfigError(f"{where}.name: expected a string, got {describe(self.name)}")
        if not isinstance(self.eviction, str):
            raise ConfigError(
                f"{where}.eviction: expected a policy name such as 'lru' or 'arc', "
                f"got {describe(self.eviction)}"
            )
        if not isinstance(self.write_policy, str) or self.write_policy not in _WRITE_POLICIES:
            raise ConfigError(
                f"{where}.write_policy: expected 'write_through' or 'write_back', "
                f"got {describe(self.write_policy)}"
            )
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"{where}.options: expected a table, got {describe(self.options)}")
        # A read-only copy: the caller's dict may change after this.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

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

    def __post_init__(self) -> None:
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise ConfigError(
                f"metrics.port: expected a TCP port 0-65535, got {describe(self.port)}"
            )
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"metrics.host: expected an address, got {describe(self.host)}")


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
    copy_threads: int = 0
    """Threads that copy one large batch between host memory and a memory tier (the
    calling thread included); 0: the usable cores, at most 4; 1: no extra thread."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", _numbered(self.tiers))
        if self.layout is not None and not isinstance(self.layout, KVLayout):
            raise ConfigError(f"layout: expected a KVLayout or None, got {describe(self.layout)}")
        check_int("write_queue_chunks", self.write_queue_chunks, 1, MAX_DIM)
        events = self.events
        if not is_int(events) or not 0 <= events < 2**31:
            raise ConfigError(
                f"events: expected an integer in [0, 2**31) (the event queue's capacity; 0 is "
                f"off), got {describe(events)}"
            )
        if self.metrics is not None and not isinstance(self.metrics, MetricsConfig):
            raise ConfigError(
                f"metrics: expected a MetricsConfig or None, got {describe(self.metrics)}"
            )
        if not isinstance(self.concurrent_reads, bool):
            raise ConfigError(
                f"concurrent_reads: expected true or false, got {describe(self.concurrent_reads)}"
            )
        check_int("copy_threads", self.copy_threads, 0, _MAX_COPY_THREADS)

    def with_layout(self, layout: KVLayout) -> CacheConfig:
        """Return a copy of this config with `layout` set."""
        return dataclasses.replace(self, layout=layout)


def _numbered(tiers: object) -> tuple[TierConfig, ...]:
    """Return `tiers` as a tuple, each tier's index its position; names must differ."""
    if not isinstance(tiers, tuple | list) or not tiers:
        raise ConfigError(f"tiers: expected a non-empty list of tier tables, got {describe(tiers)}")
    out: list[TierConfig] = []
    names: set[str] = set()
    for i, tier in enumerate(tiers):
        if not isinstance(tier, TierConfig):
            raise ConfigError(f"tiers[{i}]: expected a TierConfig, got {describe(tier)}")
        tier = tier if tier.index == i else dataclasses.replace(tier, index=i)
        name = tier.name or tier.kind  # a tier's default name is its kind
        if name in names:
            raise ConfigError(
                f"tiers[{i}].name: {describe(name)} is used twice; two tiers of one kind "
                "need distinct names"
            )
        names.add(name)
        out.append(tier)
    return tuple(out)


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> CacheConfig:
    """Load and validate a config from a TOML or YAML file, or a dict.

    Raises:
        ConfigError: the file cannot be read or parsed, or a field is invalid; the message
            starts with the field's path and, for a file, ends with `(in PATH)`.
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
        raise ConfigError(f"config: expected a text path, got {describe(source)}") from exc
    data = read_config_file(path)
    try:
        return _parse(data)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in {path})") from exc


def _key(key: object) -> str:
    """Return a config key as a message names it: quoted if long, or with a line break."""
    if isinstance(key, str) and len(key) <= _MAX_KEY_SHOWN and key.isprintable():
        return key
    return describe(key)


def _parse(data: Mapping[str, Any]) -> CacheConfig:
    keys = {
        "layout",
        "tiers",
        "write_queue_chunks",
        "events",
        "metrics",
        "concurrent_reads",
        "copy_threads",
    }
    unknown = sorted(map(_key, set(data) - keys))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key; expected {', '.join(sorted(keys))}")
    layout = _parse_layout(data["layout"]) if "layout" in data else None
    raw_tiers = data.get("tiers")
    if not isinstance(raw_tiers, list) or not raw_tiers:
        raise ConfigError(
            f"tiers: expected a non-empty list of tier tables, got {describe(raw_tiers)}"
        )
    tiers = tuple(_parse_tier(i, raw) for i, raw in enumerate(raw_tiers))
    metrics = _parse_metrics(data["metrics"]) if "metrics" in data else None
    return CacheConfig(
        tiers,
        layout,
        write_queue_chunks=data.get("write_queue_chunks", 256),
        events=data.get("events", 0),
        metrics=metrics,
        concurrent_reads=data.get("concurrent_reads", True),
        copy_threads=data.get("copy_threads", 0),
    )


def _parse_layout(raw: object) -> KVLayout:
    """Return the `[layout]` table as a `KVLayout`, naming an unknown key as its path."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"layout: expected a table, got {describe(raw)}")
    known = sorted(f.name for f in dataclasses.fields(KVLayout))
    unknown = sorted(map(_key, set(raw) - set(known)))
    if unknown:  # named here, as every other key is (`KVLayout` shows it raw)
        raise ConfigError(f"layout.{unknown[0]}: unknown key; expected one of {', '.join(known)}")
    try:
        return KVLayout.from_dict(dict(raw))
    except TypeError as exc:
        raise ConfigError(f"layout: {exc}") from exc


def _parse_metrics(raw: object) -> MetricsConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"metrics: expected a table with a port, got {describe(raw)}")
    unknown = sorted(map(_key, set(raw) - {"port", "host"}))
    if unknown:
        raise ConfigError(f"metrics.{unknown[0]}: unknown key; expected port, host")
    if "port" not in raw:
        raise ConfigError("metrics.port: required; expected a TCP port 0-65535")
    return MetricsConfig(raw["port"], raw.get("host", "127.0.0.1"))


def _parse_tier(i: int, raw: object) -> TierConfig:
    where = f"tiers[{i}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a table, got {describe(raw)}")
    _check_misspelt(raw, where)
    kind = raw.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(
            f"{where}.kind: required; expected a tier kind such as 'dram', got {describe(kind)}"
        )
    if "capacity" not in raw:
        raise ConfigError(f"{where}.capacity: required; expected a size such as '16GiB'")
    capacity = parse_size(raw["capacity"], where=f"{where}.capacity")
    if capacity <= 0:
        raise ConfigError(f"{where}.capacity: must be greater than zero")
    name = raw.get("name", kind)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name: expected a non-empty string, got {describe(name)}")
    return TierConfig(
        kind=kind,
        capacity_bytes=capacity,
        name=name,
        eviction=raw.get("eviction", "lru"),
        write_policy=raw.get("write_policy", "write_through"),
        options={k: v for k, v in raw.items() if k not in _COMMON_TIER_KEYS},
        index=i,
    )


def _check_misspelt(raw: Mapping[Any, Any], where: str) -> None:
    """Refuse a key that is a near miss of a common tier key the table lacks.

    Without this, `capcity` would be passed on as a kind option, and the error would say
    that `capacity` is missing, or that `eviciton` is not an option of the kind.
    """
    missing = sorted(_COMMON_TIER_KEYS - set(raw))
    for key in raw:
        if not isinstance(key, str) or key in _COMMON_TIER_KEYS:
            continue
        near = difflib.get_close_matches(key, missing, n=1, cutoff=_NEAR_MISS)
        if near:
            raise ConfigError(f"{where}.{_key(key)}: unknown key; did you mean {near[0]!r}?")
