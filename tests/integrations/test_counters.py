"""Tests for `kvtiers.integrations._counters`."""

from __future__ import annotations

import threading

import pytest

from kvtiers.integrations._counters import Counters


def test_take_returns_the_non_zero_counts_once():
    counts = Counters()
    counts.add("lookups")
    counts.add("lookups", 2)
    counts.add("wait_seconds", 0.25)
    counts.add("errors", 0)
    assert counts.take() == {"lookups": 3, "wait_seconds": 0.25}
    assert counts.take() == {}


def test_adds_from_many_threads_are_all_counted():
    counts = Counters()
    taken: list[dict[str, float]] = []

    def add() -> None:
        for _ in range(10_000):
            counts.add("n")

    def take() -> None:
        for _ in range(200):
            taken.append(counts.take())

    threads = [threading.Thread(target=add) for _ in range(4)] + [threading.Thread(target=take)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    taken.append(counts.take())
    assert sum(t.get("n", 0) for t in taken) == 40_000


def test_only_the_named_counters_can_be_added_to():
    counts = Counters(["lookups"])
    counts.add("lookups")
    with pytest.raises(KeyError, match="lookupz"):
        counts.add("lookupz")
    assert counts.take() == {"lookups": 1}
