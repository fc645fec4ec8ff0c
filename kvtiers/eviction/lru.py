"""The least-recently-used eviction policy."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from kvtiers.eviction.base import EvictionPolicy

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """Least Recently Used (LRU) eviction policy.

    Resident keys live in one `OrderedDict` whose order is recency: the first key is the least
    recently used, the last the most recently used. Every operation is O(1).

    Args:
        capacity: how many entries the tier holds when full.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Invariant: iteration order is least recently used first.
        self._entries: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        # docstring inherited
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        # docstring inherited
        return key in self._entries

    def insert(self, key: Hashable) -> None:
        # docstring inherited
        self._entries[key] = None
        self._entries.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        # docstring inherited
        if key in self._entries:
            self._entries.move_to_end(key)

    def evicted(self, key: Hashable) -> None:
        # docstring inherited
        self._entries.pop(key, None)

    def remove(self, key: Hashable) -> None:
        # docstring inherited
        self._entries.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        # docstring inherited
        yield from self._entries
