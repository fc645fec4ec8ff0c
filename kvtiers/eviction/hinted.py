"""Reuse hints on top of any eviction policy: what the caller expects no reuse of goes first.

A policy sees only accesses, and on LLM traces they say little about which chunk comes back:
on the conversation trace three quarters of the blocks are never requested again, and a
block seen once is as likely to return as any other (docs/benchmarks.md, "Policies on real
traces"). The caller often knows more. A chat application knows whether a conversation goes
on, an agent that its next call extends this context, a document Q&A service which part of
the prompt is the shared document and which the one-off question. `HintedPolicy` takes that
knowledge as a hint per stored chunk: a chunk stored without expected reuse (`insert_cold`)
waits in a queue of its own, evicted before anything the wrapped policy orders, until a hit
shows the hint wrong and moves it into the wrapped policy as a new entry. An owner that
makes room before it inserts (`TieredCache`) takes room for a cold chunk only from other
cold ones (`cold_candidates`): a chunk no one expects back never evicts one someone does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from kvtiers.eviction.base import EvictionPolicy

__all__ = ["HintedPolicy"]


class HintedPolicy(EvictionPolicy):
    """Evict chunks stored with no expected reuse first, then by the wrapped policy.

    Cold entries (`insert_cold`) are kept apart, oldest first, and never reach the wrapped
    policy unless they are hit (`touch`) or stored again without the hint (`insert`): a
    wrong hint costs one miss, and a policy with history (ARC's ghosts) learns nothing
    from entries it never held. An entry the wrapped policy holds is never made cold: a
    hint of one request does not override another's use. With no cold entries this orders
    exactly as the wrapped policy.

    Args:
        inner: the policy that orders every entry not cold.
    """

    name = "hinted"

    def __init__(self, inner: EvictionPolicy) -> None:
        super().__init__(inner.capacity)
        self.inner = inner
        # Invariant: no key is both here and resident in `inner`; first key is the oldest.
        self._cold: OrderedDict[Hashable, None] = OrderedDict()
        self.cold_inserts = 0
        """Entries that became resident cold (`insert_cold` of a key not held)."""
        self.cold_hits = 0
        """Of those, entries hit while cold (`touch`): hints proven wrong."""

    @property
    def num_cold(self) -> int:
        """Return the resident entries stored cold and not hit since."""
        return len(self._cold)

    def __len__(self) -> int:
        # docstring inherited
        return len(self._cold) + len(self.inner)

    def __contains__(self, key: object) -> bool:
        # docstring inherited
        return key in self._cold or key in self.inner

    def insert(self, key: Hashable) -> None:
        # docstring inherited
        self._cold.pop(key, None)
        self.inner.insert(key)

    def is_cold(self, key: Hashable) -> bool:
        """Return whether `key` is resident and cold (stored cold, not hit since)."""
        return key in self._cold

    def insert_cold(self, key: Hashable) -> None:
        """Record that `key` became resident with no reuse expected: evict it first.

        A key the wrapped policy holds stays where it is; a cold key becomes the newest.
        """
        if key in self.inner:
            return
        self.cold_inserts += key not in self._cold
        self._cold[key] = None
        self._cold.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        # docstring inherited
        if key in self._cold:
            del self._cold[key]
            self.cold_hits += 1
            self.inner.insert(key)
        else:
            self.inner.touch(key)

    def evicted(self, key: Hashable) -> None:
        # docstring inherited
        if key in self._cold:
            del self._cold[key]
        else:
            self.inner.evicted(key)

    def remove(self, key: Hashable) -> None:
        # docstring inherited
        self._cold.pop(key, None)
        self.inner.remove(key)

    def candidates(self) -> Iterator[Hashable]:
        # docstring inherited
        yield from self._cold
        yield from self.inner.candidates()

    def cold_candidates(self) -> Iterator[Hashable]:
        """Yield the cold entries only, oldest first: the room a cold entry may take."""
        yield from self._cold
