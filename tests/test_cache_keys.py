"""TieredCache's key-level API: engines that hash their own pages (lookup/get/put by key)."""

from __future__ import annotations

import pytest
import torch

from kvtiers import InvalidInputError, LayoutMismatch, TieredCache, TokenError
from tests.conftest import make_config, make_kv, same_bytes, small_layout

HASHES = [f"{i:064x}" for i in range(1, 9)]  # an engine's page hashes (hex strings)


def chunks_of(kv: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [kv.narrow(2, i * size, size) for i in range(kv.shape[2] // size)]


def empty_chunks(layout, n: int) -> list[torch.Tensor]:
    return [torch.zeros(layout.chunk_shape(), dtype=torch.float16) for _ in range(n)]


async def test_put_get_round_trip_is_bit_identical(layout):
    kv = make_kv(layout, 8 * layout.chunk_size)
    async with TieredCache.from_config(make_config()) as cache:
        keys = cache.chunk_keys(HASHES)
        assert await cache.put_chunks(keys, chunks_of(kv, layout.chunk_size)) == [True] * 8
        assert await cache.lookup_keys(keys) == 8
        dsts = empty_chunks(layout, 8)
        assert await cache.get_chunks(keys, dsts) == [True] * 8
        for i, dst in enumerate(dsts):
            assert same_bytes(dst, kv.narrow(2, i * layout.chunk_size, layout.chunk_size))


async def test_lookup_keys_counts_the_leading_run_only(layout):
    kv = make_kv(layout, 8 * layout.chunk_size)
    chunks = chunks_of(kv, layout.chunk_size)
    async with TieredCache.from_config(make_config()) as cache:
        keys = cache.chunk_keys(HASHES)
        await cache.put_chunks(keys[:3], chunks[:3])
        await cache.put_chunks(keys[4:], chunks[4:], parent=keys[3])
        assert await cache.lookup_keys(keys) == 3
        assert await cache.lookup_keys(keys[4:]) == 4
        dsts = empty_chunks(layout, 8)
        assert await cache.get_chunks(keys, dsts) == [True] * 3 + [False] + [True] * 4
        assert not dsts[3].any()  # a miss leaves its destination untouched


async def test_contains_keys_answers_each_key_on_its_own(tmp_path, layout):
    kv = make_kv(layout, 8 * layout.chunk_size)
    chunks = chunks_of(kv, layout.chunk_size)
    want = [True, False, True, False, True, True, False, False]
    config = make_config(tmp_path, lmdb_chunks=64)
    async with TieredCache.from_config(config) as cache:
        keys = cache.chunk_keys(HASHES)
        for i in (0, 2, 4, 5):
            await cache.put_chunks(keys[i : i + 1], chunks[i : i + 1])
        assert await cache.contains_keys(keys) == want  # a gap does not end the answer
        assert await cache.contains_keys([]) == []
        await cache.flush()
    # a restarted server knows nothing in its index: the shared LMDB tier answers
    async with TieredCache.from_config(config) as cache:
        keys = cache.chunk_keys(HASHES)
        assert await cache.contains_keys(keys) == want
        assert await cache.contains_keys(keys[::-1]) == want[::-1]
        with pytest.raises(InvalidInputError):
            await cache.contains_keys([b"short"])


async def test_permuted_views_are_filled_in_place(layout):
    # An engine's host pool page seen through a permuted view: (2, L, P, H, D) -> payload order.
    kv = make_kv(layout, 2 * layout.chunk_size)
    pool = torch.zeros(2, layout.num_layers, 4 * layout.chunk_size, 2, 8, dtype=torch.float16)
    size = layout.chunk_size

    def page(i: int) -> torch.Tensor:
        return pool[:, :, i * size : (i + 1) * size].permute(1, 0, 2, 3, 4)

    async with TieredCache.from_config(make_config()) as cache:
        keys = cache.chunk_keys(HASHES[:2])
        await cache.put_chunks(keys, chunks_of(kv, size))
        assert await cache.get_chunks(keys, [page(3), page(1)]) == [True, True]
        assert same_bytes(page(3), kv.narrow(2, 0, size))
        assert same_bytes(page(1), kv.narrow(2, size, size))
        assert not page(0).any() and not page(2).any()


async def test_lower_tier_hits_come_back_after_the_top_tier_evicts(tmp_path, layout):
    kv = make_kv(layout, 8 * layout.chunk_size)
    config = make_config(tmp_path, dram_chunks=2, lmdb_chunks=64)
    async with TieredCache.from_config(config) as cache:
        keys = cache.chunk_keys(HASHES)
        assert all(await cache.put_chunks(keys, chunks_of(kv, layout.chunk_size)))
        await cache.flush()
        dsts = empty_chunks(layout, 8)
        assert await cache.get_chunks(keys, dsts) == [True] * 8
        assert same_bytes(torch.cat(dsts, dim=2), kv)
    # a second cache on the same LMDB path (a restarted server) finds every page
    async with TieredCache.from_config(config) as cache:
        keys = cache.chunk_keys(HASHES)
        assert await cache.lookup_keys(keys) == 8


async def test_salt_model_and_shard_keep_hashes_apart(layout):
    async with TieredCache.from_config(make_config()) as a:
        base = a.chunk_keys(HASHES[:1])
        assert a.chunk_keys(HASHES[:1], salt="tenant") != base
        assert a.chunk_keys([HASHES[0].encode()]) == base  # str and its bytes are one hash
        other_model = small_layout(model="other")
        b = TieredCache.from_config(make_config(layout={"model": "other"}))
        assert b.layout == other_model
        assert b.chunk_keys(HASHES[:1]) != base
        shard = TieredCache.from_config(make_config(layout={"tp_size": 2, "tp_rank": 1}))
        assert shard.chunk_keys(HASHES[:1]) != base
        # engine hashes never collide with token chains
        assert base[0] not in a.keys(list(range(layout.chunk_size)))


async def test_clear_removes_every_known_chunk(tmp_path, layout):
    kv = make_kv(layout, 4 * layout.chunk_size)
    async with TieredCache.from_config(make_config(tmp_path, lmdb_chunks=64)) as cache:
        keys = cache.chunk_keys(HASHES[:4])
        await cache.put_chunks(keys, chunks_of(kv, layout.chunk_size))
        await cache.store(list(range(32)), make_kv(layout, 32))
        assert await cache.clear() == 12  # (4 + 2 chunks) x 2 tiers
        assert await cache.lookup_keys(keys) == 0
        assert await cache.lookup(list(range(32))) == 0
        assert cache.pin_count() == 0


async def test_parent_links_pieces_for_leaf_first_eviction(layout):
    kv = make_kv(layout, 4 * layout.chunk_size)
    chunks = chunks_of(kv, layout.chunk_size)
    async with TieredCache.from_config(make_config(dram_chunks=4)) as cache:
        keys = cache.chunk_keys(HASHES[:4])
        await cache.put_chunks(keys[:2], chunks[:2])
        await cache.put_chunks(keys[2:], chunks[2:], parent=keys[1])
        # the prefix was stored first (least recent), but it has a child: the leaf goes
        await cache.put_chunks(cache.chunk_keys(["ff" * 32]), chunks[:1])
        assert await cache.lookup_keys(keys) == 3


@pytest.mark.parametrize(
    "keys, error",
    [
        ([b"short"], InvalidInputError),
        (b"\x00" * 16, InvalidInputError),
        (["0" * 16], InvalidInputError),
    ],
)
async def test_bad_keys_raise_typed_errors(layout, keys, error):
    async with TieredCache.from_config(make_config()) as cache:
        with pytest.raises(error):
            await cache.lookup_keys(keys)
        with pytest.raises(error):
            await cache.get_chunks(keys, empty_chunks(layout, 1))


async def test_bad_chunks_raise_and_write_nothing(layout):
    async with TieredCache.from_config(make_config()) as cache:
        keys = cache.chunk_keys(HASHES[:2])
        with pytest.raises(LayoutMismatch):
            await cache.put_chunks(keys, empty_chunks(layout, 1))
        with pytest.raises(LayoutMismatch):
            await cache.put_chunks(keys, [torch.zeros(3)] * 2)
        with pytest.raises(LayoutMismatch):
            await cache.get_chunks(keys, torch.zeros(2, *layout.chunk_shape()))
        assert await cache.lookup_keys(keys) == 0
        with pytest.raises(TokenError):
            cache.chunk_keys([""])
        with pytest.raises(TokenError):
            cache.chunk_keys([3])
        for hashes in (5, None, "abc", b"abc"):
            with pytest.raises(TokenError, match="hashes: expected a sequence"):
                cache.chunk_keys(hashes)
        with pytest.raises(TokenError, match="hashes.0.: not encodable"):
            cache.chunk_keys(["\ud800"])
        with pytest.raises(TokenError, match="salt: not encodable"):
            await cache.lookup(list(range(64)), salt="\ud800")
        chunks = chunks_of(make_kv(layout, 2 * layout.chunk_size), layout.chunk_size)
        for parent in ([1], 5, "x", b"short"):
            with pytest.raises(InvalidInputError, match="parent: expected 16 bytes"):
                await cache.put_chunks(keys, chunks, parent=parent)
            with pytest.raises(InvalidInputError, match="parent: expected 16 bytes"):
                await cache.get_chunks(keys, empty_chunks(layout, 2), parent=parent)
        assert await cache.lookup_keys(keys) == 0  # nothing was stored


async def test_numpy_byte_views_are_chunks_too(layout):
    kv = make_kv(layout, 2 * layout.chunk_size)
    size = layout.chunk_size
    async with TieredCache.from_config(make_config()) as cache:
        keys = cache.chunk_keys(HASHES[:2])
        srcs = [
            kv.narrow(2, i * size, size).contiguous().view(torch.uint8).numpy() for i in range(2)
        ]
        assert await cache.put_chunks(keys, srcs) == [True, True]
        out = torch.zeros(2, *layout.chunk_shape(), dtype=torch.float16)
        dsts = [out[i].view(torch.uint8).numpy() for i in range(2)]
        assert await cache.get_chunks(keys, dsts) == [True, True]
        assert same_bytes(out[0], kv.narrow(2, 0, size)) and same_bytes(
            out[1], kv.narrow(2, size, size)
        )
        with pytest.raises(LayoutMismatch):
            await cache.get_chunks(keys, [dsts[0].reshape(-1)[:10], dsts[1]])


async def test_contiguous_byte_chunks_reach_a_lower_tier_without_a_staging_copy(
    tmp_path, layout, monkeypatch
):
    import numpy as np

    from kvtiers import _residency

    monkeypatch.setattr(_residency, "DIRECT_PUT_BYTES", layout.chunk_bytes)  # big chunks only

    cfg = make_config(tmp_path, lmdb_chunks=16)
    cfg["tiers"] = cfg["tiers"][1:]  # lmdb alone: every put goes below a memory tier
    kv = make_kv(layout, 4 * layout.chunk_size)
    size = layout.chunk_size
    srcs = [kv.narrow(2, i * size, size).contiguous().view(torch.uint8).numpy() for i in range(4)]
    wide = np.zeros((2, 2 * srcs[0].nbytes), np.uint8)
    wide[:, ::2] = np.stack([src.reshape(-1) for src in srcs[:2]])
    async with TieredCache.from_config(cfg) as cache:
        bufs_seen: list[np.ndarray] = []
        put = cache.tiers[0].put

        async def spy(keys, bufs):
            bufs_seen.extend(bufs)
            return await put(keys, bufs)

        cache.tiers[0].put = spy
        keys = cache.chunk_keys(HASHES[:4])
        assert await cache.put_chunks(keys, srcs) == [True] * 4
        # the tier read the caller's bytes in place
        assert [np.shares_memory(b, s) for b, s in zip(bufs_seen, srcs, strict=True)] == [True] * 4
        dsts = [np.zeros(srcs[0].nbytes, np.uint8) for _ in range(4)]
        assert await cache.get_chunks(keys, dsts) == [True] * 4
        assert all(
            np.array_equal(dst, src.reshape(-1)) for dst, src in zip(dsts, srcs, strict=True)
        )
        bufs_seen.clear()
        strided = list(wide[:, ::2])  # not contiguous: copied into a stage buffer first
        assert await cache.put_chunks(cache.chunk_keys(HASHES[4:6]), strided) == [True] * 2
        assert not any(np.shares_memory(b, wide) for b in bufs_seen) and len(bufs_seen) == 2
        assert await cache.get_chunks(cache.chunk_keys(HASHES[4:6]), dsts[:2]) == [True] * 2
        assert np.array_equal(dsts[0], srcs[0].reshape(-1))
    # below the size for direct puts, a batch is staged but a lone chunk is not
    monkeypatch.setattr(_residency, "DIRECT_PUT_BYTES", 2 * layout.chunk_bytes)
    async with TieredCache.from_config(cfg) as cache:
        put2 = cache.tiers[0].put

        async def spy2(keys, bufs):
            bufs_seen.extend(bufs)
            return await put2(keys, bufs)

        cache.tiers[0].put = spy2
        bufs_seen.clear()
        assert await cache.put_chunks(cache.chunk_keys(HASHES[6:8]), srcs[:2]) == [True] * 2
        assert not any(np.shares_memory(b, s) for b, s in zip(bufs_seen, srcs, strict=False))
        bufs_seen.clear()
        assert await cache.put_chunks(cache.chunk_keys(["ee" * 32]), srcs[:1]) == [True]
        assert np.shares_memory(bufs_seen[0], srcs[0])
