"""Tests of `kvtiers.core.stats`."""

from __future__ import annotations

import dataclasses

import pytest

from kvtiers.core.stats import CacheStats, TierCounters, TierStats, TierUsage


def test_snapshot_copies_every_counter() -> None:
    counters = TierCounters()
    plain = [f for f in dataclasses.fields(TierCounters) if f.name != "latency"]
    for i, f in enumerate(plain, start=1):
        setattr(counters, f.name, i)
    counters.observe("get", 0.002)
    usage = TierUsage(capacity_bytes=100, used_bytes=40, num_entries=2)
    snap = counters.snapshot("dram", "dram", usage)
    assert isinstance(snap, TierStats)
    assert (snap.name, snap.kind, snap.usage) == ("dram", "dram", usage)
    for i, f in enumerate(plain, start=1):
        assert getattr(snap, f.name) == i, f.name
    assert snap.latency["get"].count == 1 and snap.latency["get"].quantile(1.0) == 0.0025
    assert snap.breaker is None and snap.io == {}
    counters.observe("get", 0.002)
    assert snap.latency["get"].count == 1  # detached


def test_snapshot_is_frozen_and_detached() -> None:
    counters = TierCounters(hits=3)
    snap = counters.snapshot("t", "lmdb", TierUsage(0, 0, 0))
    counters.hits += 1
    assert snap.hits == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.hits = 5  # type: ignore[misc]


def test_tier_stats_fields_mirror_counters() -> None:
    counter_names = [f.name for f in dataclasses.fields(TierCounters)]
    stats_names = [f.name for f in dataclasses.fields(TierStats)]
    assert stats_names == [*("name", "kind", "usage"), *counter_names, *("breaker", "io")]


def test_hit_rate() -> None:
    assert CacheStats().hit_rate == 0.0
    assert CacheStats(lookup_tokens=1000, hit_tokens=250).hit_rate == pytest.approx(0.25)
    assert CacheStats(lookup_tokens=512, hit_tokens=512).hit_rate == 1.0


def test_load_bandwidth() -> None:
    assert CacheStats().load_bandwidth == 0.0
    assert CacheStats(loaded_bytes=10, load_seconds=0.0).load_bandwidth == 0.0
    assert CacheStats(loaded_bytes=2**30, load_seconds=0.5).load_bandwidth == pytest.approx(2**31)


def test_cache_stats_defaults() -> None:
    stats = CacheStats()
    assert stats.tiers == ()
    assert stats.lookups == stats.loads == stats.stores == 0
