"""A tier's place in the cache's cascade, with the cache's state for it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from kvtiers.core.config import TierConfig
from kvtiers.core.keys import ChunkKey
from kvtiers.eviction.hinted import HintedPolicy
from kvtiers.tiers.base import Buffer, Tier

__all__ = ["Slot", "View"]

View = Buffer | torch.Tensor
"""A block view: host bytes (DRAM) or a device tensor (HBM)."""


@dataclass(slots=True, eq=False)
class Slot:
    """One tier in the cascade with the cache's state for it."""

    idx: int
    """Position, top first; also the tier's bit in index masks."""
    tier: Tier
    config: TierConfig
    policy: HintedPolicy | None
    """The cache's eviction policy for it, taking reuse hints; `None` when the tier evicts
    by itself."""
    queue: asyncio.Queue[ChunkKey | None] | None = None
    """Write-through queue of chunk keys (`None` ends the writer)."""
    queued: set[ChunkKey] = field(default_factory=set)
    """Keys in the write-through queue or being written, so a key is queued once."""
    failed: dict[ChunkKey, None] = field(default_factory=dict)
    """Keys whose write-through copy failed because the tier or its store did (oldest
    first, bounded): a later hit in the top tier queues them again."""
    room: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the writer takes keys from the queue (or stops): calls waiting on a full
    queue look again."""
