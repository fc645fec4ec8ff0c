"""The bounded KV event queue."""

from __future__ import annotations

import dataclasses

import pytest

from kvtiers.core.events import ChunkRemoved, ChunkStored, EventQueue


def stored(i: int) -> ChunkStored:
    return ChunkStored("dram", bytes([i]) * 16, 16)


def test_drain_returns_events_in_order_and_empties_the_queue():
    queue = EventQueue(8)
    events = [stored(1), ChunkRemoved("dram", bytes(16), 16), stored(2)]
    for event in events:
        queue.append(event)
    assert len(queue) == 3
    assert queue.drain() == events
    assert queue.drain() == [] and len(queue) == 0
    assert queue.dropped == 0


def test_full_queue_drops_the_oldest_and_counts_them():
    queue = EventQueue(3)
    for i in range(5):
        queue.append(stored(i))
    assert queue.dropped == 2
    assert queue.drain() == [stored(2), stored(3), stored(4)]
    queue.append(stored(9))  # room again after a drain
    assert queue.dropped == 2 and queue.drain() == [stored(9)]


def test_events_are_frozen_values():
    event = stored(1)
    assert event == stored(1) and hash(event) == hash(stored(1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.tier = "lmdb"  # type: ignore[misc]


@pytest.mark.parametrize("maxlen", [0, -1])
def test_queue_needs_room_for_one_event(maxlen):
    with pytest.raises(ValueError, match="maxlen"):
        EventQueue(maxlen)
