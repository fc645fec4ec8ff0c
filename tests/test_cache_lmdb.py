"""TieredCache over DRAM and a real LMDB tier: cascade, persistence, sharing, isolation."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest

from kvtiers import CacheStateError, LookupResult, TieredCache, TierIOError
from kvtiers.tiers._lmdb_format import pack_value
from tests.conftest import make_config, make_kv, same_bytes, small_layout

pytestmark = pytest.mark.filterwarnings("error")

ROOT = Path(__file__).resolve().parents[1]


def _conversations(layout, count, num_tokens=64):
    return [
        ([conv * 10_000 + t for t in range(num_tokens)], make_kv(layout, num_tokens, seed=conv))
        for conv in range(count)
    ]


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_evicted_from_dram_served_from_lmdb(tmp_path, layout, write_policy):
    cfg = make_config(tmp_path, dram_chunks=6, lmdb_chunks=200, write_policy=write_policy)
    convs = _conversations(layout, 8)  # 32 chunks, DRAM holds 6
    async with TieredCache.from_config(cfg) as cache:
        for tokens, kv in convs:
            await cache.store(tokens, kv)
        for tokens, kv in convs:
            assert await cache.lookup(tokens) == 64
            assert same_bytes(await cache.load(tokens), kv)
        dram, disk = cache.stats().tiers
        assert disk.hits > 0 and dram.promotions > 0 and dram.evictions > 0
        if write_policy == "write_back":
            assert disk.demotions > 0
        assert cache.pin_count() == 0


async def test_locate_names_the_tier_each_chunk_is_read_from(tmp_path, layout):
    cfg = make_config(tmp_path, dram_chunks=64, lmdb_chunks=200)
    (tokens, kv), (other, other_kv) = _conversations(layout, 2)  # 4 chunks each
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(tokens, kv)
        await cache.store(other, other_kv)
        await cache.flush()  # in both tiers now: the top one is named
        found = await cache.locate(tokens + [7, 8, 9])  # a partial chunk past the prefix
        assert found == LookupResult(64, ("dram",) * 4)
        assert found.keys == tuple(cache.keys(tokens))  # the hit's keys, for key-level calls
    # A fresh cache over the same LMDB finds the chunks there (asked past its empty index).
    async with TieredCache.from_config(cfg) as cache:
        assert await cache.locate(tokens) == LookupResult(64, ("lmdb",) * 4)
        assert same_bytes(await cache.load(tokens[:32]), kv[:, :, :32])  # promotes two
        assert (await cache.locate(tokens)).tiers == ("dram", "dram", "lmdb", "lmdb")
        found = await cache.locate(other[:40])
        assert found == LookupResult(32, ("lmdb", "lmdb"))
        assert found.keys == tuple(cache.keys(other[:32]))
        assert await cache.locate([1, 2, 3]) == LookupResult(0, ())
        assert cache.stats().lookups == 4  # each counted as a lookup


async def test_close_drains_write_through_queue(tmp_path, layout):
    cfg = make_config(tmp_path, dram_chunks=64, lmdb_chunks=200)
    cfg["write_queue_chunks"] = 4  # back-pressure on the store path
    convs = _conversations(layout, 10)
    async with TieredCache.from_config(cfg) as cache:
        for tokens, kv in convs:
            await cache.store(tokens, kv)
    lmdb_only = {"layout": cfg["layout"], "tiers": [cfg["tiers"][1]]}
    async with TieredCache.from_config(lmdb_only) as cache:
        for tokens, kv in convs:
            assert await cache.lookup(tokens) == 64
            assert same_bytes(await cache.load(tokens), kv)


@pytest.mark.parametrize("queue_chunks", [2, 256])
async def test_close_waits_for_stores_in_flight(tmp_path, layout, queue_chunks):
    cfg = make_config(tmp_path, dram_chunks=64, lmdb_chunks=200)
    cfg["write_queue_chunks"] = queue_chunks  # 2: every store waits on a full queue
    convs = _conversations(layout, 5)
    cache = TieredCache.from_config(cfg)
    await cache.open()
    stores = [asyncio.create_task(cache.store(tokens, kv)) for tokens, kv in convs]
    await asyncio.sleep(0)  # the stores have started
    await asyncio.wait_for(cache.close(), 30)
    assert [await task for task in stores] == [64] * 5
    with pytest.raises(CacheStateError):
        await cache.store(*convs[0])
    lmdb_only = {"layout": cfg["layout"], "tiers": [cfg["tiers"][1]]}
    async with TieredCache.from_config(lmdb_only) as cache:
        for tokens, kv in convs:
            assert await cache.lookup(tokens) == 64
            assert same_bytes(await cache.load(tokens), kv)


_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path.insert(0, {root!r})
    from kvtiers import TieredCache
    from tests.conftest import make_kv, same_bytes, small_layout

    cfg = json.loads(sys.argv[1])
    mode = sys.argv[2]

    async def main():
        layout = small_layout()
        async with TieredCache.from_config(cfg) as cache:
            tokens = list(range(5000, 5064))
            kv = make_kv(layout, 64, seed=42)
            if mode == "store":
                print(await cache.store(tokens, kv))
            else:
                n = await cache.lookup(tokens)
                print(n, same_bytes(await cache.load(tokens[:n]), kv[:, :, :n]))

    asyncio.run(main())
    """
)


def _run_child(cfg, mode):
    code = _CHILD.format(root=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg), mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.split()


@pytest.mark.slow
async def test_restart_finds_chunks_in_lmdb(tmp_path, layout):
    cfg = make_config(tmp_path, lmdb_chunks=100)
    assert _run_child(cfg, "store") == ["64"]
    # A new process (another interpreter), a fresh DRAM tier: hits come from LMDB.
    assert _run_child(cfg, "load") == ["64", "True"]


@pytest.mark.slow
async def test_two_processes_share_one_lmdb_path(tmp_path, layout):
    cfg = make_config(tmp_path, lmdb_chunks=100)
    async with TieredCache.from_config(cfg) as cache:
        tokens = list(range(5000, 5064))
        assert await cache.lookup(tokens) == 0
        # While this cache is open, another process stores into the same environment.
        assert await asyncio.to_thread(_run_child, cfg, "store") == ["64"]
        assert await cache.lookup(tokens) == 64
        assert same_bytes(await cache.load(tokens), make_kv(layout, 64, seed=42))
        # And what this process stores, the other one finds.
        mine = list(range(7000, 7064))
        await cache.store(mine, make_kv(layout, 64, seed=1))
    assert _run_child(cfg, "load") == ["64", "True"]


@pytest.mark.parametrize(
    "change",
    [
        {"salt": "other-tenant"},
        {"layout": {"model": "another-model"}},
        {"layout": {"dtype": "bfloat16"}},
        {"layout": {"chunk_size": 32}},
        {"layout": {"tp_rank": 1, "tp_size": 2}},
        {"layout": {"model_revision": "v2"}},
    ],
    ids=["salt", "model", "dtype", "chunk_size", "tp_shard", "revision"],
)
async def test_isolation_on_a_shared_path(tmp_path, layout, change):
    tokens = list(range(64))
    cfg = make_config(tmp_path, lmdb_chunks=100)
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(tokens, make_kv(layout, 64), salt="tenant")
    other = make_config(tmp_path, lmdb_chunks=100, layout=change.get("layout"))
    salt = change.get("salt", "tenant")
    async with TieredCache.from_config(other) as cache:
        assert await cache.lookup(tokens, salt=salt) == 0
        assert (await cache.load(tokens, salt=salt)).shape[2] == 0


async def _store_then_rewrite(tmp_path, layout, chunk_idx, edit):
    """Store 64 tokens through dram and lmdb, then replace one chunk's lmdb value."""
    cfg = make_config(tmp_path, lmdb_chunks=100)
    tokens = list(range(64))
    kv = make_kv(layout, 64)
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(tokens, kv)
        victim = cache.keys(tokens)[chunk_idx]
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8, subdir=True)
    db = env.open_db(b"chunks")
    with env.begin(write=True, db=db) as txn:
        txn.put(victim, edit(bytes(txn.get(victim)), victim, kv))
    env.close()
    return cfg, tokens, kv


def _flip_payload_byte(value, key, kv):
    data = bytearray(value)
    data[-10] ^= 0xFF
    return bytes(data)


def _another_layouts_value(value, key, kv):
    other = small_layout(model="another-model").fingerprint
    return pack_value(other, key, kv[:, :, 16:32].contiguous().view(-1).numpy().data)


async def test_corrupt_lmdb_value_is_a_counted_miss(tmp_path, layout):
    cfg, tokens, kv = await _store_then_rewrite(tmp_path, layout, 2, _flip_payload_byte)
    async with TieredCache.from_config(cfg) as cache:
        assert await cache.lookup(tokens) == 64  # contains() does not read payloads
        got = await cache.load(tokens)
        assert got.shape[2] == 32  # the prefix before the corrupt chunk
        assert same_bytes(got, kv[:, :, :32])
        assert cache.stats().tiers[1].corrupt == 1
        assert cache.stats().miss_reasons == {"corrupt": 1}
        assert await cache.lookup(tokens) == 32  # deleted, never served


async def test_entry_of_another_layout_is_a_layout_mismatch_miss(tmp_path, layout):
    cfg, tokens, kv = await _store_then_rewrite(tmp_path, layout, 1, _another_layouts_value)
    async with TieredCache.from_config(cfg) as cache:
        assert await cache.lookup(tokens) == 64  # contains() does not read headers
        got = await cache.load(tokens)
        assert same_bytes(got, kv[:, :, :16])
        assert cache.stats().tiers[1].foreign == 1
        assert cache.stats().miss_reasons == {"layout_mismatch": 1}


async def test_cancelled_loads_with_lmdb_leave_no_pins(tmp_path, layout):
    cfg = make_config(tmp_path, dram_chunks=8, lmdb_chunks=300)
    convs = _conversations(layout, 12)
    async with TieredCache.from_config(cfg) as cache:
        for tokens, kv in convs:
            await cache.store(tokens, kv)

        async def worker(i):
            tokens, kv = convs[i % len(convs)]
            for _ in range(20):
                got = await cache.load(tokens)
                assert same_bytes(got, kv[:, :, : got.shape[2]])
                await cache.store(tokens, kv)

        for delay in (0.0, 0.002, 0.01):
            tasks = [asyncio.create_task(worker(i)) for i in range(12)]
            await asyncio.sleep(delay)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await cache.flush()  # background writers hold pins while they write
            assert cache.pin_count() == 0
        for tokens, kv in convs:
            got = await cache.load(tokens)
            assert same_bytes(got, kv[:, :, : got.shape[2]])


async def test_lmdb_capacity_respected(tmp_path, layout):
    cfg = make_config(tmp_path, dram_chunks=4, lmdb_chunks=10)
    async with TieredCache.from_config(cfg) as cache:
        for tokens, kv in _conversations(layout, 10):
            await cache.store(tokens, kv)
    async with TieredCache.from_config(cfg) as cache:
        usage = cache.tiers[1].usage()
        assert usage.used_bytes <= usage.capacity_bytes
        assert 0 < usage.num_entries <= 10


async def test_unwritable_lmdb_path_is_a_typed_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = make_config(tmp_path, lmdb_chunks=10, lmdb_dir="file/lmdb")
    cache = TieredCache.from_config(cfg)
    with pytest.raises(TierIOError, match="file"):
        await cache.open()
    await cache.close()


def test_small_layout_fixture_matches(layout):
    assert layout == small_layout()


async def test_lookup_does_not_trust_stale_hints_of_a_self_evicting_tier(tmp_path, layout):
    cfg = make_config(tmp_path, dram_chunks=2, lmdb_chunks=2)
    first, second = _conversations(layout, 2, num_tokens=32)
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(*first)
        await cache.flush()
        await cache.store(*second)
        await cache.flush()  # LMDB (2 chunks) evicted `first` on its own
        n = await cache.lookup(first[0])
        assert n == (await cache.load(first[0])).shape[2]
        assert n == 0


async def test_stats_after_close(tmp_path, layout):
    cache = TieredCache.from_config(make_config(tmp_path, lmdb_chunks=10))
    async with cache:
        await cache.store(list(range(32)), make_kv(layout, 32))
    stats = cache.stats()
    assert stats.tiers[1].usage.num_entries == 2
