"""The conformance suite every `Tier` must pass.

A tier's test module subclasses `TierTests`, sets `tier_cls` and implements `make_tier`:

    class TestLMDBTier(TierTests):
        tier_cls = LMDBTier
        atomic_batches = True

        def entry_bytes(self):
            return value_bytes(self.layout.fingerprint, self.layout.chunk_bytes)

        async def make_tier(self, tmp_path, layout, capacity_bytes):
            options = {"path": str(tmp_path / "lmdb")}
            return LMDBTier(TierConfig("lmdb", capacity_bytes, options=options), layout)

The tests are coroutines and need pytest-asyncio in auto mode (`asyncio_mode = "auto"`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import pytest_asyncio

from kvtiers.core.errors import CacheStateError, InvalidInputError
from kvtiers.core.keys import KEY_BYTES, ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierUsage
from kvtiers.tiers.base import Buffer, Tier, TierState

__all__ = ["SMALL_LAYOUT", "TierTests"]

SMALL_LAYOUT = KVLayout(
    model="m", num_layers=2, num_kv_heads=2, head_size=8, dtype="float16", chunk_size=16
)
"""A layout of 2 KiB chunks, small enough for hundreds of chunks per test."""

_SENTINEL = 0xAB  # fills destinations that a miss must leave alone


class TierTests:
    """Tests that every tier must pass.

    Subclasses set `tier_cls` and implement `make_tier`; pytest collects them when their
    name starts with `Test`.
    """

    tier_cls: ClassVar[type[Tier]]
    """The tier class under test."""
    layout: ClassVar[KVLayout] = SMALL_LAYOUT
    """The layout of the chunks the tests store."""
    atomic_batches: ClassVar[bool] = False
    """Whether a `put` batch is all or nothing (one transaction), also when cancelled."""
    evicts_cold_first: ClassVar[bool] = False
    """Whether the tier evicts by itself, least recently used, and takes the entries put
    cold (`put_hinted`) first."""

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> Tier:
        """Return a new, unopened tier of the class under test.

        Args:
            tmp_path: a fresh directory the tier may use.
            layout: the layout of its chunks.
            capacity_bytes: its capacity.

        Returns:
            The tier, not yet opened.
        """
        raise NotImplementedError

    def entry_bytes(self) -> int:
        """Return the bytes one stored chunk adds to `usage().used_bytes`.

        The default is the payload alone; a tier that also counts a header overrides this.
        """
        return self.layout.chunk_bytes

    def capacity_for(self, num_chunks: int) -> int:
        """Return a capacity that holds `num_chunks` chunks but not one more."""
        return num_chunks * self.entry_bytes()

    @contextlib.asynccontextmanager
    async def open_tier(self, tmp_path: Path, num_chunks: int = 512) -> AsyncIterator[Tier]:
        """Open a tier holding `num_chunks` chunks for the duration of the context."""
        tier = await self.make_tier(tmp_path, self.layout, self.capacity_for(num_chunks))
        assert isinstance(tier, self.tier_cls)
        assert tier.state is TierState.UNOPENED
        async with tier:
            yield tier

    @pytest_asyncio.fixture
    async def tier(self, tmp_path: Path) -> AsyncIterator[Tier]:
        """Yield an open tier with room for 512 chunks."""
        async with self.open_tier(tmp_path) as tier:
            yield tier

    # -- helpers ---------------------------------------------------------------------------

    def keys(self, num: int, seed: int = 0) -> list[ChunkKey]:
        """Return `num` distinct random keys."""
        rng = np.random.default_rng(seed + 1_000_003)
        return [ChunkKey(rng.bytes(KEY_BYTES)) for _ in range(num)]

    def payloads(self, num: int, seed: int = 0) -> list[Buffer]:
        """Return `num` random contiguous chunk payloads."""
        rng = np.random.default_rng(seed)
        return [rng.integers(0, 256, self.layout.chunk_bytes, dtype=np.uint8) for _ in range(num)]

    def dsts(self, num: int) -> list[Buffer]:
        """Return `num` contiguous destinations filled with a sentinel byte."""
        return [np.full(self.layout.chunk_bytes, _SENTINEL, dtype=np.uint8) for _ in range(num)]

    def strided(self, num: int) -> tuple[Buffer, list[Buffer]]:
        """Return a zeroed KV-shaped array and `num` strided chunk views of it.

        Each view takes every other token of one chunk's `[layer][kv][token][head][dim]`
        bytes, as a view of an engine's KV tensor would.
        """
        layout = self.layout
        shape = (*layout.chunk_shape()[:-1], layout.chunk_shape()[-1] * layout.itemsize)
        base = np.zeros((num, *shape[:2], 2 * shape[2], *shape[3:]), dtype=np.uint8)
        return base, [base[i, :, :, ::2] for i in range(num)]

    # -- round trips -----------------------------------------------------------------------

    async def test_put_get_roundtrip(self, tier: Tier) -> None:
        keys, srcs = self.keys(8), self.payloads(8)
        assert await tier.put(keys, srcs) == [True] * 8
        dsts = self.dsts(8)
        assert await tier.get(keys, dsts) == [True] * 8
        for src, dst in zip(srcs, dsts, strict=True):
            assert np.array_equal(src, dst)

    async def test_put_hinted_stores_as_put_does(self, tier: Tier) -> None:
        keys, srcs = self.keys(4), self.payloads(4)
        assert await tier.put_hinted(keys, srcs, cold=keys[2:]) == [True] * 4
        dsts = self.dsts(4)
        assert await tier.get(keys, dsts) == [True] * 4
        for src, dst in zip(srcs, dsts, strict=True):
            assert np.array_equal(src, dst)
        assert await tier.put_hinted([], [], cold=()) == []

    async def test_entries_put_cold_are_evicted_first(self, tmp_path: Path) -> None:
        if not self.evicts_cold_first:
            pytest.skip("the tier takes no reuse hint: put_hinted is its put")
        a, b, c = self.keys(2), self.keys(2, seed=1), self.keys(2, seed=2)
        d, e, f = (self.keys(1, seed=n) for n in (3, 4, 5))
        async with self.open_tier(tmp_path, num_chunks=4) as tier:
            await tier.put(a, self.payloads(2))
            await tier.put(b[:1], self.payloads(1))
            # b's second chunk is new and cold; its first, held already, is touched as always.
            assert await tier.put_hinted(b, self.payloads(2), cold=set(b)) == [True, True]
            await tier.put(c[:1], self.payloads(1))  # evicts the cold chunk, not a's older ones
            assert await tier.contains([*a, *b, c[0]]) == [True, True, True, False, True]
            # A cold entry takes room only from free space and cold entries: none here.
            assert await tier.put_hinted(c, self.payloads(2), cold={c[1]}) == [True, False]
            await tier.put(d, self.payloads(1))  # a's deepest, the oldest entry, goes
            found = await tier.contains([*a, *b, *c, *d])
            assert found == [True, False, True, False, True, False, True]
            # A read makes a cold entry warm: the oldest warm one goes instead.
            await tier.delete(d)
            assert await tier.put_hinted(e, self.payloads(1), cold=set(e)) == [True]
            assert await tier.get(e, self.dsts(1)) == [True]
            await tier.put(f, self.payloads(1))
            found = await tier.contains([a[0], b[0], c[0], e[0], f[0]])
            assert found == [False, True, True, True, True]

    async def test_cold_puts_and_hits_while_cold_are_counted(self, tmp_path: Path) -> None:
        if not self.evicts_cold_first:
            pytest.skip("the tier takes no reuse hint: the cache's policy counts for it")
        a, b = self.keys(3), self.keys(1, seed=1)
        async with self.open_tier(tmp_path, num_chunks=8) as tier:
            assert await tier.put_hinted(a, self.payloads(3), cold=set(a[1:])) == [True] * 3
            assert await tier.get(a[1:2], self.dsts(1)) == [True]  # a wrong hint
            assert await tier.get(a[1:2], self.dsts(1)) == [True]  # warm since the first read
            # Held already: nothing is written, so nothing is stored cold again.
            assert await tier.put_hinted(a, self.payloads(3), cold=set(a)) == [True] * 3
            await tier.put(b, self.payloads(1))  # lmdb records reads' recency with a write
            stats = tier.stats()
            got = (stats.cold_puts, stats.cold_hits, stats.puts)
            assert got == (2, 1, 4)

    async def test_roundtrip_strided(self, tier: Tier) -> None:
        keys, srcs = self.keys(4), self.payloads(4)
        src_base, src_views = self.strided(4)
        for src, view in zip(srcs, src_views, strict=True):
            view[...] = src.reshape(view.shape)
        assert await tier.put(keys, src_views) == [True] * 4
        dst_base, dst_views = self.strided(4)
        assert await tier.get(keys, dst_views) == [True] * 4
        for src, view in zip(srcs, dst_views, strict=True):
            assert np.array_equal(view.ravel(), src)
        assert not dst_base[:, :, :, 1::2].any()  # nothing written between the views
        assert np.array_equal(dst_base, src_base)

    async def test_empty_batches(self, tier: Tier) -> None:
        assert await tier.put([], []) == []
        assert await tier.get([], []) == []
        assert await tier.contains([]) == []
        await tier.delete([])

    async def test_put_existing_key_is_kept(self, tier: Tier) -> None:
        keys, srcs = self.keys(3), self.payloads(3)
        await tier.put(keys, srcs)
        usage, puts = tier.usage(), tier.stats().puts
        assert await tier.put(keys, srcs) == [True] * 3
        assert tier.usage() == usage
        assert tier.stats().puts == puts  # nothing written again

    # -- contains, delete, misses ----------------------------------------------------------

    async def test_contains(self, tier: Tier) -> None:
        keys = self.keys(4)
        assert await tier.contains(keys) == [False] * 4
        await tier.put(keys[1:3], self.payloads(2))
        assert await tier.contains(keys) == [False, True, True, False]

    async def test_delete(self, tier: Tier) -> None:
        keys = self.keys(4)
        await tier.put(keys, self.payloads(4))
        await tier.delete([keys[0], keys[2], *self.keys(1, seed=9)])
        assert await tier.contains(keys) == [False, True, False, True]
        dsts = self.dsts(4)
        assert await tier.get(keys, dsts) == [False, True, False, True]
        assert (dsts[0] == _SENTINEL).all()

    async def test_touch_changes_no_content(self, tier: Tier) -> None:
        keys = self.keys(3)
        await tier.put(keys[:2], self.payloads(2))
        tier.touch([keys[1], keys[2]])  # a held key and an unknown one
        tier.touch([])
        assert await tier.contains(keys) == [True, True, False]
        dsts = self.dsts(2)
        assert await tier.get(keys[:2], dsts) == [True, True]
        for dst, src in zip(dsts, self.payloads(2), strict=True):
            assert np.array_equal(dst, src)

    async def test_get_missing_leaves_dst_untouched(self, tier: Tier) -> None:
        dsts = self.dsts(3)
        _, views = self.strided(1)
        assert await tier.get(self.keys(4), [*dsts, views[0]]) == [False] * 4
        assert all((dst == _SENTINEL).all() for dst in dsts)
        assert not views[0].any()

    async def test_batch_results_are_aligned(self, tier: Tier) -> None:
        keys, srcs = self.keys(6), self.payloads(6)
        assert await tier.put(keys[::2], srcs[::2]) == [True] * 3
        expected = [True, False] * 3
        assert await tier.contains(keys) == expected
        dsts = self.dsts(6)
        assert await tier.get(keys, dsts) == expected
        for hit, src, dst in zip(expected, srcs, dsts, strict=True):
            assert np.array_equal(dst, src) if hit else (dst == _SENTINEL).all()

    async def test_get_layers_fills_only_those_layers(self, tier: Tier) -> None:
        keys, srcs = self.keys(3), self.payloads(3)
        assert await tier.put(keys[:2], srcs[:2]) == [True, True]
        step, last = self.layout.layer_bytes, self.layout.num_layers - 1
        dsts = self.dsts(3)
        hits_before = tier.counters.hits
        assert await tier.get_layers(keys, [last], dsts, tally=False) == [True, True, False]
        assert tier.counters.hits == hits_before  # tally off: a later wave of one load
        for dst, src in zip(dsts[:2], srcs[:2], strict=True):
            assert np.array_equal(dst[last * step :], src[last * step :])
            assert (dst[: last * step] == _SENTINEL).all()
        assert (dsts[2] == _SENTINEL).all()
        _, views = self.strided(1)  # into a strided view of an engine's tensor
        assert await tier.get_layers(keys[:1], [0], views) == [True]
        flat = np.ascontiguousarray(views[0]).reshape(-1)
        assert np.array_equal(flat[:step], srcs[0][:step]) and not flat[step:].any()
        with pytest.raises(InvalidInputError):
            await tier.get_layers(keys[:1], [self.layout.num_layers], self.dsts(1))

    # -- accounting ------------------------------------------------------------------------

    async def test_usage_accounting(self, tier: Tier) -> None:
        usage = tier.usage()
        assert (usage.used_bytes, usage.num_entries) == (0, 0)
        assert usage.capacity_bytes == tier.capacity_bytes
        keys = self.keys(6)
        await tier.put(keys, self.payloads(6))
        usage = tier.usage()
        assert usage == TierUsage(tier.capacity_bytes, 6 * self.entry_bytes(), 6)
        await tier.delete(keys[:2])
        assert tier.usage() == TierUsage(tier.capacity_bytes, 4 * self.entry_bytes(), 4)
        await tier.delete(keys)
        assert (tier.usage().used_bytes, tier.usage().num_entries) == (0, 0)

    async def test_capacity_respected(self, tmp_path: Path) -> None:
        async with self.open_tier(tmp_path, num_chunks=4) as tier:
            for seed in range(4):
                await tier.put(self.keys(3, seed=seed), self.payloads(3, seed=seed))
                assert tier.usage().used_bytes <= tier.capacity_bytes
            keys = self.keys(10, seed=99)
            results = await tier.put(keys, self.payloads(10))
            usage = tier.usage()
            assert usage.used_bytes <= tier.capacity_bytes
            assert 1 <= usage.num_entries <= 4
            assert sum(await tier.contains(keys)) == sum(results) <= 4

    async def test_concurrent_batches(self, tier: Tier) -> None:
        keys, srcs = self.keys(40), self.payloads(40)
        puts = [tier.put(keys[i : i + 10], srcs[i : i + 10]) for i in range(0, 40, 10)]
        assert all(all(r) for r in await asyncio.gather(*puts))
        dsts = self.dsts(40)
        gets = [tier.get(keys[i : i + 5], dsts[i : i + 5]) for i in range(0, 40, 5)]
        assert all(all(r) for r in await asyncio.gather(*gets))
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts, strict=True))

    # -- lifecycle -------------------------------------------------------------------------

    async def test_ops_before_open_raise(self, tmp_path: Path) -> None:
        tier = await self.make_tier(tmp_path, self.layout, self.capacity_for(8))
        with pytest.raises(CacheStateError):
            await tier.contains(self.keys(1))
        with pytest.raises(CacheStateError):
            await tier.put(self.keys(1), self.payloads(1))

    async def test_ops_after_close_raise(self, tmp_path: Path) -> None:
        async with self.open_tier(tmp_path) as tier:
            pass
        assert tier.state is TierState.CLOSED
        keys, bufs = self.keys(1), self.payloads(1)
        with pytest.raises(CacheStateError):
            await tier.contains(keys)
        with pytest.raises(CacheStateError):
            await tier.get(keys, bufs)
        with pytest.raises(CacheStateError):
            await tier.put(keys, bufs)
        with pytest.raises(CacheStateError):
            await tier.delete(keys)

    async def test_close_is_idempotent(self, tier: Tier) -> None:
        await tier.close()
        await tier.close()
        assert tier.state is TierState.CLOSED

    async def test_open_twice_raises(self, tier: Tier) -> None:
        with pytest.raises(CacheStateError):
            await tier.open()
        await tier.close()
        with pytest.raises(CacheStateError):
            await tier.open()

    # -- bad input -------------------------------------------------------------------------

    async def test_wrong_buffer_size_raises_and_writes_nothing(self, tier: Tier) -> None:
        keys, size = self.keys(2), self.layout.chunk_bytes
        bad_srcs: list[list[Buffer]] = [
            [*self.payloads(1), np.zeros(size - 1, dtype=np.uint8)],
            [*self.payloads(1), np.zeros(size + 1, dtype=np.uint8)],
            [*self.payloads(1), np.zeros(size // 2, dtype=np.float16)],  # right bytes, wrong dtype
            self.payloads(1),  # one buffer for two keys
        ]
        for srcs in bad_srcs:
            with pytest.raises(InvalidInputError):
                await tier.put(keys, srcs)
        assert await tier.contains(keys) == [False, False]
        assert (tier.usage().used_bytes, tier.usage().num_entries) == (0, 0)
        await tier.put(keys[:1], self.payloads(1))
        dst = np.full(size - 1, _SENTINEL, dtype=np.uint8)
        with pytest.raises(InvalidInputError):
            await tier.get(keys[:1], [dst])
        assert (dst == _SENTINEL).all()

    # -- cancellation ----------------------------------------------------------------------

    @pytest.mark.parametrize("delay", [0.0, 0.0002, 0.001, 0.005])
    async def test_cancelled_put_is_whole_or_missing(self, tmp_path: Path, delay: float) -> None:
        num = 300
        async with self.open_tier(tmp_path, num_chunks=num + 8) as tier:
            await tier.put(self.keys(1, seed=7), self.payloads(1, seed=7))
            keys, srcs = self.keys(num), self.payloads(num)
            task = asyncio.ensure_future(tier.put(keys, srcs))
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            held = await tier.contains(keys)
            dsts = self.dsts(num)
            assert await tier.get(keys, dsts) == held
            for hit, src, dst in zip(held, srcs, dsts, strict=True):
                assert np.array_equal(dst, src) if hit else (dst == _SENTINEL).all()
            if self.atomic_batches:
                assert len(set(held)) == 1
            usage = tier.usage()
            assert usage.num_entries == 1 + sum(held)
            assert usage.used_bytes == self.entry_bytes() * (1 + sum(held))
