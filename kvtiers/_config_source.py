"""Where a `TieredCache` comes from: a config file, a dict or a `CacheConfig`, checked."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from kvtiers.core.config import CacheConfig, load_config
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from kvtiers.tiers.registry import TierRegistry

__all__ = ["PROBE_LAYOUT", "check_args", "config_of", "naming_file"]

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | CacheConfig

PROBE_LAYOUT = KVLayout("kvtiers-probe", 1, 1, 1, chunk_size=1)
"""The smallest layout: checks a config's tiers where no layout is known yet."""


def config_of(source: ConfigSource) -> CacheConfig:
    """Return `source` loaded (a TOML or YAML file, or a dict) and validated.

    Raises:
        ConfigError: the config is invalid; the message names the field.
    """
    return source if isinstance(source, CacheConfig) else load_config(source)


@contextlib.contextmanager
def naming_file(source: ConfigSource) -> Iterator[None]:
    """End the message of a `ConfigError` raised inside with `(in PATH)` for a file."""
    try:
        yield
    except ConfigError as exc:
        if isinstance(source, str | os.PathLike):
            raise ConfigError(f"{exc} (in {os.fspath(source)!s})") from exc
        raise


def check_args(config: Any, layout: Any, registry: Any) -> None:
    """Refuse arguments of `TieredCache` of the wrong types, naming what was given.

    Raises:
        ConfigError: `config` is no `CacheConfig`, `layout` no `KVLayout`, or `registry`
            no `TierRegistry`.
    """
    if not isinstance(config, CacheConfig):
        raise ConfigError(
            f"config: expected a CacheConfig, got {type(config).__name__} "
            "(TieredCache.from_config takes a path or a dict)"
        )
    if layout is not None and not isinstance(layout, KVLayout):
        raise ConfigError(f"layout: expected a KVLayout, got {type(layout).__name__}")
    if registry is not None and not isinstance(registry, TierRegistry):
        raise ConfigError(f"registry: expected a TierRegistry, got {type(registry).__name__}")
