"""The SGLang backend's options: its keys of `--hicache-storage-backend-extra-config`."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvtiers.core.errors import ConfigError

__all__ = ["BackendOptions", "default_config"]

#: Extra-config keys that SGLang's factory or HiCache itself read (passed through).
_SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
)
#: Extra-config keys of this backend.
_OWN_KEYS = frozenset({"config", "salt", "timeout", "model_name", "pools"})
_WHERE = "hicache-storage-backend-extra-config"

ConfigSource = str | Mapping[str, Any]


def default_config() -> dict[str, Any]:
    """Return the tiers used when the extra config names none: one LMDB tier in /tmp."""
    path = os.path.join(tempfile.gettempdir(), "kvtiers-sglang")
    return {"tiers": [{"kind": "lmdb", "path": path, "capacity": "16GiB"}]}


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """What the backend reads from SGLang's extra config, validated."""

    source: ConfigSource = field(default_factory=default_config)
    """The kvtiers config: a file path or a table (`config`)."""
    salt: str | None = None
    """Salt of every key (`salt`): servers with another salt share no page."""
    model: str | None = None
    """Model name in the keys, instead of SGLang's (`model_name`)."""
    timeout: float = 60.0
    """Seconds a call may take before it is served as a miss (`timeout`)."""
    pools: Mapping[str, ConfigSource] = field(default_factory=lambda: MappingProxyType({}))
    """A config per extra pool name (`pools`), for pools that should not take the KV
    config's tiers (each LMDB path suffixed with the pool's name)."""

    @classmethod
    def from_extra_config(cls, raw: Mapping[str, Any] | None) -> BackendOptions:
        """Validate SGLang's extra config (the keys SGLang reads itself pass through).

        Raises:
            ConfigError: an unknown key, or a bad value; the message names it.
        """
        options = dict(raw or {})
        unknown = sorted(set(options) - _SGLANG_KEYS - _OWN_KEYS, key=str)
        if unknown:
            raise ConfigError(
                f"{_WHERE}.{unknown[0]}: unknown key; kvtiers reads {', '.join(sorted(_OWN_KEYS))}"
            )
        source = options.get("config")
        if source is None:
            source = default_config()
        elif not isinstance(source, str | Mapping) or not source:
            raise ConfigError(
                f"{_WHERE}.config: expected a file path or a non-empty table, got {source!r}"
            )
        timeout = options.get("timeout", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ConfigError(f"{_WHERE}.timeout: expected seconds, got {timeout!r}")
        if not 0 < timeout < math.inf:
            raise ConfigError(f"{_WHERE}.timeout: must be positive and finite, got {timeout}")
        for name in ("salt", "model_name"):
            if not isinstance(options.get(name, ""), str):
                raise ConfigError(
                    f"{_WHERE}.{name}: expected a string, got {type(options[name]).__name__}"
                )
        pools = options.get("pools")
        pools = {} if pools is None else pools  # an empty list is refused below
        if not isinstance(pools, Mapping) or not all(
            isinstance(name, str) and isinstance(value, str | Mapping)
            for name, value in pools.items()
        ):
            raise ConfigError(
                f"{_WHERE}.pools: expected a table of pool names to config paths or tables"
            )
        return cls(
            source,
            options.get("salt"),
            options.get("model_name"),
            float(timeout),
            MappingProxyType(dict(pools)),
        )
