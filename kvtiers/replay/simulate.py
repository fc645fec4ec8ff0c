"""Replay a trace through the prefix index and the eviction policies, counting blocks only.

The index-only mode: tiers hold no bytes, only residency in the library's own `PrefixIndex`,
ordered by the library's own policies (`make_policy`), and evicted the way `TieredCache`
evicts (`PrefixIndex.pick_leaves`): a block with its branch, leaves first, so no tier holds
a suffix without its prefix.

Each request, in file order, one at a time:

1. Lookup: the leading blocks resident in some tier are hits (prefix semantics: a block
   hits only if every earlier block of the request hit), each served by the highest tier
   that holds it.
2. Offer: every block of the request, from its last to its first, is offered to the top
   tier (a resident block is touched, a missing one inserted, which also promotes lower-tier
   hits) and to every write-through tier below. The last-to-first order makes a prefix's
   head the most recent, the leaf-first order a trie gives.
3. Evict, top tier first, down to each tier's capacity. A write-back tier receives what the
   tier above evicts; a block served from it is touched.

With reuse hints (`kvtiers.replay.hints`: per request, the leading blocks the caller expects
to be requested again), each tier's policy is wrapped in `HintedPolicy`, and the blocks of a
request past its hint are inserted cold (evicted first until a hit), as `TieredCache.store`
does with `keep_tokens`: into the top tier and the write-through tiers, and a cold block
evicted into a write-back tier stays cold there.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from kvtiers.core.config import WritePolicy
from kvtiers.core.index import PrefixIndex
from kvtiers.core.keys import ChunkKey
from kvtiers.eviction import EvictionPolicy, HintedPolicy, make_policy
from kvtiers.replay.trace import Trace

__all__ = ["RunResult", "TierResult", "TierSpec", "replay"]

#: How many requests pass between two progress callbacks.
PROGRESS_EVERY = 256


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One simulated tier, top (fastest) first."""

    name: str
    """Name in reports."""
    capacity_blocks: int
    """Blocks the tier holds when full."""
    policy: str
    """Eviction policy name (`make_policy`)."""
    kind: str = "dram"
    """Tier kind (`"hbm"`, `"dram"`, `"lmdb"`, `"remote"`): picks the default bandwidth."""
    write_policy: WritePolicy = "write_through"
    """How blocks reach this tier from the one above; ignored for the top tier."""

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1:
            raise ValueError(f"tier {self.name}: capacity must be >= 1 block")


@dataclass(frozen=True, slots=True)
class TierResult:
    """What one tier did during a replay."""

    spec: TierSpec
    hits: int
    """Blocks served from this tier (the highest tier holding them)."""
    inserts: int
    """Blocks written into this tier."""
    evictions: int
    """Blocks evicted from this tier."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """The outcome of replaying one trace through one tier cascade."""

    policy: str
    """The top tier's eviction policy."""
    tiers: tuple[TierResult, ...]
    total_blocks: int
    """Blocks requested, over all requests."""
    request_hits: tuple[array[int], ...]
    """Per tier, the blocks of each request it served (aligned with the trace's requests)."""

    @property
    def capacity_blocks(self) -> int:
        """Return the blocks all tiers hold together."""
        return sum(t.spec.capacity_blocks for t in self.tiers)

    @property
    def hits(self) -> int:
        """Return the blocks served from cache, all tiers together."""
        return sum(t.hits for t in self.tiers)

    @property
    def hit_rate(self) -> float:
        """Return the share of requested blocks served from cache."""
        return self.hits / self.total_blocks if self.total_blocks else 0.0


class _Tier:
    """A tier's live state during a replay."""

    __slots__ = ("below", "evictions", "idx", "inserts", "policy", "resident", "spec")

    def __init__(self, idx: int, spec: TierSpec, hinted: bool) -> None:
        self.idx = idx
        self.spec = spec
        self.policy: EvictionPolicy = make_policy(spec.policy, spec.capacity_blocks)
        if hinted:
            self.policy = HintedPolicy(self.policy)
        self.resident = 0
        self.inserts = 0
        self.evictions = 0
        self.below: _Tier | None = None


def replay(
    trace: Trace,
    tiers: Sequence[TierSpec],
    *,
    progress: Callable[[int], None] | None = None,
    hints: Sequence[int] | None = None,
) -> RunResult:
    """Replay `trace` through a cascade of `tiers`, counting hits per tier.

    Args:
        trace: the requests, replayed in order.
        tiers: the cascade, top first; at least one.
        progress: called with the number of requests replayed since the last call.
        hints: per request, how many leading blocks the caller expects to be requested
            again (`kvtiers.replay.hints`); the others are stored cold. None: no hints.

    Returns:
        Hits, inserts and evictions per tier, and each request's hits per tier.

    Raises:
        ValueError: no tier, a tier names an unknown policy, or `hints` does not have
            one entry per request.
    """
    if not tiers:
        raise ValueError("replay needs at least one tier")
    if hints is not None and len(hints) != trace.num_requests:
        raise ValueError(f"{len(hints)} hints for {trace.num_requests} requests")
    live = [_Tier(i, spec, hints is not None) for i, spec in enumerate(tiers)]
    for upper, lower in zip(live, live[1:], strict=False):
        if lower.spec.write_policy == "write_back":
            upper.below = lower
    through = [t for t in live[1:] if t.spec.write_policy == "write_through"]
    index = PrefixIndex(len(live))
    request_hits = tuple(array("I", bytes(4 * trace.num_requests)) for _ in live)
    keys_of = trace.keys
    done = 0
    for r, ids in enumerate(trace.requests):
        keys = [keys_of[i] for i in ids]
        # The highest tier holding a block serves it: the lowest set bit of its mask.
        served = [(mask & -mask).bit_length() - 1 for mask in index.match(keys).tiers]
        for t in served:
            request_hits[t][r] += 1
        keep = len(keys) if hints is None else hints[r]
        for tier in (live[0], *through):
            _offer(index, tier, keys, keep)
        for i, t in enumerate(served):
            if t and live[t].spec.write_policy == "write_back":
                live[t].policy.touch(keys[i])
        for tier in live:
            _evict(index, tier)
        done += 1
        if progress is not None and done == PROGRESS_EVERY:
            progress(done)
            done = 0
    if progress is not None and done:
        progress(done)
    results = tuple(
        TierResult(t.spec, sum(hits), t.inserts, t.evictions)
        for t, hits in zip(live, request_hits, strict=True)
    )
    return RunResult(live[0].spec.policy, results, trace.total_blocks, request_hits)


def _offer(index: PrefixIndex, tier: _Tier, keys: list[ChunkKey], keep: int) -> None:
    """Touch the resident blocks of a request in `tier`, insert the rest; last block first.

    Blocks from `keep` on are inserted cold (the tier's policy is then a `HintedPolicy`).
    """
    policy, idx = tier.policy, tier.idx
    added = 0
    for i in range(len(keys) - 1, -1, -1):
        if index.add(keys, i, idx):
            if i < keep:
                policy.insert(keys[i])
            else:
                cast(HintedPolicy, policy).insert_cold(keys[i])
            added += 1
        else:
            policy.touch(keys[i])
    tier.resident += added
    tier.inserts += added


def _evict(index: PrefixIndex, tier: _Tier) -> None:
    """Evict branches of `tier`, leaves first, in policy order until within capacity."""
    while (need := tier.resident - tier.spec.capacity_blocks) > 0:
        victims = index.pick_leaves(tier.policy.candidates(), tier.idx, need)
        if not victims:
            return  # only a policy that hides residents gets here; the cache stops too
        below = tier.below
        for key in victims:
            if below is not None:
                # Before the discard, which may prune the node; a cold block stays cold.
                cold = isinstance(tier.policy, HintedPolicy) and tier.policy.is_cold(key)
                _demote(index, below, key, cold)
            index.discard(key, tier.idx)
            tier.policy.evicted(key)
        tier.resident -= len(victims)
        tier.evictions += len(victims)


def _demote(index: PrefixIndex, tier: _Tier, key: ChunkKey, cold: bool) -> None:
    """Write an evicted block into the write-back tier below (touch it if already there)."""
    if index.mark(key, tier.idx):
        if cold:
            cast(HintedPolicy, tier.policy).insert_cold(key)
        else:
            tier.policy.insert(key)
        tier.resident += 1
        tier.inserts += 1
    else:
        tier.policy.touch(key)
