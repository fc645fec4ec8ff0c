"""The eviction policy interface, shared by every policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator

__all__ = ["EvictionPolicy"]


class EvictionPolicy(ABC):
    """Order the entries of one tier for eviction.

    A policy only orders keys; it never removes data. The tier owner calls `insert` when an
    entry arrives, `touch` on a hit, `evicted` when it evicted an entry (policies with history,
    such as ARC, remember it), and `remove` when an entry left for another reason (deleted,
    corrupt). `candidates` yields resident keys best-victim first; the owner skips those it
    cannot evict now (pinned, or not a leaf of the prefix trie) and takes the first it can.

    Args:
        capacity: how many entries the tier holds when full (ARC sizes its lists from it).
    """

    name: str = ""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 entry, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def __len__(self) -> int:
        """Return the number of resident entries (ghosts excluded)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Return whether `key` is resident (ghosts excluded)."""

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """Record that `key` became resident (a no-op touch if it already is)."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """Record a hit on resident `key`; unknown keys are ignored."""

    @abstractmethod
    def evicted(self, key: Hashable) -> None:
        """Record that resident `key` was evicted; unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Forget `key` without history (deleted, corrupt); unknown keys are ignored."""

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Yield resident keys, best victim first.

        The owner must not mutate the policy while iterating; it collects victims, then
        calls `evicted` for each.
        """
