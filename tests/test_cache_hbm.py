"""TieredCache with an HBM tier on top: device blocks in the cascade.

The HBM tier runs on `device = "cpu"` here (its documented test seam): its blocks are torch
tensors rather than host NumPy views, which is what the cascade must handle; the same
tests run with `cuda:0` where a GPU is present.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtiers import TieredCache, TierIOError
from kvtiers.gpu import PagedKV
from tests.conftest import make_config, make_kv, same_bytes
from tests.test_cache_paged import BLOCK, _engine_kv, _tokens_of

# NOTE: the CUDA case is marked, so `benchmarks/gpu_check.py` (`pytest -m gpu`) runs it.
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


def _hbm_config(
    tmp_path, device, *, hbm_chunks=3, write_policy="write_back", dram=True, dram_chunks=4
):
    cfg = make_config(tmp_path, dram_chunks=dram_chunks, lmdb_chunks=100)
    chunk_bytes = 2048
    cfg["tiers"][0]["write_policy"] = write_policy  # dram, below hbm
    if not dram:
        del cfg["tiers"][0]
    cfg["tiers"].insert(0, {"kind": "hbm", "capacity": hbm_chunks * chunk_bytes, "device": device})
    return cfg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
async def test_hbm_dram_lmdb_round_trip(tmp_path, layout, device, write_policy):
    convs = [([c * 1000 + t for t in range(48)], make_kv(layout, 48, seed=c)) for c in range(6)]
    async with TieredCache.from_config(
        _hbm_config(tmp_path, device, write_policy=write_policy)
    ) as cache:
        for tokens, kv in convs:
            assert await cache.store(tokens, kv) == 48
        await cache.flush()
        for tokens, kv in convs:
            assert await cache.lookup(tokens) == 48
            assert same_bytes(await cache.load(tokens), kv)
        hbm, dram, disk = cache.stats().tiers
        assert hbm.evictions > 0 and hbm.promotions > 0
        assert hbm.usage.num_entries <= 3
        if write_policy == "write_back":
            assert dram.demotions > 0
        assert cache.pin_count() == 0


@pytest.mark.parametrize("device", DEVICES)
async def test_hbm_paged_round_trip(tmp_path, device):
    src = [t.to(device) for t in _engine_kv(num_blocks=16, seed=3)]
    dst = [t.to(device) for t in _engine_kv(num_blocks=16, seed=0, zero=True)]
    tokens = list(range(32))
    async with TieredCache.from_config(_hbm_config(tmp_path, device)) as cache:
        assert await cache.store_paged(tokens, PagedKV.vllm_flash(src), [4, 5, 9, 1]) == 32
        assert await cache.load_paged(tokens, PagedKV.vllm_flash(dst), [0, 2, 3, 7]) == 32
        got = _tokens_of([t.cpu() for t in dst], [0, 2, 3, 7])
        want = _tokens_of([t.cpu() for t in src], [4, 5, 9, 1])
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        await cache.flush()  # write-through to LMDB holds pins while it copies
        assert cache.pin_count() == 0
    assert BLOCK == 8


@pytest.mark.parametrize("device", DEVICES)
async def test_promotions_into_hbm_reuse_one_host_stage(tmp_path, layout, device):
    # Each load promotes a prompt from LMDB into HBM blocks (evicting the other one), through
    # host memory: a reused stage, not fresh memory whose pages fault in on every load.
    prompts = [[c * 1000 + t for t in range(48)] for c in range(2)]
    kvs = [make_kv(layout, 48, seed=c) for c in range(2)]
    async with TieredCache.from_config(_hbm_config(tmp_path, device, dram=False)) as cache:
        for tokens, kv in zip(prompts, kvs, strict=True):
            assert await cache.store(tokens, kv) == 48
            await cache.flush()  # so the second store evicts the first from HBM
        stages = cache._mover._stages
        taken: list[int] = []
        take = stages.take

        def recording(count: int):
            context = take(count)
            taken.append(0)
            return _Recorded(context, taken)

        stages.take = recording  # type: ignore[method-assign]
        for i in range(4):  # the second prompt is in HBM since its store
            tokens, kv = prompts[i % 2], kvs[i % 2]
            assert same_bytes(await cache.load(tokens), kv)
        assert cache.stats().tiers[0].promotions >= 4
        assert len(taken) >= 4 and len(set(taken)) == 1  # one buffer, every time


class _Recorded:
    """Wrap a stage's context manager; record the address of the buffer it yields."""

    def __init__(self, context, taken: list[int]) -> None:
        self._context, self._taken = context, taken

    def __enter__(self):
        buf = self._context.__enter__()
        self._taken[-1] = buf.__array_interface__["data"][0]
        return buf

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)


@pytest.mark.parametrize("device", DEVICES)
async def test_promotions_from_dram_copy_its_blocks_with_no_stage(tmp_path, layout, device):
    # DRAM below HBM: a promotion copies DRAM's pinned blocks straight into HBM blocks, and
    # HBM's write-back demotions land straight in blocks DRAM reserves. No host stage.
    prompts = [[c * 1000 + t for t in range(48)] for c in range(2)]
    kvs = [make_kv(layout, 48, seed=c) for c in range(2)]
    async with TieredCache.from_config(_hbm_config(tmp_path, device, dram_chunks=8)) as cache:
        for tokens, kv in zip(prompts, kvs, strict=True):
            assert await cache.store(tokens, kv) == 48  # the second demotes the first
            await cache.flush()  # chunks queued for LMDB are never evicted from HBM
        stages = cache._mover._stages
        taken = []
        take = stages.take
        stages.take = lambda count: taken.append(count) or take(count)  # type: ignore[method-assign]
        assert same_bytes(await cache.load(prompts[0]), kvs[0])
        hbm, dram, _ = cache.stats().tiers
        assert (hbm.promotions, dram.hits, dram.demotions) == (3, 3, 6)
        assert same_bytes(await cache.load(prompts[1]), kvs[1])  # from DRAM, demoted there
        assert cache.stats().tiers[1].hits == 6
        assert taken == []
        assert cache.pin_count() == 0


@pytest.mark.parametrize("device", DEVICES)
async def test_a_failed_block_copy_is_a_miss_and_loses_nothing(tmp_path, layout, device):
    prompts = [[c * 1000 + t for t in range(48)] for c in range(2)]
    kvs = [make_kv(layout, 48, seed=c) for c in range(2)]
    async with TieredCache.from_config(_hbm_config(tmp_path, device)) as cache:
        for tokens, kv in zip(prompts, kvs, strict=True):
            assert await cache.store(tokens, kv) == 48  # the second demotes the first
            await cache.flush()  # LMDB (write-through) holds both
        hbm = cache.tiers[0]
        copy_views = hbm.copy_views

        async def failing(pairs):
            raise TierIOError("hbm tier: copy failed: injected")

        hbm.copy_views = failing
        # The demotion making room fails, then the promotions from DRAM and from LMDB:
        # each a miss.
        assert (await cache.load(prompts[0])).shape[2] == 0
        stats = cache.stats().tiers
        assert stats[0].errors == 3 and stats[0].promotions == 0
        assert cache.pin_count() == 0
        # The tiers below still hold the chunks, and the index still places them there
        # (making room in DRAM for the first demotion moved two of them down to LMDB).
        assert (await cache.locate(prompts[0])).tiers == ("dram", "lmdb", "lmdb")
        hbm.copy_views = copy_views
        assert same_bytes(await cache.load(prompts[0]), kvs[0])
        assert same_bytes(await cache.load(prompts[1]), kvs[1])
        assert cache.pin_count() == 0


def _fail_copies(hbm):
    async def failing(pairs):
        raise TierIOError("hbm tier: copy failed: injected")

    hbm.copy_views = failing


@pytest.mark.parametrize("device", DEVICES)
async def test_copies_to_and_from_the_callers_memory_that_fail_are_misses(tmp_path, layout, device):
    """Loads end short and stores store nothing new; neither raises into the caller."""
    tokens, kv = list(range(48)), make_kv(layout, 48, seed=7)
    other = [5000 + t for t in range(48)]
    async with TieredCache.from_config(_hbm_config(tmp_path, device)) as cache:
        assert await cache.store(tokens, kv) == 48
        await cache.flush()  # LMDB (write-through) holds it too
        hbm = cache.tiers[0]
        _fail_copies(hbm)
        assert (await cache.load(tokens)).shape[2] == 0  # HBM hits that cannot be copied out
        calls = []
        got = await cache.load(tokens, on_layers=lambda n, t: calls.append((n, t)))
        assert got.shape[2] == 0 and all(t == 0 for _, t in calls)
        assert await cache.get_chunks(
            cache.keys(tokens)[:1], [np.empty(layout.chunk_bytes, np.uint8)]
        ) == [False]
        assert await cache.store(other, make_kv(layout, 48, seed=8)) == 0
        assert await cache.lookup(other) == 0
        # One error per load; the store's demotion (making room) and its own copy.
        hbm_stats = cache.stats().tiers[0]
        assert hbm_stats.errors == 5 and hbm_stats.usage.num_entries == 0
        assert cache.pin_count() == 0
        del hbm.copy_views
        assert same_bytes(await cache.load(tokens), kv)
        assert await cache.store(other, make_kv(layout, 48, seed=8)) == 48
        assert cache.pin_count() == 0


async def test_a_chunk_put_back_in_dram_during_a_load_that_missed_it_stays_indexed(
    tmp_path, layout
):
    """A load's stale miss in DRAM does not unindex the chunk a write put back meanwhile.

    The load plans both chunks of a prompt from DRAM; the second is evicted from DRAM just
    as the load pins it (a miss), and while the load copies the first, the prompt is stored
    again and its write-through copy puts the second back into DRAM. The load then ends:
    the index must still place that chunk in DRAM, where it is.
    """
    tokens, kv = list(range(32)), make_kv(layout, 32, seed=1)
    cfg = _hbm_config(tmp_path, "cpu", hbm_chunks=4, write_policy="write_through", dram_chunks=8)
    async with TieredCache.from_config(cfg) as cache:
        assert await cache.store(tokens, kv) == 32
        for c in (1, 2):  # evict the prompt from HBM (once written through); DRAM keeps it
            await cache.flush()
            assert await cache.store([c * 1000 + t for t in range(32)], make_kv(layout, 32)) == 32
        await cache.flush()
        hbm, dram = cache.tiers[0], cache.tiers[1]
        mover, keys = cache._mover, cache.keys(tokens)
        assert (await cache.locate(tokens)).tiers == ("dram", "dram")
        pinned = dram.pinned

        class EvictThenPin:
            """DRAM's `pinned`, once: a real eviction of the second chunk first."""

            def __init__(self, pin_keys):
                self.pin_keys = pin_keys

            async def __aenter__(self):
                del dram.pinned
                await mover._evict(mover._slots[1], dram, [keys[1]])
                self.inner = pinned(self.pin_keys)
                return await self.inner.__aenter__()

            async def __aexit__(self, *exc):
                return await self.inner.__aexit__(*exc)

        async def store_again_then_copy(pairs):
            del hbm.copy_views
            assert await cache.store(tokens, kv) == 0
            await cache.flush()  # the write-through copy puts the second chunk back in DRAM
            assert keys[1] in dram.resident_keys()
            await hbm.copy_views(pairs)

        dram.pinned, hbm.copy_views = EvictThenPin, store_again_then_copy
        assert same_bytes(await cache.load(tokens), kv)
        assert set(cache._index.keys_in(1)) == set(dram.resident_keys())
        assert (await cache.locate(tokens)).tiers[1] in ("hbm", "dram")
        assert cache.pin_count() == 0


async def test_a_demotion_that_lands_after_a_clear_leaves_nothing_behind(tmp_path, layout):
    """A chunk a clear removed meanwhile is not left in DRAM, unindexed, by its demotion."""
    first, other = list(range(48)), [5000 + t for t in range(48)]
    async with TieredCache.from_config(_hbm_config(tmp_path, "cpu")) as cache:
        assert await cache.store(first, make_kv(layout, 48, seed=1)) == 48
        await cache.flush()
        hbm, dram = cache.tiers[0], cache.tiers[1]
        cleared = []

        async def clear_then_copy(pairs):
            del hbm.copy_views
            cleared.append(await cache.clear())
            await hbm.copy_views(pairs)

        hbm.copy_views = clear_then_copy
        await cache.store(other, make_kv(layout, 48, seed=2))  # demotes the first prompt
        await cache.flush()
        assert cleared and cleared[0] > 0
        assert set(cache._index.keys_in(1)) == set(dram.resident_keys())
        assert set(cache._mover._slots[1].policy.candidates()) == set(dram.resident_keys())
        assert cache.pin_count() == 0


@pytest.mark.parametrize("device", DEVICES)
async def test_key_level_chunks_move_through_hbm_blocks_in_any_host_memory(layout, device):
    # put_chunks / get_chunks with HBM on top: contiguous, permuted and reversed host arrays
    # and torch tensors, all bit-exact through the HBM tier's batched copies.
    config = {
        "layout": make_config()["layout"],
        "tiers": [{"kind": "hbm", "capacity": 8 * layout.chunk_bytes, "device": device}],
    }
    kv = make_kv(layout, 4 * layout.chunk_size)
    chunks = [kv.narrow(2, i * layout.chunk_size, layout.chunk_size) for i in range(4)]
    raw = [c.contiguous().view(torch.uint8).numpy() for c in chunks]
    srcs = [raw[0], np.ascontiguousarray(raw[1][..., ::-1])[..., ::-1], raw[2], chunks[3]]
    async with TieredCache.from_config(config) as cache:
        keys = cache.chunk_keys([f"{i:064x}" for i in range(1, 5)])
        assert await cache.put_chunks(keys, srcs) == [True] * 4
        flat = np.zeros(layout.chunk_bytes, dtype=np.uint8)
        reversed_ = np.zeros(layout.chunk_bytes, dtype=np.uint8)[::-1]
        permuted = np.zeros(raw[2].shape[::-1], dtype=np.uint8).transpose()
        tensor = torch.zeros_like(chunks[3])
        dsts = [flat, reversed_, permuted, tensor]
        assert await cache.get_chunks(keys, dsts) == [True] * 4
        assert np.array_equal(flat, raw[0].reshape(-1))
        assert np.array_equal(reversed_, raw[1].reshape(-1))
        assert np.array_equal(permuted, raw[2])
        assert same_bytes(tensor, chunks[3])
        assert cache.pin_count() == 0
