"""The config of a cache kept beside an engine's KV cache, for state that is not KV.

A hybrid model's extra state (SGLang's extra HiCache pools, a state-space model's Mamba
state in vLLM) has its own page size and shape, so it gets a `TieredCache` of its own. Its
tiers are the KV config's, with each LMDB path suffixed `-<name>` (an LMDB environment
opens once per process), unless the user names a config of its own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvtiers.core.config import CacheConfig, load_config
from kvtiers.core.errors import ConfigError

__all__ = ["lmdb_paths", "pool_config"]

_OPTIONS = "hicache-storage-backend-extra-config"


def pool_config(
    source: str | Mapping[str, Any],
    own: str | Mapping[str, Any] | None,
    name: str,
    where: str | None = None,
) -> CacheConfig:
    """Return the config of the cache that holds pool `name`.

    `own` (the pool's own config, as the user named it) is used as it is. Otherwise the
    KV config's tiers are taken with each `path` suffixed `-<name>`, and without the
    metrics endpoint and the event queue (the KV cache serves those).

    Args:
        source: the KV cache's config.
        own: the pool's own config, if the user named one.
        name: the pool's name (the LMDB path suffix).
        where: the option naming `own`, for messages; SGLang's `pools.<name>` by default.

    Raises:
        ConfigError: a config cannot be read or is invalid.
    """
    if own is not None:
        config = load_config(own)
        clash = lmdb_paths(config) & lmdb_paths(load_config(source))
        if clash:
            option = where or f"{_OPTIONS}.pools.{name}"
            raise ConfigError(
                f"{option}: lmdb path {min(clash)!r} is the KV cache's; "
                f"an LMDB environment opens once per process, so give the pool its own"
            )
        return config
    config = load_config(source)
    tiers = []
    for tier in config.tiers:
        options = dict(tier.options)
        if isinstance(options.get("path"), str):
            options["path"] = f"{options['path'].rstrip('/')}-{name}"
        tiers.append(dataclasses.replace(tier, options=MappingProxyType(options)))
    return dataclasses.replace(config, tiers=tuple(tiers), metrics=None, events=0)


def lmdb_paths(config: CacheConfig) -> set[str]:
    """Return the resolved paths of a config's LMDB tiers."""
    return {
        os.path.realpath(tier.options["path"])
        for tier in config.tiers
        if tier.kind == "lmdb" and isinstance(tier.options.get("path"), str)
    }
