"""The DRAM tier: the conformance suite plus pinned views and in-place reservations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtiers._host_copies import HostCopier
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.testing.tiers import SMALL_LAYOUT, TierTests
from kvtiers.tiers.dram import DRAMTier


class TestDRAMTier(TierTests):
    tier_cls = DRAMTier

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> DRAMTier:
        return DRAMTier(TierConfig("dram", capacity_bytes), layout)


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def _payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SMALL_LAYOUT.chunk_bytes, dtype=np.uint8)


def _tier(num_chunks: int = 4) -> DRAMTier:
    return DRAMTier(TierConfig("dram", num_chunks * SMALL_LAYOUT.chunk_bytes), SMALL_LAYOUT)


async def test_pinned_views_are_zero_copy_and_block_reuse():
    async with _tier(2) as tier:
        await tier.put([_key(1)], [_payload(1)])
        async with tier.pinned([_key(1), _key(2)]) as views:
            assert views[1] is None
            view = views[0]
            assert view is not None and np.shares_memory(view, tier.buffer)
            assert tier.is_pinned(_key(1)) and tier.total_pins == 1
            await tier.delete([_key(1)])  # deferred: the block stays intact while pinned
            assert np.array_equal(view, _payload(1))
            await tier.put([_key(3)], [_payload(3)])
            assert np.array_equal(view, _payload(1))  # not reused while pinned
        assert tier.total_pins == 0
        assert tier.num_free_chunks == 1


async def test_reserve_commits_kept_blocks_and_frees_the_rest():
    async with _tier(4) as tier:
        keys = [_key(i) for i in range(6)]
        async with tier.reserve(keys) as res:
            assert len(res.views) == 4  # only four blocks exist
            for i, view in enumerate(res.views):
                view[:] = _payload(i)
            res.keep[1] = False
        assert await tier.contains(keys) == [True, False, True, True, False, False]
        assert tier.num_free_chunks == 1
        dst = np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8)
        assert await tier.get([keys[2]], [dst]) == [True]
        assert np.array_equal(dst, _payload(2))


async def test_reserve_stores_nothing_on_error():
    async with _tier(4) as tier:
        with pytest.raises(RuntimeError):
            async with tier.reserve([_key(1), _key(2)]) as res:
                res.views[0][:] = 7
                raise RuntimeError("copy failed")
        assert await tier.contains([_key(1), _key(2)]) == [False, False]
        assert tier.num_free_chunks == 4


def test_config_errors():
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: .*too small"):
        DRAMTier(TierConfig("dram", 100), SMALL_LAYOUT)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: unknown option"):
        DRAMTier(TierConfig("dram", 1 << 20, options={"path": "/x"}), SMALL_LAYOUT)


async def test_memory_it_cannot_allocate_fails_the_open_with_a_tier_error():
    tier = DRAMTier(TierConfig("dram", 1000 * 2**40, name="big"), SMALL_LAYOUT)
    with pytest.raises(TierIOError, match=r"^big: cannot allocate 1000\.00 TiB of host memory"):
        await tier.open()


async def test_custom_allocator_is_used():
    calls: list[int] = []

    def allocate(num_bytes: int) -> np.ndarray:
        calls.append(num_bytes)
        return np.zeros(num_bytes, np.uint8)

    tier = DRAMTier(TierConfig("dram", 3 * SMALL_LAYOUT.chunk_bytes), SMALL_LAYOUT, allocate)
    async with tier:
        assert calls == [3 * SMALL_LAYOUT.chunk_bytes]


class TestDRAMTierOnCopyThreads(TierTests):
    """The tier contract with the cache's copy threads doing its copies."""

    tier_cls = DRAMTier

    def setup_method(self) -> None:
        # NOTE: min_bytes=1 cuts even the suite's small chunks into pieces on two threads.
        self.copier = HostCopier(2, min_bytes=1, piece_bytes=64)

    def teardown_method(self) -> None:
        self.copier.close()

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> DRAMTier:
        config = TierConfig("dram", capacity_bytes)
        return DRAMTier(config, layout, host_copy=self.copier.copy)


async def test_a_get_or_put_is_one_batch_of_copies_in_any_layout():
    batches: list[int] = []

    def host_copy(pairs):
        batches.append(len(pairs))
        for dst, src in pairs:
            np.copyto(dst, src)

    config = TierConfig("dram", 4 * SMALL_LAYOUT.chunk_bytes)
    keys = [_key(i) for i in range(3)]
    payloads = [_payload(i) for i in range(3)]
    # Strided and reshaped buffers: their bytes in C order are the chunk.
    srcs = [payloads[0], np.flip(np.flip(payloads[1]).copy()), payloads[2].reshape(2, -1)]
    async with DRAMTier(config, SMALL_LAYOUT, host_copy=host_copy) as tier:
        assert await tier.put([*keys, keys[0]], [*srcs, srcs[0]]) == [True] * 4
        flipped = np.flip(np.zeros(SMALL_LAYOUT.chunk_bytes, np.uint8))
        shaped = np.zeros((4, SMALL_LAYOUT.chunk_bytes // 4), np.uint8)
        got = await tier.get([keys[1], _key(9), keys[2]], [flipped, flipped.copy(), shaped])
        assert got == [True, False, True]
    assert batches == [3, 2]
    assert np.array_equal(flipped, payloads[1])
    assert np.array_equal(shaped.reshape(-1), payloads[2])
