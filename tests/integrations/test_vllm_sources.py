"""Splitting a hit by the kind of tier it loads from, for vLLM's cache-hit-source metrics."""

from __future__ import annotations

from kvtiers import load_config
from kvtiers.integrations._vllm_sources import UNKNOWN, by_source, sources_of, tokens_by_tier


def test_each_tier_reports_the_source_of_its_kind_by_its_name():
    config = load_config(
        {
            "tiers": [
                {"kind": "dram", "capacity": "1GiB"},
                {"kind": "lmdb", "name": "nvme", "path": "/tmp/x", "capacity": "1GiB"},
                {"kind": "remote", "url": "memory://pool", "capacity": "1GiB"},
            ]
        }
    )
    assert sources_of(config.tiers) == {"dram": "host", "nvme": "disk", "remote": UNKNOWN}
    assert list(sources_of(config.tiers)) == ["dram", "nvme", "remote"]  # top first


def test_tokens_are_counted_by_the_chunk_they_fall_in():
    tiers = ("dram", "lmdb", "lmdb")
    assert tokens_by_tier(tiers, 64, 0, 192) == {"dram": 64, "lmdb": 128}
    assert tokens_by_tier(tiers, 64, 48, 130) == {"dram": 16, "lmdb": 66}
    assert tokens_by_tier(tiers, 64, 128, 320) == {"lmdb": 64, "": 128}  # past the tiers
    assert tokens_by_tier((), 64, 0, 0) == {}


def test_sources_sum_to_what_vllm_took_or_claim_no_tier():
    sources = {"dram": "host", "nvme": "disk", "pool": UNKNOWN}
    tokens = {"dram": 64, "nvme": 100, "pool": 28, "": 8}
    assert by_source(tokens, sources, 200) == {"host": 64, "disk": 100, UNKNOWN: 36}
    assert by_source({"dram": 0, "nvme": 64}, sources, 64) == {"disk": 64}
    # vLLM took another count than was planned: no tier is claimed for any of it.
    assert by_source(tokens, sources, 150) == {UNKNOWN: 150}
    assert by_source({}, sources, 32) == {UNKNOWN: 32}
    assert by_source(tokens, sources, 0) == {}
