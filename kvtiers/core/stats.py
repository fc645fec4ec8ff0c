"""Counters of a cache and its tiers, and their frozen snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["CacheStats", "TierCounters", "TierStats", "TierUsage"]


@dataclass(frozen=True, slots=True)
class TierUsage:
    """How full a tier is."""

    capacity_bytes: int
    """Bytes of chunk data the tier may hold."""
    used_bytes: int
    """Bytes of chunk data held now."""
    num_entries: int
    """Chunks held now."""


@dataclass(slots=True)
class TierCounters:
    """Running counters of one tier, kept by the tier and the cache (mutable)."""

    hits: int = 0
    """Chunks the tier returned."""
    misses: int = 0
    """Chunks asked of the tier that it did not return."""
    bytes_read: int = 0
    """Payload bytes read from the tier."""
    bytes_written: int = 0
    """Payload bytes written to the tier."""
    puts: int = 0
    """Chunks written to the tier."""
    declined: int = 0
    """Chunks the tier declined to write (full, pinned out, failed write)."""
    evictions: int = 0
    """Chunks evicted from the tier to make room."""
    promotions: int = 0
    """Chunks copied up into this tier from a lower one on load."""
    demotions: int = 0
    """Chunks written down into this tier when the tier above evicted them."""
    corrupt: int = 0
    """Entries that failed their checksum or header check (deleted, served as misses)."""
    foreign: int = 0
    """Entries of another layout or key found under a key (deleted, served as misses)."""
    forged: int = 0
    """Of `corrupt`, entries without a valid integrity tag (tiers with `integrity` on)."""
    errors: int = 0
    """Backend failures turned into misses or declined writes."""

    def snapshot(self, name: str, kind: str, usage: TierUsage) -> TierStats:
        """Return a frozen copy of the counters with the tier's usage."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return TierStats(name=name, kind=kind, usage=usage, **values)


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier's counters; field meanings as in `TierCounters`."""

    name: str
    kind: str
    usage: TierUsage
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    declined: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    corrupt: int = 0
    foreign: int = 0
    forged: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a cache's counters."""

    lookups: int = 0
    """Calls to `lookup`."""
    lookup_tokens: int = 0
    """Tokens asked about by `lookup`, partial tail chunks included."""
    hit_tokens: int = 0
    """Tokens `lookup` reported cached."""
    loads: int = 0
    """Calls to `load`."""
    loaded_tokens: int = 0
    """Tokens `load` returned."""
    loaded_bytes: int = 0
    """KV bytes `load` returned."""
    load_seconds: float = 0.0
    """Wall time spent in `load`."""
    stores: int = 0
    """Calls to `store`."""
    stored_tokens: int = 0
    """Tokens newly stored (already cached chunks excluded)."""
    write_queue_chunks: int = 0
    """Chunks waiting in write-through queues now."""
    miss_reasons: dict[str, int] = field(default_factory=dict)
    """Why lookups and loads fell short, by reason: per lookup that missed a chunk,
    "never_stored", "evicted" or "tier_error" for the chunk after the hit prefix; per load
    that delivered fewer chunks than the index knew of, "corrupt", "tier_error" or
    "load_short". See docs/operations.md for what to change for each."""
    events_dropped: int = 0
    """KV events dropped because the event queue was full (see `TieredCache.take_events`)."""
    tiers: tuple[TierStats, ...] = field(default_factory=tuple)
    """Per-tier snapshots, top first."""

    @property
    def hit_rate(self) -> float:
        """Return the fraction of looked-up tokens found cached."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def load_bandwidth(self) -> float:
        """Return the bytes per second `load` delivered (0 before any load)."""
        return self.loaded_bytes / self.load_seconds if self.load_seconds > 0 else 0.0
