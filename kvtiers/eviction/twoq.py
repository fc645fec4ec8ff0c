"""The 2Q eviction policy: a key earns a place in the main list on its second sight.

2Q is described in T. Johnson and D. Shasha, "2Q: A Low Overhead High Performance Buffer
Management Replacement Algorithm", Proceedings of the 20th VLDB Conference, 1994, pp. 439-450.

A key seen for the first time enters A1in, a probation list. A hit there (a second sight)
moves it to Am, the main LRU list. When A1in holds more than its share of the capacity, its
oldest keys are evicted first, and they are remembered in A1out, a ghost list that holds no
data: a key that comes back while its ghost is remembered goes straight to Am. One-time
chunks (the unique tail of each prompt) therefore churn A1in and leave the chunks that were
used twice in Am alone.

This is the paper's simplified 2Q (a hit in A1in promotes at once) with its two tunables
as shares of the capacity. The defaults differ from the paper's (A1in 25%, A1out 50%):
in KV-cache request traces the distance between two uses of a chunk is of the order of the
cache itself, so the probation list and the ghost history must be longer; on the Mooncake
traces (see docs/benchmarks.md) half and one capacity did best.

Mapping onto `EvictionPolicy`: the tier owner evicts, so the paper's reclaim step becomes the
order of `candidates()`, and the move of an A1in victim into A1out happens in `evicted()`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from itertools import islice
from typing import NamedTuple

from kvtiers.eviction.base import EvictionPolicy

__all__ = ["TwoQListSizes", "TwoQPolicy"]


class TwoQListSizes(NamedTuple):
    """The lengths of 2Q's three lists."""

    a1in: int
    """Resident keys on probation (seen once)."""
    am: int
    """Resident keys seen at least twice."""
    a1out: int
    """Ghosts of keys evicted from A1in."""


class TwoQPolicy(EvictionPolicy):
    """Two-queue (2Q) eviction policy: admit to the main list on the second sight.

    A1in, Am and A1out are `OrderedDict`s whose first key is the oldest, so every operation
    is O(1) amortised.

    Args:
        capacity: how many entries the tier holds when full.
        in_share: the share of `capacity` that A1in may hold before it is evicted first.
        ghost_share: the share of `capacity` that A1out remembers (at least one key).
    """

    name = "2q"

    def __init__(self, capacity: int, *, in_share: float = 0.5, ghost_share: float = 1.0) -> None:
        super().__init__(capacity)
        if not 0.0 < in_share <= 1.0:
            raise ValueError(f"in_share must be in (0, 1], got {in_share}")
        if ghost_share < 0.0:
            raise ValueError(f"ghost_share must be >= 0, got {ghost_share}")
        self.max_in = max(1, int(capacity * in_share))
        self.max_ghosts = max(1, int(capacity * ghost_share))
        self._a1in: OrderedDict[Hashable, None] = OrderedDict()
        self._am: OrderedDict[Hashable, None] = OrderedDict()
        self._a1out: OrderedDict[Hashable, None] = OrderedDict()

    def list_sizes(self) -> TwoQListSizes:
        """Return the lengths of A1in, Am and A1out."""
        return TwoQListSizes(len(self._a1in), len(self._am), len(self._a1out))

    def ghosts(self) -> Iterator[Hashable]:
        """Yield the keys of A1out (evicted on probation, remembered), oldest first."""
        yield from self._a1out

    def __len__(self) -> int:
        # docstring inherited
        return len(self._a1in) + len(self._am)

    def __contains__(self, key: object) -> bool:
        # docstring inherited
        return key in self._a1in or key in self._am

    def insert(self, key: Hashable) -> None:
        # docstring inherited
        if key in self._a1in or key in self._am:
            self.touch(key)
        elif key in self._a1out:
            # Seen before and evicted on probation: the second sight admits it.
            del self._a1out[key]
            self._am[key] = None
        else:
            self._a1in[key] = None

    def touch(self, key: Hashable) -> None:
        # docstring inherited
        if key in self._am:
            self._am.move_to_end(key)
        elif key in self._a1in:
            del self._a1in[key]
            self._am[key] = None

    def evicted(self, key: Hashable) -> None:
        # docstring inherited
        if key in self._a1in:
            del self._a1in[key]
            self._a1out[key] = None
            while len(self._a1out) > self.max_ghosts:
                self._a1out.popitem(last=False)
        else:
            self._am.pop(key, None)

    def remove(self, key: Hashable) -> None:
        # docstring inherited
        for entries in (self._a1in, self._am, self._a1out):
            entries.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        # docstring inherited
        # NOTE: A1in goes first only down to its share, so one large eviction batch takes
        # the same victims as the paper's one-at-a-time reclaim would.
        excess = len(self._a1in) - self.max_in
        if excess > 0:
            yield from islice(self._a1in, excess)
            yield from self._am
            yield from islice(self._a1in, excess, None)
        else:
            yield from self._am
            yield from self._a1in
