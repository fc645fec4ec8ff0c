"""Reuse hints: derived from a trace's future, replayed as the cache takes them."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers.replay import TierSpec, Trace, replay
from kvtiers.replay.hints import flip_hints, future_hints, hints_for, turn_hints
from tests.replay._factories import CONVERSATION, random_chains, trace_from_chains, trace_head


def textbook_hinted_lru(trace: Trace, capacity: int, hints: list[int]) -> int:
    """LRU with a FIFO of cold blocks in front of it, in two `OrderedDict`s."""
    cold: OrderedDict[int, None] = OrderedDict()
    warm: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids, keep in zip(trace.requests, hints, strict=True):
        for i in ids:
            if i not in cold and i not in warm:
                break
            hits += 1
        for n in range(len(ids) - 1, -1, -1):
            i = ids[n]
            if i in warm or i in cold or n < keep:
                cold.pop(i, None)
                warm[i] = None
                warm.move_to_end(i)
            else:
                cold[i] = None
        while len(cold) + len(warm) > capacity:
            (cold if cold else warm).popitem(last=False)
    return hits


def test_hints_count_the_blocks_a_later_request_shares(tmp_path):
    # 0: [0 1 2]; 1 continues 0 past its last block; 2 shares only block 0; 3 is alone.
    chains = [[0, 1, 2], [0, 1, 3, 4], [0, 5], [6, 7]]
    trace = trace_from_chains(tmp_path / "t.jsonl", chains)
    assert future_hints(trace) == [2, 1, 0, 0]
    assert turn_hints(trace) == [3, 0, 0, 0]
    assert hints_for(trace, "future").blocks == tuple(future_hints(trace))
    with pytest.raises(ValueError, match="unknown hints 'x'; expected one of turns, future"):
        hints_for(trace, "x")


def test_flipped_hints_turn_the_word_on_a_share_of_requests(tmp_path):
    trace = trace_from_chains(tmp_path / "t.jsonl", [[0, 1, 2], [0, 1, 3, 4], [0, 5], [6, 7]])
    hints = turn_hints(trace)
    assert flip_hints(trace, hints, 0.0) == hints
    assert flip_hints(trace, hints, 1.0) == [0, 4, 2, 2]
    flipped = flip_hints(trace, hints, 0.5, seed=3)
    assert sum(a != b for a, b in zip(flipped, hints, strict=True)) == 2
    with pytest.raises(ValueError, match="share must be between 0 and 1"):
        flip_hints(trace, hints, 1.5)


def test_hinted_replay_equals_the_textbook_on_a_real_trace():
    trace = trace_head(CONVERSATION, 600)
    capacity = int(0.05 * trace.unique_blocks)
    for hints in (turn_hints(trace), future_hints(trace)):
        result = replay(trace, [TierSpec("dram", capacity, "lru")], hints=hints)
        assert result.hits == textbook_hinted_lru(trace, capacity, hints)
    plain = replay(trace, [TierSpec("dram", capacity, "lru")])
    keep_all = [len(ids) for ids in trace.requests]
    assert replay(trace, [TierSpec("dram", capacity, "lru")], hints=keep_all).hits == plain.hits


@settings(max_examples=60, deadline=None)
@given(chains=random_chains(), capacity=st.integers(1, 12), data=st.data())
def test_random_hints_equal_the_textbook(tmp_path_factory, chains, capacity, data):
    trace = trace_from_chains(tmp_path_factory.mktemp("t") / "t.jsonl", chains)
    hints = [data.draw(st.integers(0, len(ids))) for ids in trace.requests]
    result = replay(trace, [TierSpec("dram", capacity, "lru")], hints=hints)
    assert result.hits == textbook_hinted_lru(trace, capacity, hints)


def test_hints_must_cover_every_request(tmp_path):
    trace = trace_from_chains(tmp_path / "t.jsonl", [[0], [0, 1]])
    with pytest.raises(ValueError, match="1 hints for 2 requests"):
        replay(trace, [TierSpec("dram", 1, "lru")], hints=[0])
