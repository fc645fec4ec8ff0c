"""The mooncake tier on a real Mooncake Store: a master and a segment process on loopback."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.testing.tiers import SMALL_LAYOUT, TierTests
from kvtiers.tiers._chunk_format import pack_value, value_bytes
from kvtiers.tiers._remote_breaker import BreakerState
from kvtiers.tiers.mooncake import MooncakeTier
from kvtiers.tiers.registry import TierRegistry
from tests.tiers.servers import (
    MooncakeCluster,
    free_port,
    mooncake_bin_dir,
    mooncake_cluster,
    own_mooncake_cluster,
    unique_prefix,
)

__all__ = ["mooncake_cluster", "own_mooncake_cluster"]  # fixtures, imported to be found here

LAYOUT = SMALL_LAYOUT
VALUE_BYTES = value_bytes(LAYOUT.fingerprint, LAYOUT.chunk_bytes)


def make_tier(
    master: str, num_chunks: int = 64, layout: KVLayout = LAYOUT, **options: Any
) -> MooncakeTier:
    size = value_bytes(layout.fingerprint, layout.chunk_bytes)
    options = {"master": master, "prefix": unique_prefix(), **options}
    return MooncakeTier(TierConfig("mooncake", num_chunks * size, options=options, index=1), layout)


def keys(num: int, seed: int = 0) -> list[ChunkKey]:
    rng = np.random.default_rng(seed + 7)
    return [ChunkKey(rng.bytes(16)) for _ in range(num)]


def payloads(num: int, seed: int = 0, layout: KVLayout = LAYOUT) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, layout.chunk_bytes, dtype=np.uint8) for _ in range(num)]


def dsts(num: int, layout: KVLayout = LAYOUT) -> list[np.ndarray]:
    return [np.zeros(layout.chunk_bytes, np.uint8) for _ in range(num)]


class TestMooncakeTier(TierTests):
    tier_cls = MooncakeTier
    evicts_cold_first = True

    @pytest.fixture(autouse=True)
    def _cluster(self, mooncake_cluster: MooncakeCluster) -> None:
        self.cluster = mooncake_cluster

    def entry_bytes(self) -> int:
        return VALUE_BYTES

    async def make_tier(
        self, tmp_path: Path, layout: KVLayout, capacity_bytes: int
    ) -> MooncakeTier:
        options = {"master": self.cluster.master, "prefix": unique_prefix()}
        return MooncakeTier(TierConfig("mooncake", capacity_bytes, options=options), layout)


# -- the store's semantics -----------------------------------------------------------------------


async def test_garbage_and_foreign_values_are_counted_misses_and_rewritten(
    mooncake_cluster: MooncakeCluster,
) -> None:
    async with make_tier(mooncake_cluster.master) as tier:
        ks, srcs = keys(4), payloads(4)
        store = tier._store
        good = pack_value(LAYOUT.fingerprint, ks[0], srcs[0].data)
        own = pack_value(LAYOUT.fingerprint, ks[1], srcs[1].data)
        # written behind kvtiers' back, before it writes: the store keeps the first value
        assert store.put(tier._name(ks[0]), b"garbage") == 0
        assert store.put(tier._name(ks[1]), own[:-1]) == 0  # truncated
        assert store.put(tier._name(ks[2]), good) == 0  # ks[0]'s value under ks[2]'s key
        assert store.put(tier._name(ks[3]), good + b"x") == 0  # longer than a value
        assert await tier.put(ks, srcs) == [True] * 4  # immutable: the bad values stay
        out = dsts(4)
        assert await tier.get(ks, out) == [False] * 4
        assert all((dst == 0).all() for dst in out)
        assert (tier.counters.corrupt, tier.counters.foreign) == (3, 1)
        assert await tier.contains(ks) == [False] * 4  # removed, lease or not
        assert await tier.put(ks, srcs) == [True] * 4  # and written again
        assert await tier.get(ks, out) == [True] * 4
        assert all(np.array_equal(s, d) for s, d in zip(srcs, out, strict=True))


async def test_a_forged_value_is_never_loaded(
    mooncake_cluster: MooncakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIERS_TEST_MC_SECRET", "a-mooncake-secret-of-32-bytes-xx")
    options = {"integrity": "hmac-sha256", "integrity_key_env": "KVTIERS_TEST_MC_SECRET"}
    async with make_tier(mooncake_cluster.master, **options) as tier:
        ks, srcs = keys(2, seed=5), payloads(2)
        # a writer without the secret: a valid checksum, no tag, put before kvtiers writes
        forged = pack_value(LAYOUT.fingerprint, ks[0], payloads(1, seed=9)[0].data)
        assert tier._store.put(tier._name(ks[0]), forged) == 0
        assert await tier.put(ks, srcs) == [True, True]
        out = dsts(2)
        assert await tier.get(ks, out) == [False, True]
        assert (out[0] == 0).all() and np.array_equal(out[1], srcs[1])
        assert (tier.counters.forged, tier.counters.corrupt) == (1, 1)


async def test_two_tiers_share_the_pool(mooncake_cluster: MooncakeCluster) -> None:
    one = make_tier(mooncake_cluster.master)
    two = MooncakeTier(one.config, LAYOUT)
    ks, srcs = keys(8), payloads(8)
    async with one, two:
        assert await one.put(ks, srcs) == [True] * 8
        out = dsts(8)
        assert await two.get(ks, out) == [True] * 8
        assert all(np.array_equal(s, d) for s, d in zip(srcs, out, strict=True))
        assert two.usage().num_entries == 8  # what it read, it knows


async def test_capacity_evicts_least_recent_and_reports_it(
    mooncake_cluster: MooncakeCluster,
) -> None:
    ks, srcs = keys(6, seed=3), payloads(6)
    async with make_tier(mooncake_cluster.master, num_chunks=4) as tier:
        assert await tier.put(ks[:4], srcs[:4]) == [True] * 4
        assert await tier.get(ks[:2], dsts(2)) == [True, True]  # ks[0:2] are now the most recent
        assert await tier.put(ks[4:], srcs[4:]) == [True, True]
        assert await tier.contains(ks) == [True, True, False, False, True, True]
        assert tier.counters.evictions == 2
        assert sorted(tier.take_evicted()) == sorted(ks[2:4])
        assert tier.take_evicted() == []


# -- faults ---------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_segment_owner_killed_mid_workload_gives_misses_and_recovers(
    own_mooncake_cluster: MooncakeCluster,
) -> None:
    cluster = own_mooncake_cluster
    opts = {"breaker_cooldown": 0.5, "timeout": 5}
    async with make_tier(cluster.master, **opts) as tier:
        ks, srcs = keys(16), payloads(16)
        assert await tier.put(ks[:8], srcs[:8]) == [True] * 8

        async def workload() -> None:
            for _ in range(20):
                out = dsts(8)
                hits = await tier.get(ks[:8], out)
                for hit, src, dst in zip(hits, srcs[:8], out, strict=True):
                    assert np.array_equal(src, dst) if hit else not dst.any()
                await tier.contains(ks)
                await asyncio.sleep(0.01)

        start = time.perf_counter()
        task = asyncio.ensure_future(workload())
        await asyncio.sleep(0.05)
        cluster.kill_segment()
        await task  # no exception, only correct hits
        for _ in range(3):
            assert await tier.get(ks[:8], dsts(8)) == [False] * 8
            await tier.put(ks[8:], srcs[8:])  # no memory left in the pool: declined
        assert time.perf_counter() - start < 30
        assert tier.counters.errors > 0
        cluster.start_segment()
        deadline = time.monotonic() + 30
        while await tier.put(ks[:8], srcs[:8]) != [True] * 8:  # lost objects are rewritten
            assert time.monotonic() < deadline, "the pool did not recover"
            await asyncio.sleep(0.5)
        out = dsts(8)
        assert await tier.get(ks[:8], out) == [True] * 8
        assert all(np.array_equal(s, d) for s, d in zip(srcs[:8], out, strict=True))


@pytest.mark.slow
async def test_master_killed_gives_misses_in_bounded_time_and_recovers(
    own_mooncake_cluster: MooncakeCluster,
) -> None:
    cluster = own_mooncake_cluster
    async with make_tier(cluster.master, breaker_cooldown=0.5, timeout=1) as tier:
        ks, srcs = keys(8), payloads(8)
        assert await tier.put(ks, srcs) == [True] * 8
        cluster.kill_master()
        start = time.perf_counter()
        for i in range(5):  # each call waits `timeout` at most, until the breaker opens
            assert await tier.get(ks, dsts(8)) == [False] * 8
            assert await tier.contains(ks) == [False] * 8
            assert await tier.put(keys(2, seed=i + 10), payloads(2)) == [False] * 2
        assert time.perf_counter() - start < 20
        assert tier._guard.breaker.state is not BreakerState.CLOSED
        assert tier.io_counters.timeouts > 0 and tier.io_counters.refused > 0
        cluster.start_master()  # empty: the objects' metadata died with the old one
        deadline = time.monotonic() + 30
        while await tier.put(ks, srcs) != [True] * 8:
            assert time.monotonic() < deadline, "the pool did not recover"
            await asyncio.sleep(0.5)
        out = dsts(8)
        assert await tier.get(ks, out) == [True] * 8
        assert all(np.array_equal(s, d) for s, d in zip(srcs, out, strict=True))


async def test_unreachable_master_at_open_opens_and_serves_misses() -> None:
    mooncake_bin_dir()  # skips, saying why, where the client cannot load
    start = time.perf_counter()
    async with make_tier(f"127.0.0.1:{free_port()}", breaker_failures=1, timeout=3) as tier:
        assert await tier.get(keys(2), dsts(2)) == [False, False]
        assert await tier.put(keys(2), payloads(2)) == [False, False]
        assert await tier.contains(keys(2)) == [False, False]
        assert tier._guard.breaker.state is not BreakerState.CLOSED
    assert time.perf_counter() - start < 15


@pytest.mark.slow
async def test_silent_eviction_yields_only_correct_hits(
    own_mooncake_cluster: MooncakeCluster,
) -> None:
    big = KVLayout(  # 512 KiB chunks: 64 MiB of segment holds ~120 of them
        model="m", num_layers=4, num_kv_heads=8, head_size=64, dtype="float16", chunk_size=128
    )
    async with make_tier(own_mooncake_cluster.master, num_chunks=1024, layout=big) as tier:
        ks, srcs = keys(256), payloads(256, layout=big)
        stored = []
        for i in range(0, 256, 16):
            stored += await tier.put(ks[i : i + 16], srcs[i : i + 16])
        assert sum(stored) > 0
        out = dsts(256, layout=big)
        hits = []
        for i in range(0, 256, 16):
            hits += await tier.get(ks[i : i + 16], out[i : i + 16])
        assert 0 < sum(hits) < 256  # the pool is smaller than the workload
        for hit, src, dst in zip(hits, srcs, out, strict=True):
            assert np.array_equal(src, dst) if hit else not dst.any()
        assert tier.counters.corrupt == tier.counters.foreign == 0


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"master": ""}, "master"),
        ({"master": "localhost"}, "master"),
        ({"master": 50051}, "master"),
        ({"protocol": "udp"}, "protocol"),
        ({"metadata": ""}, "metadata"),
        ({"segment_size": "lots"}, "segment_size"),
        ({"buffer_size": -1}, "buffer_size"),
        ({"buffer_size": 100}, "buffer_size"),
        ({"replicas": 0}, "replicas"),
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"timeout": 0}, "timeout"),
        ({"breaker_failures": 0}, "breaker_failures"),
        ({"breaker_cooldown": -1}, "breaker_cooldown"),
        ({"prefix": "a b"}, "prefix"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_option_names_the_field(options: dict[str, Any], field: str) -> None:
    opts = {"master": "127.0.0.1:50051", **options}
    with pytest.raises(ConfigError, match=rf"^tiers\[2\]\.{field}: "):
        MooncakeTier(TierConfig("mooncake", 1 << 20, options=opts, index=2), LAYOUT)


def test_defaults_and_sizes() -> None:
    config = TierConfig(
        "mooncake", 1 << 20, options={"master": "10.0.0.1:50051", "segment_size": "1GiB"}
    )
    options = MooncakeTier(config, LAYOUT).options
    assert (options.metadata, options.protocol, options.replicas) == ("P2PHANDSHAKE", "tcp", 1)
    assert (options.segment_size, options.buffer_size) == (2**30, 0)


def test_registered_through_the_entry_point_group_not_as_a_built_in() -> None:
    assert TierRegistry().resolve("mooncake") is MooncakeTier
    assert "mooncake" not in TierRegistry(load_entry_points=False)
    assert MooncakeTier.shared and MooncakeTier.manages_eviction
