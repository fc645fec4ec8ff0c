"""TTFT and prefill throughput of a replay, through the cost model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtiers.costmodel import Compute, ModelSpec, TierLink, break_even_bandwidth, ttft_seconds
from kvtiers.replay.simulate import RunResult
from kvtiers.replay.trace import Trace

__all__ = ["CostSetup", "TTFTSummary", "percentile", "summarize_ttft", "ttft_without_cache"]


@dataclass(frozen=True, slots=True)
class CostSetup:
    """What the cost model needs besides the replay: model, compute, and tier links."""

    model: ModelSpec
    compute: Compute
    links: tuple[TierLink, ...]
    """One per simulated tier, top first."""

    def break_even(self, num_tokens: int) -> tuple[float, ...]:
        """Return, per tier, the bandwidth at which loading `num_tokens` ties recompute."""
        return tuple(
            break_even_bandwidth(self.model, self.compute, num_tokens, link.latency)
            for link in self.links
        )


@dataclass(frozen=True, slots=True)
class TTFTSummary:
    """Per-request TTFT with the cache of one run, and the prefill compute it saved."""

    with_cache: tuple[float, ...]
    """Seconds, per request."""
    compute_with: float
    """Total prefill compute seconds with the cache (loads excluded)."""
    compute_without: float
    """Total prefill compute seconds without a cache."""

    @property
    def throughput_gain(self) -> float:
        """Return how many times more prefill the same compute serves with the cache."""
        return self.compute_without / self.compute_with if self.compute_with else 1.0


def ttft_without_cache(trace: Trace, setup: CostSetup) -> tuple[float, ...]:
    """Return each request's TTFT without a cache (its whole prompt prefilled)."""
    return tuple(
        setup.compute.prefill_seconds(setup.model, n) if n else 0.0 for n in trace.input_tokens
    )


def summarize_ttft(trace: Trace, run: RunResult, setup: CostSetup) -> TTFTSummary:
    """Return the TTFT of each request of `run`, and its prefill compute with and without.

    A request's cached tokens are its hit blocks times the block size, capped one short of
    its prompt; each tier serves its share at its own bandwidth and latency.
    """
    model, compute, links = setup.model, setup.compute, setup.links
    block = trace.block_tokens
    ttfts: list[float] = []
    compute_with = compute_without = 0.0
    for r, num_tokens in enumerate(trace.input_tokens):
        loads = [
            (link, hits[r] * block) for link, hits in zip(links, run.request_hits, strict=True)
        ]
        ttfts.append(ttft_seconds(model, compute, num_tokens, loads))
        cached = min(sum(tokens for _, tokens in loads), max(num_tokens - 1, 0))
        compute_with += compute.prefill_seconds(model, num_tokens - cached, cached)
        compute_without += compute.prefill_seconds(model, num_tokens)
    return TTFTSummary(tuple(ttfts), compute_with, compute_without)


def percentile(samples: Sequence[float], q: float) -> float:
    """Return the `q`-th percentile (0-100) of `samples`, linearly interpolated."""
    if not samples:
        return 0.0
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
