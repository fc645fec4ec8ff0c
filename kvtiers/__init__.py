"""kvtiers: pool the KV cache of LLM inference across tiers and across requests.

The entry point is `TieredCache.from_config(path_or_dict)`, used with `async with`.
"""

from __future__ import annotations

from kvtiers.cache import CacheState, TieredCache
from kvtiers.core.config import CacheConfig, MetricsConfig, TierConfig, load_config
from kvtiers.core.errors import (
    CacheStateError,
    ConfigError,
    InvalidInputError,
    KVTiersError,
    LayoutMismatch,
    TierError,
    TierFullError,
    TierIOError,
    TokenError,
)
from kvtiers.core.events import ChunkRemoved, ChunkStored
from kvtiers.core.index import LookupResult
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import CacheStats, LatencySnapshot, StoreHealth, TierStats, TierUsage

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "CacheState",
    "CacheStateError",
    "CacheStats",
    "ChunkKey",
    "ChunkRemoved",
    "ChunkStored",
    "ConfigError",
    "InvalidInputError",
    "KVLayout",
    "KVTiersError",
    "LatencySnapshot",
    "LayoutMismatch",
    "LookupResult",
    "MetricsConfig",
    "StoreHealth",
    "TierConfig",
    "TierError",
    "TierFullError",
    "TierIOError",
    "TierStats",
    "TierUsage",
    "TieredCache",
    "TokenError",
    "__version__",
    "load_config",
]
