"""The index-only replay equals plain reference simulations, tier by tier."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers.eviction import available_policies
from kvtiers.replay import TierSpec, ideal_hits, replay
from tests.replay._factories import (
    CONVERSATION,
    SYNTHETIC,
    random_chains,
    reference_hits,
    reference_lru_hits,
    trace_from_chains,
    trace_head,
)

SLICES = [(CONVERSATION, 600), (SYNTHETIC, 400)]


@pytest.fixture(scope="module", params=SLICES, ids=["conversation", "synthetic"])
def trace_slice(request):
    path, num_requests = request.param
    return trace_head(path, num_requests)


@pytest.mark.parametrize("share", [0.05, 0.10])
def test_lru_equals_the_textbook_lru(trace_slice, share):
    capacity = int(share * trace_slice.unique_blocks)
    result = replay(trace_slice, [TierSpec("dram", capacity, "lru")])
    assert result.hits == reference_lru_hits(trace_slice, capacity)


@pytest.mark.parametrize("policy", available_policies())
@pytest.mark.parametrize("share", [0.05, 0.10])
def test_every_policy_equals_the_reference(trace_slice, policy, share):
    capacity = int(share * trace_slice.unique_blocks)
    result = replay(trace_slice, [TierSpec("dram", capacity, policy)])
    assert result.hits == reference_hits(trace_slice, policy, capacity)
    assert result.policy == policy


@settings(max_examples=60, deadline=None)
@given(
    chains=random_chains(),
    capacity=st.integers(1, 12),
    policy=st.sampled_from(available_policies()),
)
def test_random_traces_equal_the_reference(tmp_path_factory, chains, capacity, policy):
    trace = trace_from_chains(tmp_path_factory.mktemp("t") / "t.jsonl", chains)
    result = replay(trace, [TierSpec("dram", capacity, policy)])
    assert result.hits == reference_hits(trace, policy, capacity)
    if policy == "lru":
        assert result.hits == reference_lru_hits(trace, capacity)


def test_per_request_hits_add_up(trace_slice):
    result = replay(trace_slice, [TierSpec("dram", 500, "arc")])
    assert sum(result.request_hits[0]) == result.hits == result.tiers[0].hits
    for ids, hits in zip(trace_slice.requests, result.request_hits[0], strict=True):
        assert hits <= len(ids)


def test_a_cache_holding_everything_reaches_the_ideal(trace_slice):
    capacity = trace_slice.unique_blocks
    for policy in available_policies():
        result = replay(trace_slice, [TierSpec("dram", capacity, policy)])
        assert result.hits == ideal_hits(trace_slice)
        assert result.tiers[0].evictions == 0


def test_accounting_of_one_tier(trace_slice):
    result = replay(trace_slice, [TierSpec("dram", 300, "2q")])
    tier = result.tiers[0]
    assert tier.inserts - tier.evictions <= 300
    assert tier.inserts >= trace_slice.unique_blocks
    assert result.total_blocks == trace_slice.total_blocks
    assert result.capacity_blocks == 300
    assert result.hit_rate == result.hits / trace_slice.total_blocks


def test_write_through_cascade_is_inclusive_for_lru(trace_slice):
    # LRU's stack property: a smaller LRU fed the same blocks holds a subset of a larger one,
    # so the top tier serves what a lone small LRU would, and the cascade what a lone large one.
    small, large = 150, 600
    cascade = replay(
        trace_slice,
        [TierSpec("dram", small, "lru"), TierSpec("disk", large, "lru", "lmdb")],
    )
    alone_small = replay(trace_slice, [TierSpec("dram", small, "lru")])
    alone_large = replay(trace_slice, [TierSpec("dram", large, "lru")])
    assert cascade.tiers[0].hits == alone_small.hits
    assert cascade.hits == alone_large.hits
    assert cascade.capacity_blocks == small + large


def test_write_back_tier_receives_what_the_top_evicts(trace_slice):
    cascade = replay(
        trace_slice,
        [
            TierSpec("dram", 150, "lru"),
            TierSpec("disk", 5000, "lru", "lmdb", write_policy="write_back"),
        ],
    )
    top, below = cascade.tiers
    assert below.inserts <= top.evictions
    assert below.inserts > 0
    assert below.hits > 0
    alone = replay(trace_slice, [TierSpec("dram", 150, "lru")])
    assert top.hits == alone.hits  # the tier below does not change the top tier's order
    assert cascade.hits > alone.hits


def test_progress_counts_every_request(trace_slice):
    seen: list[int] = []
    replay(trace_slice, [TierSpec("dram", 100, "lru")], progress=seen.append)
    assert sum(seen) == trace_slice.num_requests


def test_needs_a_tier_and_known_policies(trace_slice):
    with pytest.raises(ValueError, match="at least one tier"):
        replay(trace_slice, [])
    with pytest.raises(KeyError):
        replay(trace_slice, [TierSpec("dram", 10, "no-such-policy")])
    with pytest.raises(ValueError, match="capacity"):
        TierSpec("dram", 0, "lru")
