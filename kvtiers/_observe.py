"""What a `TieredCache` reports: stats, KV events, its Prometheus endpoint, call tallies."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

from kvtiers._movement import Mover
from kvtiers._slot import Slot
from kvtiers._tally import CallTally
from kvtiers.core.errors import InvalidInputError
from kvtiers.core.events import ChunkRemoved, ChunkStored, EventQueue
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import CacheStats, TierStats
from kvtiers.metrics import MetricsServer
from kvtiers.tiers.blocks import BlockTier

__all__ = ["ObservedCache"]


class ObservedCache:
    """Stats, events and metrics of a cache; mixed into `TieredCache`, whose state it reads."""

    layout: KVLayout
    _mover: Mover
    _slots: list[Slot]
    _tally: CallTally
    _events: EventQueue | None
    _metrics: MetricsServer | None
    _loop: asyncio.AbstractEventLoop | None

    if TYPE_CHECKING:  # provided by TieredCache

        def _is_closed(self) -> bool: ...

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus endpoint (`[metrics]` in the config), once open; else `None`."""
        return self._metrics.url if self._metrics is not None else None

    def _metric_labels(self) -> dict[str, str]:
        return {"model": self.layout.model, "tp_rank": str(self.layout.tp_rank)}

    async def _snapshot(self) -> CacheStats | None:
        return None if self._is_closed() else self.stats()

    def serve_metrics_of(self, other: ObservedCache) -> bool:
        """Serve `other`'s metrics on this cache's endpoint too, while `other` is open.

        For caches that one engine uses side by side (an SGLang hybrid model's extra
        pools): one endpoint to scrape. `other`'s samples carry its own labels (its
        layout's model and TP rank), and its stats are read on the loop that opened it.
        Callable from any thread; serving `other` again is a no-op.

        Returns:
            Whether this cache serves metrics (without a `[metrics]` table, or before
            `open`, nothing is kept).
        """
        if not isinstance(other, ObservedCache):
            raise InvalidInputError(f"other: expected a TieredCache, got {type(other).__name__}")
        loop = other._loop
        if self._metrics is None or loop is None or other is self:
            return False
        return self._metrics.add_source(id(other), other._snapshot, loop, other._metric_labels())

    def _record_load(self, num_chunks: int, start: float) -> None:
        size = self.layout.chunk_size
        seconds = time.perf_counter() - start
        self._tally.load(num_chunks * size, num_chunks * self.layout.chunk_bytes, seconds)

    def _record_store(self, new_chunks: int, start: float) -> int:
        stored = new_chunks * self.layout.chunk_size
        self._tally.store(stored, time.perf_counter() - start)
        return stored

    def take_events(self) -> list[ChunkStored | ChunkRemoved]:
        """Return the KV events since the last call, oldest first, and clear them.

        A `ChunkStored` says a chunk became resident in a tier (placed in the top tier,
        promoted, demoted, written through, or placed below when the top tier was full); a
        `ChunkRemoved` says the cache evicted or dropped one (evicted from a memory tier, a
        stale hint discarded, an entry found corrupt or missing on load), or that a tier
        evicting by itself (lmdb, remote) removed one this cache had placed there (by
        capacity or expiry; what other processes sharing the tier remove shows only when
        the cache next finds the chunk missing). Empty when the config's `events` is 0;
        when the queue is full the oldest events are dropped (`CacheStats.events_dropped`).
        """
        if self._events is None:
            return []
        self._mover.reap()
        return self._events.drain()

    def stats(self) -> CacheStats:
        """Return a snapshot of the cache's and every tier's counters."""
        t = self._tally
        return CacheStats(
            lookups=t.lookups,
            lookup_tokens=t.lookup_tokens,
            hit_tokens=t.hit_tokens,
            loads=t.loads,
            loaded_tokens=t.loaded_tokens,
            loaded_bytes=t.loaded_bytes,
            load_seconds=t.load_seconds,
            stores=t.stores,
            stored_tokens=t.stored_tokens,
            write_queue_chunks=self._mover.queued_chunks(),
            miss_reasons=dict(self._mover.miss_reasons),
            evicted_from=dict(self._mover.evicted_from),
            events_dropped=self._events.dropped if self._events is not None else 0,
            latency=t.latency(),
            tiers=tuple(_tier_stats(slot) for slot in self._slots),
        )

    def pin_count(self) -> int:
        """Return the pins held on memory-tier blocks now (zero when idle)."""
        return sum(slot.tier.total_pins for slot in self._slots if isinstance(slot.tier, BlockTier))


def _tier_stats(slot: Slot) -> TierStats:
    """Return a tier's stats, with what the cache's policy saw of reuse hints."""
    stats = slot.tier.stats()
    if slot.policy is None:
        return stats
    return dataclasses.replace(
        stats, cold_puts=slot.policy.cold_inserts, cold_hits=slot.policy.cold_hits
    )
