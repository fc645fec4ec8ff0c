"""Reuse hints: chunks the caller expects no reuse of are stored cold, evicted first."""

from __future__ import annotations

import pytest
import torch

from kvtiers import InvalidInputError, TieredCache
from kvtiers.gpu import PagedKV
from tests.conftest import make_config, make_kv, small_layout

CHUNK = small_layout().chunk_size


def conversation(n: int) -> list[int]:
    return [n * 1000 + t for t in range(4 * CHUNK)]  # 4 chunks


@pytest.mark.parametrize("eviction", ["lru", "arc", "2q"])
async def test_chunks_stored_without_expected_reuse_are_evicted_first(layout, eviction):
    async with TieredCache.from_config(make_config(dram_chunks=8, eviction=eviction)) as cache:
        older, ended, new = conversation(1), conversation(2), conversation(3)
        await cache.store(older, make_kv(layout, len(older), seed=1))
        await cache.store(ended, make_kv(layout, len(ended), seed=2), keep_tokens=0)
        await cache.store(new, make_kv(layout, len(new), seed=3))
        # Without the hint every policy here evicts `older` (stored first, never hit).
        assert [await cache.lookup(t) for t in (older, ended, new)] == [len(older), 0, len(new)]
        assert cache.pin_count() == 0


async def test_a_hit_on_a_cold_chunk_proves_the_hint_wrong(layout):
    async with TieredCache.from_config(make_config(dram_chunks=8)) as cache:
        older, ended, new = conversation(1), conversation(2), conversation(3)
        await cache.store(older, make_kv(layout, len(older), seed=1))
        await cache.store(ended, make_kv(layout, len(ended), seed=2), keep_tokens=0)
        await cache.load(ended)  # it came back after all: plain LRU from here on
        await cache.store(new, make_kv(layout, len(new), seed=3))
        assert [await cache.lookup(t) for t in (older, ended, new)] == [0, len(ended), len(new)]


async def test_only_the_chunks_past_the_kept_tokens_are_cold(layout):
    async with TieredCache.from_config(make_config(dram_chunks=8)) as cache:
        older, shared, new = conversation(1), conversation(2), conversation(3)
        await cache.store(older, make_kv(layout, len(older), seed=1))
        # 2.5 chunks expected reused (a document, then a one-off question): 2 whole chunks.
        await cache.store(shared, make_kv(layout, len(shared), seed=2), keep_tokens=5 * CHUNK // 2)
        await cache.store(new, make_kv(layout, len(new), seed=3))
        assert [await cache.lookup(t) for t in (older, shared, new)] == [
            2 * CHUNK,
            2 * CHUNK,
            len(new),
        ]


async def test_key_level_and_paged_stores_take_the_hint(layout):
    async with TieredCache.from_config(make_config(dram_chunks=8)) as cache:
        older, ended = conversation(1), conversation(2)
        await cache.store(older, make_kv(layout, len(older), seed=1))
        keys = cache.keys(ended)
        kv = make_kv(layout, len(ended), seed=2)
        chunks = [kv.narrow(2, i * CHUNK, CHUNK) for i in range(4)]
        assert await cache.put_chunks(keys, chunks, keep_chunks=1) == [True] * 4
        await cache.store(conversation(3), make_kv(layout, 4 * CHUNK, seed=3))
        # The three cold chunks went first, then the least recent warm one.
        assert [await cache.lookup(t) for t in (older, ended)] == [3 * CHUNK, CHUNK]
        gen = torch.Generator().manual_seed(4)
        shape = (2, 8, CHUNK // 2, layout.num_kv_heads, layout.head_size)
        engine = [torch.randn(shape, generator=gen).half() for _ in range(layout.num_layers)]
        paged = conversation(4)
        # DRAM is full of warm chunks: the two kept evict two, the two cold find no room.
        stored = await cache.store_paged(
            paged, PagedKV.vllm_flash(engine), range(8), keep_tokens=2 * CHUNK
        )
        assert stored == await cache.lookup(paged) == 2 * CHUNK


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
async def test_a_bad_hint_is_a_typed_error_and_stores_nothing(layout, bad):
    tokens = conversation(1)
    async with TieredCache.from_config(make_config()) as cache:
        with pytest.raises(InvalidInputError, match="keep_tokens: expected a non-negative int"):
            await cache.store(tokens, make_kv(layout, len(tokens)), keep_tokens=bad)
        keys = cache.keys(tokens)
        chunks = [torch.zeros(layout.chunk_shape(), dtype=torch.float16)] * 4
        with pytest.raises(InvalidInputError, match="keep_chunks: expected a non-negative int"):
            await cache.put_chunks(keys, chunks, keep_chunks=bad)
        assert await cache.lookup(tokens) == 0
        assert cache.tiers[0].usage().num_entries == 0


async def test_a_cold_chunk_never_evicts_a_warm_one_it_goes_below(layout, tmp_path):
    config = make_config(tmp_path, dram_chunks=8, lmdb_chunks=64)
    async with TieredCache.from_config(config) as cache:
        warm = [conversation(1), conversation(2)]  # DRAM full
        for n, tokens in enumerate(warm):
            await cache.store(tokens, make_kv(layout, len(tokens), seed=n))
        ended = conversation(3)
        kv = make_kv(layout, len(ended), seed=3)
        assert await cache.store(ended, kv, keep_tokens=0) == len(ended)
        await cache.flush()
        dram = cache.tiers[0]
        for tokens in warm:
            assert await dram.contains(cache.keys(tokens)) == [True] * 4
        assert await dram.contains(cache.keys(ended)) == [False] * 4
        assert await cache.lookup(ended) == len(ended)  # from lmdb
        got = await cache.load(ended)
        assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))


async def test_with_one_tier_a_cold_chunk_without_room_is_not_stored(layout):
    async with TieredCache.from_config(make_config(dram_chunks=8)) as cache:
        for n in (1, 2):
            await cache.store(conversation(n), make_kv(layout, 4 * CHUNK, seed=n))
        ended = conversation(3)
        assert await cache.store(ended, make_kv(layout, len(ended)), keep_tokens=0) == 0
        assert await cache.lookup(ended) == 0
        assert [await cache.lookup(conversation(n)) for n in (1, 2)] == [4 * CHUNK] * 2


async def test_the_hint_goes_down_to_lmdb_which_evicts_those_chunks_first(layout, tmp_path):
    config = make_config(tmp_path, dram_chunks=8, lmdb_chunks=8)
    async with TieredCache.from_config(config) as cache:
        older, ended, new = conversation(1), conversation(2), conversation(3)
        await cache.store(older, make_kv(layout, len(older), seed=1))
        await cache.store(ended, make_kv(layout, len(ended), seed=2), keep_tokens=0)
        await cache.flush()  # written through to lmdb, cold there too
        await cache.store(new, make_kv(layout, len(new), seed=3))
        await cache.flush()
        lmdb = cache.tiers[1]
        # Without the hint lmdb would have evicted `older`, its oldest entries.
        assert await lmdb.contains(cache.keys(older)) == [True] * 4
        assert await lmdb.contains(cache.keys(ended)) == [False] * 4
        assert await lmdb.contains(cache.keys(new)) == [True] * 4


async def test_the_hint_reaches_a_shared_pool_for_every_process(layout, tmp_path):
    from kvtiers.tiers import _chunk_format as fmt

    value_bytes = fmt.value_bytes(
        layout.fingerprint, layout.chunk_bytes, num_layers=layout.num_layers
    )
    config = make_config(dram_chunks=8)
    config["tiers"].append(
        {"kind": "remote", "url": f"file://{tmp_path}/pool", "capacity": 8 * value_bytes}
    )
    older, ended, new = conversation(1), conversation(2), conversation(3)
    async with TieredCache.from_config(config) as one:
        await one.store(older, make_kv(layout, len(older), seed=1))
        await one.store(ended, make_kv(layout, len(ended), seed=2), keep_tokens=0)
        await one.flush()  # written through; closing writes its access log
    async with TieredCache.from_config(config) as two:  # another process, on the same pool
        await two.store(new, make_kv(layout, len(new), seed=3))
        await two.flush()
        pool = two.tiers[1]
        # Without the hint the pool would have evicted `older`, its oldest objects.
        assert await pool.contains(two.keys(older)) == [True] * 4
        assert await pool.contains(two.keys(ended)) == [False] * 4
        assert await pool.contains(two.keys(new)) == [True] * 4
