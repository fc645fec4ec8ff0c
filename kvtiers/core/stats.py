"""Counters of a cache and its tiers, and their frozen snapshots."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, fields

__all__ = [
    "LATENCY_BUCKETS",
    "CacheStats",
    "LatencyHistogram",
    "LatencySnapshot",
    "StoreHealth",
    "TierCounters",
    "TierStats",
    "TierUsage",
]

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds in seconds of the latency buckets (100 µs to 10 s; slower goes to +Inf)."""


@dataclass(frozen=True, slots=True)
class LatencySnapshot:
    """How long an operation took, as counts per bucket."""

    bounds: tuple[float, ...]
    """Upper bounds of the buckets in seconds, ascending (a duration equal to one counts in
    its bucket, as Prometheus' `le` does)."""
    counts: tuple[int, ...]
    """Operations per bucket, not cumulative; one more entry than `bounds`: the +Inf bucket."""
    total_seconds: float
    """Sum of all the durations."""

    @property
    def count(self) -> int:
        """Return the number of operations."""
        return sum(self.counts)

    def quantile(self, q: float) -> float:
        """Return the upper bound of the bucket holding quantile `q` (0 < q <= 1).

        `inf` when it lies past the last bound; 0.0 when nothing was recorded.
        """
        total = self.count
        if not total:
            return 0.0
        rank, seen = q * total, 0
        for bound, num in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += num
            if seen >= rank:
                return bound
        return float("inf")


@dataclass(slots=True)
class LatencyHistogram:
    """Durations of one operation in the fixed `LATENCY_BUCKETS` (mutable).

    Recording costs one bisect and two additions, so operations record every call.
    """

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total_seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        """Record one operation that took `seconds`."""
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total_seconds += seconds

    def snapshot(self) -> LatencySnapshot:
        """Return a frozen copy."""
        return LatencySnapshot(LATENCY_BUCKETS, tuple(self.counts), self.total_seconds)


def _snapshots(histograms: dict[str, LatencyHistogram]) -> dict[str, LatencySnapshot]:
    return {op: hist.snapshot() for op, hist in sorted(histograms.items())}


@dataclass(frozen=True, slots=True)
class TierUsage:
    """How full a tier is."""

    capacity_bytes: int
    """Bytes of chunk data the tier may hold."""
    used_bytes: int
    """Bytes of chunk data held now."""
    num_entries: int
    """Chunks held now."""


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """How a tier's remote store is doing, as its requests saw it."""

    breaker: str
    """The circuit breaker's state: "closed", "open" or "half_open"."""
    io: dict[str, int]
    """Request counters (requests, retries, failures, timeouts, refused, ...)."""


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
    timeouts: int = 0
    """Of `errors`, requests given up for want of an answer (a request timeout, or a read
    still running at the read deadline)."""
    unavailable: int = 0
    """Calls answered with misses at once, sending no request, because the store's circuit
    breaker was open."""
    cold_puts: int = 0
    """Chunks that entered the tier cold, past a reuse hint (`store(..., keep_tokens=)`):
    kept apart to be evicted first. For a memory tier its policy at the cache counts them;
    a tier that evicts by itself (lmdb, remote, redis, mooncake) counts those it wrote."""
    cold_hits: int = 0
    """Of `cold_puts`, chunks read while still cold: the hint was wrong for them. A tier
    that evicts by itself counts the reads this process made (lmdb: as it records their
    recency, with its next write or at close); a chunk another process wrote cold counts
    here too, without a `cold_puts` of this process."""
    latency: dict[str, LatencyHistogram] = field(default_factory=dict)
    """Durations of the cache's calls to the tier, by operation ("contains", "get", "put",
    "delete")."""

    def read(self, hits: int, misses: int, num_bytes: int) -> None:
        """Count a read that returned `hits` chunks, `num_bytes` in all, and missed `misses`."""
        self.hits += hits
        self.misses += misses
        self.bytes_read += num_bytes

    def fail(self, count: int = 1, *, timed_out: bool = False) -> None:
        """Count `count` failed requests that were served as misses or declined."""
        self.errors += count
        if timed_out:
            self.timeouts += count

    def observe(self, op: str, seconds: float) -> None:
        """Record that a call of `op` to the tier took `seconds`."""
        hist = self.latency.get(op)
        if hist is None:
            hist = self.latency[op] = LatencyHistogram()
        hist.observe(seconds)

    def snapshot(
        self,
        name: str,
        kind: str,
        usage: TierUsage,
        *,
        breaker: str | None = None,
        io: dict[str, int] | None = None,
    ) -> TierStats:
        """Return a frozen copy of the counters with the tier's usage (and store health)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "latency"}
        return TierStats(
            name=name,
            kind=kind,
            usage=usage,
            **values,
            latency=_snapshots(self.latency),
            breaker=breaker,
            io=dict(io or {}),
        )


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
    timeouts: int = 0
    unavailable: int = 0
    cold_puts: int = 0
    cold_hits: int = 0
    latency: dict[str, LatencySnapshot] = field(default_factory=dict)
    breaker: str | None = None
    """The state of the tier's circuit breaker ("closed", "open", "half_open"); `None` for a
    tier without one (dram, lmdb)."""
    io: dict[str, int] = field(default_factory=dict)
    """What requests to the tier's store went through (requests, retries, failures,
    timeouts, refused, dropped_writes, full); empty for a tier without a remote store."""


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
    """Why lookups and loads fell short, by reason: per lookup that missed a chunk, for the
    chunk after the hit prefix, "never_stored", "evicted", "salt_mismatch", "timeout" or
    "tier_unavailable"; per load that delivered fewer chunks than the index knew of,
    "corrupt", "layout_mismatch", "timeout", "tier_unavailable" or "load_short". See
    docs/operations.md for what to change for each."""
    evicted_from: dict[str, int] = field(default_factory=dict)
    """Of the "evicted" misses, per tier that dropped the chunk last (the tier to grow)."""
    events_dropped: int = 0
    """KV events dropped because the event queue was full (see `TieredCache.take_events`)."""
    latency: dict[str, LatencySnapshot] = field(default_factory=dict)
    """Durations of the cache's calls, by operation: "lookup" (`lookup`, `lookup_keys`),
    "load" (`load`, `load_paged`, `get_chunks`), "store" (`store`, `store_paged`,
    `put_chunks`)."""
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
