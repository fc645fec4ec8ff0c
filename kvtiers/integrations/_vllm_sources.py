"""Which kind of tier a hit loads from, for vLLM's cache-hit-source metrics.

vLLM counts cached prompt tokens by source (`vllm:prompt_tokens_cached_by_source`): the
connector splits the tokens it supplies by the tier each chunk loads from. This module
works in the sources' string values, so it imports no vLLM and is tested with plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtiers.core.config import TierConfig

__all__ = ["UNKNOWN", "by_source", "sources_of", "tokens_by_tier"]

UNKNOWN = "external_unspecified"
"""vLLM's source for an external store, or for tokens of no known tier."""

_KIND_SOURCES = {"hbm": "device", "dram": "host", "lmdb": "disk"}
"""vLLM's source values by tier kind: a DRAM tier is `host`, LMDB `disk`. The pooled
stores (remote, Mooncake, Redis, plugins) are `external_unspecified`."""


def sources_of(tiers: Sequence[TierConfig]) -> dict[str, str]:
    """Return vLLM's source value for each tier, by tier name, top tier first."""
    return {tc.name or tc.kind: _KIND_SOURCES.get(tc.kind, UNKNOWN) for tc in tiers}


def tokens_by_tier(tiers: Sequence[str], chunk: int, start: int, end: int) -> dict[str, int]:
    """Count tokens `[start, end)` by the tier of their chunk ("" past `tiers`).

    Args:
        tiers: the tier name of each chunk of the hit (`LookupResult.tiers`).
        chunk: the chunk size in tokens.
        start: the first token loaded.
        end: the end of the tokens loaded.
    """
    counts: dict[str, int] = {}
    for idx in range(start // chunk, -(-end // chunk)):
        tier = tiers[idx] if idx < len(tiers) else ""
        span = min(end, (idx + 1) * chunk) - max(start, idx * chunk)
        counts[tier] = counts.get(tier, 0) + span
    return counts


def by_source(
    tokens: Mapping[str, int], sources: Mapping[str, str], num_tokens: int
) -> dict[str, int]:
    """Sum tokens by tier into tokens by source; all `UNKNOWN` unless they add up.

    Args:
        tokens: tokens by tier name (`tokens_by_tier`).
        sources: the source of each tier name (`sources_of`).
        num_tokens: the tokens vLLM took from kvtiers; the result always sums to it.
    """
    if num_tokens <= 0:
        return {}
    split: dict[str, int] = {}
    for tier, count in tokens.items():
        source = sources.get(tier, UNKNOWN)
        split[source] = split.get(source, 0) + count
    if sum(split.values()) != num_tokens:
        # NOTE: vLLM's accounting may take fewer tokens than were planned (a preempted
        # request re-admitted): then no tier is claimed, as vLLM itself does on a mismatch.
        return {UNKNOWN: num_tokens}
    return {source: count for source, count in split.items() if count}
