"""Eviction policies: `LRUPolicy`, `ARCPolicy`, `TwoQPolicy`, and a registry by config name.

`HintedPolicy` wraps any of them to take the caller's reuse hints (chunks stored cold).
"""

from __future__ import annotations

from kvtiers.eviction.arc import ARCPolicy
from kvtiers.eviction.base import EvictionPolicy
from kvtiers.eviction.hinted import HintedPolicy
from kvtiers.eviction.lru import LRUPolicy
from kvtiers.eviction.twoq import TwoQPolicy

__all__ = [
    "ARCPolicy",
    "EvictionPolicy",
    "HintedPolicy",
    "LRUPolicy",
    "TwoQPolicy",
    "available_policies",
    "make_policy",
]

_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy, "2q": TwoQPolicy}


def available_policies() -> list[str]:
    """Return the config names of the built-in policies."""
    return sorted(_POLICIES)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Return a new policy by config name.

    Raises:
        KeyError: no policy has that name.
    """
    return _POLICIES[name](capacity)
