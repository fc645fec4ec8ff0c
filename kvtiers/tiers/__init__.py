"""Storage tiers: the async `Tier` contract, the registry, and the built-in tiers."""

from __future__ import annotations

from kvtiers.tiers.base import Buffer, Tier, TierState
from kvtiers.tiers.registry import ENTRY_POINT_GROUP, TierRegistry

__all__ = ["ENTRY_POINT_GROUP", "Buffer", "Tier", "TierRegistry", "TierState"]
