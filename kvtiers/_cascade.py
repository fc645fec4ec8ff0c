"""Build a cache's tier cascade from its config: each tier, its slot and its policy."""

from __future__ import annotations

from typing import Any

from kvtiers._slot import Slot
from kvtiers.core.config import CacheConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from kvtiers.eviction import HintedPolicy, available_policies, make_policy
from kvtiers.gpu.hbm import HBMTier
from kvtiers.gpu.pinned import pinned_allocator
from kvtiers.tiers.base import HostCopy
from kvtiers.tiers.dram import MemoryTier
from kvtiers.tiers.registry import TierRegistry

__all__ = ["build_slots"]


def build_slots(
    config: CacheConfig, layout: KVLayout, registry: TierRegistry, host_copy: HostCopy
) -> list[Slot]:
    """Return the slots of the config's tiers, top first, each tier built (not opened).

    Every `dram` tier shares one pinned-memory allocator; block tiers in host memory, and
    `hbm` tiers on their CPU seam, copy with `host_copy` (the cache's copy threads).

    Raises:
        ConfigError: an unknown tier kind or policy, or a write-back tier under a tier that
            evicts by itself.
    """
    slots: list[Slot] = []
    allocate = None
    for tc in config.tiers:
        cls = registry.resolve(tc.kind, where=tc.where)
        resources: dict[str, Any] = {}
        if issubclass(cls, MemoryTier) and tc.kind == "dram":
            if allocate is None:
                allocate = pinned_allocator()
            resources["allocate"] = allocate
        if issubclass(cls, MemoryTier | HBMTier):
            resources["host_copy"] = host_copy
        tier = cls.from_config(tc, layout, **resources)
        policy = None
        if not cls.manages_eviction:
            if tc.eviction not in available_policies():
                raise ConfigError(
                    f"{tc.where}.eviction: unknown policy {tc.eviction!r}; expected one of "
                    f"{', '.join(available_policies())}"
                )
            capacity = getattr(tier, "num_chunks", None) or max(
                1, tc.capacity_bytes // layout.chunk_bytes
            )
            policy = HintedPolicy(make_policy(tc.eviction, capacity))
        if tc.index > 0 and tc.write_policy == "write_back" and slots[-1].policy is None:
            raise ConfigError(
                f"{tc.where}.write_policy: 'write_back' needs the tier above to be evicted by "
                f"the cache, but {slots[-1].config.kind!r} evicts by itself; use 'write_through'"
            )
        slots.append(Slot(idx=tc.index, tier=tier, config=tc, policy=policy))
    return slots
