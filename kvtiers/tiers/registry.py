"""Tier kinds by config name: the built-ins plus plugins from the `kvtiers.tiers` entry points."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from kvtiers.core.errors import ConfigError
from kvtiers.tiers.base import Tier

__all__ = ["ENTRY_POINT_GROUP", "TierRegistry"]

ENTRY_POINT_GROUP = "kvtiers.tiers"

# Dotted paths, so that resolving a registry imports no backend (lmdb, torch) until used.
_BUILTIN: dict[str, str] = {
    "dram": "kvtiers.tiers.dram:DRAMTier",
    "hbm": "kvtiers.gpu.hbm:HBMTier",
    "lmdb": "kvtiers.tiers.lmdb:LMDBTier",
    "remote": "kvtiers.tiers.remote:RemoteTier",
}

# Install hints shown when a kind's module cannot be imported.
_HINTS: dict[str, str] = {
    "lmdb": "the lmdb tier needs the 'lmdb' package: pip install lmdb",
    "remote": (
        "the remote tier needs fsspec, plus s3fs for s3:// (pip install 'kvtiers[remote]') "
        "or gcsfs for gs:// (pip install gcsfs)"
    ),
}


class TierRegistry:
    """Map tier kinds to tier classes, resolving dotted paths lazily.

    A fresh registry holds the built-in kinds and those that installed packages declare in
    the `kvtiers.tiers` entry-point group. Built-ins cannot be replaced by a plugin unless
    `register` is called with `replace=True`.
    """

    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._targets: dict[str, str | type[Tier]] = dict(_BUILTIN)
        if load_entry_points:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                if ep.name not in self._targets:
                    self._targets[ep.name] = ep.value

    def register(self, kind: str, target: str | type[Tier], *, replace: bool = False) -> None:
        """Register a tier class (or a `"module:Class"` path) under `kind`.

        Raises:
            ValueError: `kind` is taken and `replace` is false.
        """
        if kind in self._targets and not replace:
            raise ValueError(f"tier kind {kind!r} is already registered")
        self._targets[kind] = target

    def kinds(self) -> list[str]:
        """Return the registered kinds, sorted."""
        return sorted(self._targets)

    def __contains__(self, kind: object) -> bool:
        return kind in self._targets

    def resolve(self, kind: str, *, where: str = "tiers[?]") -> type[Tier]:
        """Return the tier class of `kind`, importing it on first use.

        Raises:
            ConfigError: the kind is unknown or its module cannot be imported.
        """
        target = self._targets.get(kind)
        if target is None:
            raise ConfigError(
                f"{where}.kind: unknown tier kind {kind!r}; expected one of "
                f"{', '.join(self.kinds())}"
            )
        if isinstance(target, type):
            return target
        module_name, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            hint = _HINTS.get(kind, f"cannot import {target}")
            raise ConfigError(f"{where}.kind: {kind!r} is unavailable: {hint} ({exc})") from exc
        if not (isinstance(cls, type) and issubclass(cls, Tier)):
            raise ConfigError(f"{where}.kind: {target} is not a Tier subclass")
        self._targets[kind] = cls
        return cls
