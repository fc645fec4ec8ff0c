"""The Adaptive Replacement Cache (ARC) eviction policy.

ARC is described in N. Megiddo and D. S. Modha, "ARC: A Self-Tuning, Low Overhead Replacement
Cache", Proceedings of the 2nd USENIX Conference on File and Storage Technologies (FAST '03),
2003, pp. 115-130.

ARC keeps two resident lists, T1 (keys seen once recently) and T2 (keys seen at least twice),
and two ghost lists of keys it evicted from them, B1 and B2, which hold no data. A hit on a
ghost in B1 says T1 was too small, so the target size `p` of T1 grows; a hit in B2 shrinks it.
Evictions take from T1 while it is above target, otherwise from T2. A one-time scan therefore
only churns T1 and leaves the frequently used keys in T2 alone.

Mapping onto `EvictionPolicy`: the paper's cache both decides and evicts; here the tier owner
evicts, so REPLACE becomes the order of `candidates()`, the ghost bookkeeping of a miss
happens in `insert()`, and the move of a victim into its ghost list happens in `evicted()`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import NamedTuple

from kvtiers.eviction.base import EvictionPolicy

__all__ = ["ARCListSizes", "ARCPolicy"]


class ARCListSizes(NamedTuple):
    """The lengths of ARC's four lists."""

    t1: int
    """Resident keys seen once recently."""
    t2: int
    """Resident keys seen at least twice recently."""
    b1: int
    """Ghosts evicted from T1."""
    b2: int
    """Ghosts evicted from T2."""


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (ARC) eviction policy.

    Each of T1, T2, B1 and B2 is an `OrderedDict` whose first key is its LRU end, so every
    operation is O(1) amortised. While the owner keeps at most `capacity` keys resident, the
    lists satisfy |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c, and 0 <= p <= c.

    Args:
        capacity: how many entries the tier holds when full (c in the paper).
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        # The target size of T1. A float: the paper adapts it by ratios such as |B2| / |B1|.
        self._p = 0.0
        # Whether the last insert was a hit in B2; REPLACE breaks the |T1| == p tie with it.
        self._last_hit_b2 = False

    @property
    def p(self) -> float:
        """Return the adaptive target size of T1, between 0 and `capacity`."""
        return self._p

    def list_sizes(self) -> ARCListSizes:
        """Return the lengths of T1, T2, B1 and B2.

        Returns:
            The four lengths, as a named tuple.
        """
        return ARCListSizes(len(self._t1), len(self._t2), len(self._b1), len(self._b2))

    def ghosts(self) -> Iterator[Hashable]:
        """Yield the ghost keys (evicted, remembered, not resident).

        Yields:
            The keys of B1, then of B2, each from its LRU end.
        """
        yield from self._b1
        yield from self._b2

    def __len__(self) -> int:
        # docstring inherited
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        # docstring inherited
        return key in self._t1 or key in self._t2

    def insert(self, key: Hashable) -> None:
        # docstring inherited
        if key in self._t1 or key in self._t2:
            self._last_hit_b2 = False
            self.touch(key)
            return
        if key in self._b1:
            # Case II: T1 was too small; grow its target.
            delta = max(len(self._b2) / len(self._b1), 1.0)
            self._p = min(self._p + delta, float(self.capacity))
            del self._b1[key]
            self._t2[key] = None
            self._last_hit_b2 = False
        elif key in self._b2:
            # Case III: T2 was too small; shrink T1's target.
            delta = max(len(self._b1) / len(self._b2), 1.0)
            self._p = max(self._p - delta, 0.0)
            del self._b2[key]
            self._t2[key] = None
            self._last_hit_b2 = True
        else:
            # Case IV: a key never seen (or long forgotten) enters T1.
            self._t1[key] = None
            self._last_hit_b2 = False
        self._trim_ghosts()

    def touch(self, key: Hashable) -> None:
        # docstring inherited
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def evicted(self, key: Hashable) -> None:
        # docstring inherited
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def remove(self, key: Hashable) -> None:
        # docstring inherited
        for entries in (self._t1, self._t2, self._b1, self._b2):
            entries.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        # docstring inherited
        num_t1 = len(self._t1)
        if num_t1 and (num_t1 > self._p or (num_t1 == self._p and self._last_hit_b2)):
            yield from self._t1
            yield from self._t2
        else:
            yield from self._t2
            yield from self._t1

    def _trim_ghosts(self) -> None:
        """Drop ghosts from their LRU ends until the list-size bounds hold again."""
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            if self._b2:
                self._b2.popitem(last=False)
            elif self._b1:
                self._b1.popitem(last=False)
            else:
                # Only residents left: the owner holds more than 2c keys; nothing to trim.
                break
