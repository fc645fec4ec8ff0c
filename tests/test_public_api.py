"""The public surface is pinned: a change to it is a reviewed decision."""

from __future__ import annotations

import subprocess
import sys

import kvtiers


def test_exported_members():
    public = sorted(name for name in dir(kvtiers) if not name.startswith("_"))
    exported = sorted(name for name in kvtiers.__all__ if not name.startswith("_"))
    assert exported == [
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
        "load_config",
    ]
    for name in exported:
        assert name in public


def test_import_loads_no_backend():
    # Tier backends are resolved through the registry, on first use only.
    code = "import sys, kvtiers; print('lmdb' in sys.modules, 'fsspec' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
