"""Errors raised by kvtiers.

Every error kvtiers raises derives from `KVTiersError`; errors about bad input also derive
from `ValueError`, so callers that already catch that keep working::

    KVTiersError
    ├── ConfigError            a config key is missing, unknown or out of range
    ├── InvalidInputError      bad arguments to a cache call (also a ValueError)
    │   ├── TokenError         tokens that are not a 1-D sequence of non-negative ints
    │   └── LayoutMismatch     KV whose shape, dtype or length does not match the layout
    ├── CacheStateError        a call on a cache that is not open, or reopened after close
    └── TierError              a tier failed in a way that is not a plain miss
        ├── TierIOError        the backend (LMDB, object store) failed
        └── TierFullError      a value can never fit (bigger than the tier's capacity)

A miss is never an error: tiers report it as `False` in the slot of a batch result, and the
reason (corrupt entry, foreign layout, declined write) is counted in the stats.
"""

from __future__ import annotations

__all__ = [
    "CacheStateError",
    "ConfigError",
    "InvalidInputError",
    "KVTiersError",
    "LayoutMismatch",
    "TierError",
    "TierFullError",
    "TierIOError",
    "TokenError",
]


class KVTiersError(Exception):
    """Base class of every error kvtiers raises."""


class ConfigError(KVTiersError, ValueError):
    """A config value is missing, unknown or invalid; the message names the field."""


class InvalidInputError(KVTiersError, ValueError):
    """An argument to a cache call is invalid; nothing was changed."""


class TokenError(InvalidInputError):
    """Tokens are not a 1-D sequence of non-negative integers."""


class LayoutMismatch(InvalidInputError):
    """A KV tensor does not match the cache's layout (shape, dtype or length)."""


class CacheStateError(KVTiersError, RuntimeError):
    """The cache is not open, or was closed, or is opened a second time."""


class TierError(KVTiersError):
    """A tier failed in a way that is not a plain miss."""


class TierIOError(TierError, OSError):
    """The tier's backend failed (an LMDB environment, an object store)."""


class TierFullError(TierError):
    """A value can never fit in the tier, whatever it evicts."""
