"""The mooncake tier's record of its pool: the chunks it knows there, least recent first.

The store reports no usage of one tier's chunks and evicts by itself when its segments
fill, so the tier bounds by capacity only the chunks this process knows to be in the pool
(its writes and its hits), and evicts the least recently used of them to make room. The
record may be wrong both ways: another process's chunk is in it only once read here, and
a chunk the store dropped stays in it until a read, a `contains` or a `put` of it finds
it gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvtiers.core.keys import ChunkKey

__all__ = ["KnownChunks"]


class KnownChunks:
    """The chunks this process knows to be in the pool, least recently used first.

    Args:
        max_entries: the most chunks the tier's capacity holds.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()  # least recent first
        self._cold: OrderedDict[ChunkKey, None] = OrderedDict()  # put cold, oldest first

    def __len__(self) -> int:
        return len(self._keys) + len(self._cold)

    def __contains__(self, key: object) -> bool:
        return key in self._keys or key in self._cold

    def add(self, key: ChunkKey) -> None:
        """Record `key` as stored; a new key becomes the most recent."""
        if key not in self._cold:
            self._keys[key] = None

    def settle(self, keys: Sequence[ChunkKey], cold: Collection[ChunkKey]) -> int:
        """Make a batch's known `keys` (prefix first) the most recent, the prefix first.

        Those among `cold` (put with no reuse expected) become the newest cold chunks
        instead, the last one first: cold chunks are evicted before all others until read.

        Returns:
            How many known keys became cold.
        """
        parked = 0
        for key in reversed(keys):
            if key in self:
                self._keys.pop(key, None)
                self._cold.pop(key, None)
                parked += key in cold
                (self._cold if key in cold else self._keys)[key] = None
        return parked

    def forget(self, key: ChunkKey) -> None:
        """Drop `key` from the record, if it is there."""
        self._keys.pop(key, None)
        self._cold.pop(key, None)

    def note_reads(self, keys: Sequence[ChunkKey], hits: Sequence[bool]) -> int:
        """Record a read: each hit becomes the most recent, each miss is forgotten.

        Hits on other processes' chunks may take the record past `max_entries`; the
        least recent are then forgotten (not evicted: they stay in the pool).

        Returns:
            How many hits were cold chunks (put cold here, not read since).
        """
        cold_hits = 0
        for key, hit in zip(keys, hits, strict=True):
            was_cold = key in self._cold
            self._cold.pop(key, None)
            if hit:
                cold_hits += was_cold
                self._keys[key] = None
                self._keys.move_to_end(key)
            else:
                self._keys.pop(key, None)
        while len(self) > self.max_entries:  # others' chunks read: forget the oldest
            (self._cold or self._keys).popitem(last=False)
        return cold_hits

    def admit(
        self,
        order: Sequence[ChunkKey],
        held: dict[ChunkKey, bool],
        cold: Collection[ChunkKey] = (),
    ) -> tuple[list[ChunkKey], list[ChunkKey]]:
        """Plan a `put` of the distinct keys `order`: what to write, and what to evict.

        Each key of `order` that is known is set in `held` and becomes the most recent
        (cold no more). A new key among `cold` takes room only from free entries and cold
        chunks.

        Returns:
            The keys to write (the new ones that fit, in order) and the known keys to
            evict to make room for them (cold, then least recent first; none of the
            batch's).
        """
        for key in order:
            if key in self:
                held[key] = True
                self._cold.pop(key, None)
                self._keys[key] = None
                self._keys.move_to_end(key)
        free = self.max_entries - len(self)
        spare_cold = iter([key for key in self._cold if key not in held])
        spare_warm = iter([key for key in self._keys if key not in held])
        new: list[ChunkKey] = []
        victims: list[ChunkKey] = []
        for key in (key for key in order if not held[key]):
            if free > 0:
                free -= 1
            elif (victim := next(spare_cold, None)) is not None or (
                key not in cold and (victim := next(spare_warm, None)) is not None
            ):
                victims.append(victim)
            else:
                break  # NOTE: once a new chunk does not fit, no deeper one is stored
            new.append(key)
        return new, victims
