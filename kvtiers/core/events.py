"""KV events for routers: which chunks became resident in, or left, a tier.

A router that places requests by cache affinity (vLLM's `BlockStored`/`BlockRemoved`,
SGLang's `take_events`) needs to know what each cache holds. The cache appends events to a
bounded `EventQueue` as it moves chunks, and `TieredCache.take_events` drains it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["ChunkRemoved", "ChunkStored", "Event", "EventQueue"]


@dataclass(frozen=True, slots=True)
class ChunkStored:
    """A chunk became resident in a tier."""

    tier: str
    """The tier's name."""
    key: bytes
    """The chunk key."""
    num_tokens: int
    """Tokens the chunk covers (the layout's chunk size)."""


@dataclass(frozen=True, slots=True)
class ChunkRemoved:
    """A chunk left a tier: the cache evicted or dropped it."""

    tier: str
    """The tier's name."""
    key: bytes
    """The chunk key."""
    num_tokens: int
    """Tokens the chunk covers (the layout's chunk size)."""


Event = ChunkStored | ChunkRemoved


class EventQueue:
    """A bounded FIFO of events; when full, the oldest event is dropped and counted.

    Args:
        maxlen: events held at most; must be at least 1.
    """

    __slots__ = ("_buf", "dropped", "maxlen")

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen: expected an integer >= 1, got {maxlen}")
        self.maxlen = maxlen
        self._buf: deque[Event] = deque(maxlen=maxlen)
        self.dropped = 0
        """Events dropped because the queue was full, since it was made."""

    def __len__(self) -> int:
        return len(self._buf)

    def append(self, event: Event) -> None:
        """Append `event`, dropping the oldest one when the queue is full."""
        if len(self._buf) == self.maxlen:
            self.dropped += 1
        self._buf.append(event)

    def drain(self) -> list[Event]:
        """Return the queued events, oldest first, and empty the queue."""
        buf, self._buf = self._buf, deque(maxlen=self.maxlen)
        return list(buf)
