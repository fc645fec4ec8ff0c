"""What a cache's calls did: how many, how many tokens and bytes, and how long they took."""

from __future__ import annotations

from kvtiers.core.stats import LatencyHistogram, LatencySnapshot

__all__ = ["CallTally"]


class CallTally:
    """Running totals of a cache's lookups, loads and stores, with their latencies.

    The cache records each call once, when it returns; everything runs on the cache's loop.
    """

    __slots__ = (
        "_latency",
        "hit_tokens",
        "load_seconds",
        "loaded_bytes",
        "loaded_tokens",
        "loads",
        "lookup_tokens",
        "lookups",
        "stored_tokens",
        "stores",
    )

    def __init__(self) -> None:
        self.lookups = self.lookup_tokens = self.hit_tokens = 0
        self.loads = self.loaded_tokens = self.loaded_bytes = 0
        self.load_seconds = 0.0
        self.stores = self.stored_tokens = 0
        self._latency = {op: LatencyHistogram() for op in ("lookup", "load", "store")}

    def lookup(self, asked_tokens: int, hit_tokens: int, seconds: float) -> None:
        """Record a lookup of `asked_tokens` that found `hit_tokens` cached."""
        self.lookups += 1
        self.lookup_tokens += asked_tokens
        self.hit_tokens += hit_tokens
        self._latency["lookup"].observe(seconds)

    def load(self, tokens: int, num_bytes: int, seconds: float) -> None:
        """Record a load that delivered `tokens` tokens (`num_bytes` of KV)."""
        self.loads += 1
        self.loaded_tokens += tokens
        self.loaded_bytes += num_bytes
        self.load_seconds += seconds
        self._latency["load"].observe(seconds)

    def store(self, new_tokens: int, seconds: float) -> None:
        """Record a store that cached `new_tokens` tokens no tier held before."""
        self.stores += 1
        self.stored_tokens += new_tokens
        self._latency["store"].observe(seconds)

    def latency(self) -> dict[str, LatencySnapshot]:
        """Return frozen copies of the latency histograms, by operation."""
        return {op: hist.snapshot() for op, hist in self._latency.items()}
