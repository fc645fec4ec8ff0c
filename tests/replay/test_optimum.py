"""Belady with prefix semantics: the true optimum, never beaten by a policy."""

from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers.eviction import available_policies
from kvtiers.replay import TierSpec, Trace, ideal_hits, optimum, replay
from tests.replay._factories import (
    CONVERSATION,
    SYNTHETIC,
    random_chains,
    trace_from_chains,
    trace_head,
)


def brute_force_hits(trace: Trace, capacity: int) -> int:
    """Return the most hits any eviction schedule gets, by trying them all."""
    requests = trace.requests

    @functools.cache
    def best(r: int, cached: frozenset[int]) -> int:
        if r == len(requests):
            return 0
        ids = requests[r]
        hits = 0
        for i in ids:
            if i not in cached:
                break
            hits += 1
        pool = sorted(cached | set(ids))
        keep = min(capacity, len(pool))
        return hits + max(
            best(r + 1, frozenset(kept)) for kept in itertools.combinations(pool, keep)
        )

    return best(0, frozenset())


@settings(max_examples=80, deadline=None)
@given(chains=random_chains(max_requests=6, max_fresh=2), capacity=st.integers(1, 4))
def test_belady_equals_the_brute_force_optimum(tmp_path_factory, chains, capacity):
    trace = trace_from_chains(tmp_path_factory.mktemp("t") / "t.jsonl", chains)
    assert optimum(trace, capacity).hits == brute_force_hits(trace, capacity)


@settings(max_examples=60, deadline=None)
@given(chains=random_chains(), capacity=st.integers(1, 12))
def test_no_policy_beats_belady_on_random_traces(tmp_path_factory, chains, capacity):
    trace = trace_from_chains(tmp_path_factory.mktemp("t") / "t.jsonl", chains)
    best = optimum(trace, capacity).hits
    assert best <= ideal_hits(trace)
    for policy in available_policies():
        assert replay(trace, [TierSpec("dram", capacity, policy)]).hits <= best


@pytest.mark.parametrize(("path", "num_requests"), [(CONVERSATION, 500), (SYNTHETIC, 400)])
def test_no_policy_beats_belady_on_the_real_traces(path, num_requests):
    trace = trace_head(path, num_requests)
    for share in (0.05, 0.10):
        capacity = int(share * trace.unique_blocks)
        best = optimum(trace, capacity)
        assert best.capacity_blocks == capacity
        for policy in available_policies():
            assert replay(trace, [TierSpec("dram", capacity, policy)]).hits <= best.hits


def test_belady_with_room_for_everything_is_the_ideal():
    trace = trace_head(SYNTHETIC, 400)
    assert optimum(trace, trace.unique_blocks).hits == ideal_hits(trace)


def test_ideal_counts_leading_blocks_seen_before(tmp_path):
    trace = trace_from_chains(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6]])
    # Request 2: blocks 1, 2; request 3: block 1; request 4: blocks 1, 2, 3.
    assert ideal_hits(trace) == 6


def test_belady_keeps_the_block_used_soonest(tmp_path):
    # Capacity 1: after [a], [b], the optimum keeps b (used next), not a (used later).
    trace = trace_from_chains(tmp_path / "t.jsonl", [[1], [2], [2], [1]])
    assert optimum(trace, 1).hits == 1
    assert replay(trace, [TierSpec("dram", 1, "lru")]).hits == 1


def test_progress_counts_every_request():
    trace = trace_head(SYNTHETIC, 300)
    seen: list[int] = []
    optimum(trace, 50, progress=seen.append)
    assert sum(seen) == 300


def test_capacity_below_one_block_raises():
    with pytest.raises(ValueError, match="capacity"):
        optimum(trace_head(SYNTHETIC, 5), 0)
