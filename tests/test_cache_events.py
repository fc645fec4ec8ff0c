"""TieredCache's KV events and miss reasons."""

from __future__ import annotations

import pytest

from kvtiers import ChunkRemoved, ChunkStored, ConfigError, TieredCache
from tests.conftest import make_config, make_kv

pytestmark = pytest.mark.filterwarnings("error")


def tokens_of(conv: int, num_tokens: int = 64) -> list[int]:
    return [conv * 10_000 + t for t in range(num_tokens)]


async def test_events_are_off_by_default(layout):
    async with TieredCache.from_config(make_config(dram_chunks=2)) as cache:
        for conv in range(3):
            await cache.store(tokens_of(conv), make_kv(layout, 64, seed=conv))
        assert cache.take_events() == []
        assert cache.stats().events_dropped == 0


@pytest.mark.parametrize("value", [-1, "8", True, 1.5])
def test_events_config_is_validated(value):
    cfg = {**make_config(), "events": value}
    with pytest.raises(ConfigError, match="^events:"):
        TieredCache.from_config(cfg)


async def test_store_then_eviction_events_in_order(tmp_path, layout):
    cfg = {**make_config(tmp_path, dram_chunks=4, lmdb_chunks=50), "events": 100}
    async with TieredCache.from_config(cfg) as cache:
        chunk = layout.chunk_size
        first = cache.keys(tokens_of(0))
        await cache.store(tokens_of(0), make_kv(layout, 64, seed=0))
        await cache.flush()
        events = cache.take_events()
        # placed in DRAM, then the write-through copies completed in LMDB
        assert events == [
            *(ChunkStored("dram", k, chunk) for k in first),
            *(ChunkStored("lmdb", k, chunk) for k in first),
        ]
        second = cache.keys(tokens_of(1, 32))
        await cache.store(tokens_of(1, 32), make_kv(layout, 32, seed=1))
        await cache.flush()
        events = cache.take_events()
        removed = [e for e in events if isinstance(e, ChunkRemoved)]
        # DRAM held 4 chunks: two leaves of the first chain went, deepest first
        assert removed == [
            ChunkRemoved("dram", first[3], chunk),
            ChunkRemoved("dram", first[2], chunk),
        ]
        assert events[:2] == removed  # evicted before the new chunks were placed
        assert events[2:4] == [ChunkStored("dram", k, chunk) for k in second]
        assert events[4:] == [ChunkStored("lmdb", k, chunk) for k in second]
        # a load promotes the evicted chunks back into DRAM (evicting others)
        assert await cache.lookup(tokens_of(0)) == 64
        await cache.load(tokens_of(0))
        promoted = [e for e in cache.take_events() if isinstance(e, ChunkStored)]
        assert {e.key for e in promoted} >= {first[2], first[3]}
        assert all(e.tier == "dram" for e in promoted)


async def test_lmdb_eviction_of_its_own_is_an_event_and_an_evicted_miss(tmp_path, layout):
    cfg = {**make_config(tmp_path, dram_chunks=4, lmdb_chunks=6), "events": 100}
    async with TieredCache.from_config(cfg) as cache:
        first = cache.keys(tokens_of(0))
        for conv in range(3):  # 4 chunks each: lmdb (6 chunks) evicts conv 0's
            await cache.store(tokens_of(conv), make_kv(layout, 64, seed=conv))
            await cache.flush()
        removed = [e for e in cache.take_events() if isinstance(e, ChunkRemoved)]
        assert {e.key for e in removed if e.tier == "lmdb"} >= set(first[2:])
        assert await cache.lookup(tokens_of(0)) < 64
        stats = cache.stats()
        assert stats.miss_reasons == {"evicted": 1}
        assert stats.evicted_from == {"lmdb": 1}


async def test_full_event_queue_counts_drops(layout):
    cfg = {**make_config(dram_chunks=32), "events": 3}
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(tokens_of(0), make_kv(layout, 64))  # 4 chunks
        assert cache.stats().events_dropped == 1
        assert len(cache.take_events()) == 3


async def test_miss_reasons_never_stored_and_evicted(layout):
    async with TieredCache.from_config(make_config(dram_chunks=4)) as cache:
        assert await cache.lookup(tokens_of(0)) == 0
        assert cache.stats().miss_reasons == {"never_stored": 1}
        await cache.store(tokens_of(0), make_kv(layout, 64, seed=0))
        assert await cache.lookup(tokens_of(0)) == 64  # a full hit counts no reason
        await cache.store(tokens_of(1), make_kv(layout, 64, seed=1))  # evicts conv 0
        assert await cache.lookup(tokens_of(0)) == 0
        assert cache.stats().miss_reasons == {"never_stored": 1, "evicted": 1}


async def test_miss_reason_salt_mismatch(layout):
    async with TieredCache.from_config(make_config(dram_chunks=16)) as cache:
        await cache.store(tokens_of(0), make_kv(layout, 64, seed=0), salt="tenant-a")
        assert await cache.lookup(tokens_of(0), salt="tenant-b") == 0
        assert cache.stats().miss_reasons == {"salt_mismatch": 1}
        assert await cache.lookup(tokens_of(1), salt="tenant-b") == 0  # nobody stored it
        assert cache.stats().miss_reasons == {"salt_mismatch": 1, "never_stored": 1}
        await cache.store(tokens_of(0), make_kv(layout, 64, seed=0), salt="tenant-b")
        assert await cache.lookup(tokens_of(0), salt="tenant-b") == 64
        longer = [*tokens_of(0), *tokens_of(2)]  # a hit prefix, then chunks never stored
        assert await cache.lookup(longer, salt="tenant-a") == 64
        assert cache.stats().miss_reasons == {"salt_mismatch": 1, "never_stored": 2}


async def test_miss_reason_load_short(layout):
    async with TieredCache.from_config(make_config(dram_chunks=4)) as cache:
        await cache.store(tokens_of(0), make_kv(layout, 64, seed=0))
        keys = cache.keys(tokens_of(0))
        # the chunk goes between lookup and load (as another request's eviction would)
        dram = cache.tiers[0]
        await dram.delete(keys[2:3])
        loaded = await cache.load(tokens_of(0))
        assert loaded.shape[2] == 2 * layout.chunk_size
        assert cache.stats().miss_reasons == {"load_short": 1}
