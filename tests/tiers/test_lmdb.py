import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.core.layout import KVLayout
from kvtiers.testing.tiers import SMALL_LAYOUT, TierTests
from kvtiers.tiers._lmdb_format import pack_value, value_bytes
from kvtiers.tiers._lmdb_reads import (
    SPLIT_MIN_VALUE,
    SPLIT_PART_BYTES,
    keys_present_now,
    part_bytes,
    read_parts,
)
from kvtiers.tiers.lmdb import LMDBTier

lmdb = pytest.importorskip("lmdb")

REPO = Path(__file__).resolve().parents[2]
VALUE_BYTES = value_bytes(SMALL_LAYOUT.fingerprint, SMALL_LAYOUT.chunk_bytes)


def make_config(db_path: Path | str, /, num_chunks: int = 64, **options: Any) -> TierConfig:
    return TierConfig(
        "lmdb", num_chunks * VALUE_BYTES, options={"path": str(db_path), **options}, index=2
    )


class TestLMDBTier(TierTests):
    tier_cls = LMDBTier
    atomic_batches = True
    evicts_cold_first = True

    def entry_bytes(self) -> int:
        return VALUE_BYTES

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> LMDBTier:
        config = TierConfig("lmdb", capacity_bytes, options={"path": str(tmp_path / "lmdb")})
        return LMDBTier(config, layout)


class TestLMDBTierWritemap(TestLMDBTier):
    """The same contract with values written straight into the map (`writemap = true`)."""

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> LMDBTier:
        options = {"path": str(tmp_path / "lmdb"), "writemap": True}
        return LMDBTier(TierConfig("lmdb", capacity_bytes, options=options), layout)


async def test_writemap_allocates_the_data_file_whole(tmp_path: Path) -> None:
    async with LMDBTier(make_config(tmp_path / "db", writemap=True), SMALL_LAYOUT) as tier:
        assert await tier.put(keys(2), payloads(2)) == [True, True]
        data = (tmp_path / "db" / "data.mdb").stat()
        assert data.st_blocks * 512 >= tier.map_size  # no hole a map write could hit
    async with LMDBTier(make_config(tmp_path / "db", writemap=True), SMALL_LAYOUT) as tier:
        dsts = [np.zeros(SMALL_LAYOUT.chunk_bytes, dtype=np.uint8) for _ in range(2)]
        assert await tier.get(keys(2), dsts) == [True, True]
        assert all(np.array_equal(d, s) for d, s in zip(dsts, payloads(2), strict=True))


@pytest.mark.parametrize("first", [False, True])
async def test_a_path_refuses_the_other_writemap_setting(tmp_path: Path, first: bool) -> None:
    async with LMDBTier(make_config(tmp_path / "db", writemap=first), SMALL_LAYOUT) as tier:
        assert await tier.put(keys(1), payloads(1)) == [True]
    other = LMDBTier(make_config(tmp_path / "db", writemap=not first), SMALL_LAYOUT)
    with pytest.raises(TierIOError, match=f"created with writemap = {str(first).lower()}"):
        await other.open()
    async with LMDBTier(make_config(tmp_path / "db", writemap=first), SMALL_LAYOUT) as tier:
        assert await tier.contains(keys(1)) == [True]  # nothing lost


@pytest.mark.parametrize("value", [1, "yes", None])
def test_writemap_must_be_a_bool(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"\.writemap: expected true or false"):
        LMDBTier(make_config(tmp_path / "db", writemap=value), SMALL_LAYOUT)


# Helpers bypass the tier: they rewrite stored values through the lmdb module directly.


def rewrite_value(path: Path, key: bytes, edit) -> int:
    """Replace the value under `key` by `edit(value)`; return the new value's length."""
    env = lmdb.open(str(path), max_dbs=4)
    try:
        chunks = env.open_db(b"chunks")
        with env.begin(write=True, db=chunks) as txn:
            value = edit(bytes(txn.get(key)))
            txn.put(key, value)
    finally:
        env.close()
    return len(value)


def flip_payload_byte(value: bytes) -> bytes:
    data = bytearray(value)
    data[-7] ^= 0xFF
    return bytes(data)


def payloads(num: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, SMALL_LAYOUT.chunk_bytes, dtype=np.uint8) for _ in range(num)]


def keys(num: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed + 1000)
    return [rng.bytes(16) for _ in range(num)]


async def put_and_close(path: Path, ks: list[bytes], srcs: list[np.ndarray]) -> None:
    async with LMDBTier(make_config(path), SMALL_LAYOUT) as tier:
        assert await tier.put(ks, srcs) == [True] * len(ks)


async def test_a_get_cancelled_twice_still_waits_for_its_reads(tmp_path: Path) -> None:
    # A load's branches are cancelled once by asyncio.gather and again by the load's
    # clean-up; the read thread must be done with the destinations before the call ends
    # (they are reserved blocks or a stage, reused at once).
    async with LMDBTier(make_config(tmp_path / "db"), SMALL_LAYOUT) as tier:
        assert await tier.put(keys(2), payloads(2)) == [True, True]
        started, release = threading.Event(), threading.Event()
        read_batch = tier._reader.read_batch

        def blocked(*args: Any) -> Any:
            started.set()
            release.wait(10)
            return read_batch(*args)

        tier._reader.read_batch = blocked  # type: ignore[method-assign]
        out = [np.zeros(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in range(2)]
        task = asyncio.ensure_future(tier.get(keys(2), out))
        while not started.is_set():
            await asyncio.sleep(0.001)
        for _ in range(2):
            task.cancel()
            await asyncio.sleep(0.02)
        assert not task.done()  # still waiting for the thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task


# -- integrity -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        flip_payload_byte,
        lambda v: v[:-1],  # truncated payload
        lambda v: v + b"x",  # payload too long
        lambda v: b"\xff\x00" + v[2:],  # header length past the end
        lambda v: v[:2] + b"\xc1" * 8 + v[10:],  # msgpack garbage in the header
        lambda v: b"",
    ],
)
async def test_corrupt_entry_is_a_deleted_miss(tmp_path: Path, edit) -> None:
    path, ks, srcs = tmp_path / "db", keys(3), payloads(3)
    await put_and_close(path, ks, srcs)
    rewrite_value(path, ks[1], edit)
    async with LMDBTier(make_config(path), SMALL_LAYOUT) as tier:
        dsts = [np.full(SMALL_LAYOUT.chunk_bytes, 7, dtype=np.uint8) for _ in ks]
        assert await tier.get(ks, dsts) == [True, False, True]
        assert (dsts[1] == 7).all()
        assert np.array_equal(dsts[0], srcs[0]) and np.array_equal(dsts[2], srcs[2])
        assert (tier.counters.corrupt, tier.counters.foreign) == (1, 0)
        assert await tier.contains(ks) == [True, False, True]
        assert tier.usage().num_entries == 2
        # the size recorded when the entry was written is given back, whatever the edit did
        assert tier.usage().used_bytes == 2 * VALUE_BYTES
        # the slot is free again: a new put stores it, and it reads back
        assert await tier.put(ks[1:2], srcs[1:2]) == [True]
        assert await tier.get(ks[1:2], dsts[1:2]) == [True]
        assert np.array_equal(dsts[1], srcs[1])


@pytest.mark.parametrize("foreign", ["fingerprint", "key"])
async def test_foreign_entry_is_a_deleted_miss(tmp_path: Path, foreign: str) -> None:
    path, ks, srcs = tmp_path / "db", keys(2), payloads(2)
    await put_and_close(path, ks, srcs)
    other = KVLayout(model="other", num_layers=2, num_kv_heads=2, head_size=8, dtype="float16")
    fingerprint = other.fingerprint if foreign == "fingerprint" else SMALL_LAYOUT.fingerprint
    key = ks[0] if foreign == "fingerprint" else ks[1]
    rewrite_value(path, ks[0], lambda _: pack_value(fingerprint, key, srcs[0].data))
    async with LMDBTier(make_config(path), SMALL_LAYOUT) as tier:
        dst = np.zeros(SMALL_LAYOUT.chunk_bytes, dtype=np.uint8)
        assert await tier.get(ks[:1], [dst]) == [False]
        assert not dst.any()
        assert (tier.counters.corrupt, tier.counters.foreign) == (0, 1)
        assert await tier.contains(ks) == [False, True]
        assert tier.usage().num_entries == 1


async def test_reopen_finds_the_data(tmp_path: Path) -> None:
    path, ks, srcs = tmp_path / "db", keys(5), payloads(5)
    await put_and_close(path, ks, srcs)
    async with LMDBTier(make_config(path), SMALL_LAYOUT) as tier:
        assert tier.usage().num_entries == 5
        assert tier.usage().used_bytes == 5 * VALUE_BYTES
        dsts = [np.empty_like(s) for s in srcs]
        assert await tier.get(ks, dsts) == [True] * 5
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts, strict=True))


@pytest.mark.parametrize("writemap", [False, True])
async def test_a_truncated_file_fails_the_open_instead_of_crashing(
    tmp_path: Path, writemap: bool
) -> None:
    path = tmp_path / "db"
    config = make_config(path, writemap=writemap)
    async with LMDBTier(config, SMALL_LAYOUT) as tier:
        assert await tier.put(keys(5), payloads(5)) == [True] * 5
    data = path / "data.mdb"
    os.truncate(data, 4 * 4096)  # the meta pages stay; the tree and values are gone
    # NOTE: with writemap LMDB extends the file to the map's size at open (zeros), so the
    # tree's pages are found to be garbage instead; either way nothing is mapped past EOF.
    match = "MDB_CORRUPTED" if writemap else "shorter than its .* bytes of pages"
    with pytest.raises(TierIOError, match=match):
        async with LMDBTier(config, SMALL_LAYOUT):
            pass


async def test_a_reader_count_past_lmdb_limits_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_readers"):
        LMDBTier(make_config(tmp_path / "db", max_readers=2**31), SMALL_LAYOUT)
    tier = LMDBTier(make_config(tmp_path / "db", max_readers=2**31 - 1), SMALL_LAYOUT)
    async with tier:  # the most py-lmdb takes
        assert await tier.put(keys(1), payloads(1)) == [True]


CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    import numpy as np
    from kvtiers.core.config import TierConfig
    from kvtiers.core.layout import KVLayout
    from kvtiers.tiers.lmdb import LMDBTier

    async def main(path, data_dir, layout):
        data = np.load(data_dir + "/in.npz")
        keys = [bytes(k) for k in data["keys"]]
        config = TierConfig("lmdb", 1 << 20, options={"path": path})
        async with LMDBTier(config, layout) as tier:
            dsts = [np.zeros(layout.chunk_bytes, np.uint8) for _ in keys]
            if await tier.get(keys, dsts) != [True] * len(keys):
                sys.exit("child: parent's chunks missing")
            if not all(np.array_equal(d, s) for d, s in zip(dsts, data["srcs"])):
                sys.exit("child: parent's chunks differ")
            out = np.load(data_dir + "/out.npz")
            new_keys = [bytes(k) for k in out["keys"]]
            if await tier.put(new_keys, list(out["srcs"])) != [True] * len(new_keys):
                sys.exit("child: put declined")

    asyncio.run(main(sys.argv[1], sys.argv[2], KVLayout.from_dict(json.loads(sys.argv[3]))))
    """
)


def key_array(ks: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(ks), np.uint8).reshape(-1, 16)


async def test_two_processes_share_one_path(tmp_path: Path) -> None:
    path = tmp_path / "db"
    ks, srcs = keys(6), payloads(6)
    new_ks, new_srcs = keys(4, seed=1), payloads(4, seed=1)
    np.savez(tmp_path / "in.npz", keys=key_array(ks), srcs=np.stack(srcs))
    np.savez(tmp_path / "out.npz", keys=key_array(new_ks), srcs=np.stack(new_srcs))
    layout_json = json.dumps(dataclasses.asdict(SMALL_LAYOUT))
    config = TierConfig("lmdb", 1 << 20, options={"path": str(path)})
    async with LMDBTier(config, SMALL_LAYOUT) as tier:
        assert await tier.put(ks, srcs) == [True] * 6
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), str(tmp_path), layout_json],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr
        # the child wrote while this process held the environment open
        dsts = [np.zeros_like(s) for s in new_srcs]
        assert await tier.get(new_ks, dsts) == [True] * 4
        assert all(np.array_equal(s, d) for s, d in zip(new_srcs, dsts, strict=True))
        assert tier.usage().num_entries == 10


# -- eviction --------------------------------------------------------------------------------


async def test_one_batch_over_capacity_keeps_the_prefix(tmp_path: Path) -> None:
    chain = keys(6)
    async with LMDBTier(make_config(tmp_path / "db", num_chunks=4), SMALL_LAYOUT) as tier:
        assert await tier.put(chain, payloads(6)) == [True] * 4 + [False] * 2
        assert await tier.contains(chain) == [True] * 4 + [False] * 2
        assert tier.counters.declined == 2
        assert tier.usage().used_bytes == 4 * VALUE_BYTES


async def test_eviction_takes_the_deepest_chunks_of_the_oldest_chain(tmp_path: Path) -> None:
    old, new = keys(4), keys(2, seed=1)
    async with LMDBTier(make_config(tmp_path / "db", num_chunks=4), SMALL_LAYOUT) as tier:
        await tier.put(old, payloads(4))
        assert await tier.put(new, payloads(2)) == [True, True]
        assert await tier.contains(old) == [True, True, False, False]
        assert await tier.contains(new) == [True, True]
        assert tier.counters.evictions == 2
        assert tier.usage().num_entries == 4
        assert sorted(tier.take_evicted()) == sorted(old[2:])  # reported once
        assert tier.take_evicted() == []


@pytest.mark.parametrize("touch_old", [False, True])
async def test_a_touch_protects_from_eviction(tmp_path: Path, touch_old: bool) -> None:
    a, b, c = keys(2), keys(2, seed=1), keys(2, seed=2)
    async with LMDBTier(make_config(tmp_path / "db", num_chunks=4), SMALL_LAYOUT) as tier:
        await tier.put(a, payloads(2))
        await tier.put(b, payloads(2))
        if touch_old:
            tier.touch([*a, keys(1, seed=9)[0]])  # an unknown key is ignored
        await tier.put(c, payloads(2))  # records the touch, then evicts two
        assert await tier.contains(a) == [touch_old] * 2
        assert await tier.contains(b) == [not touch_old] * 2


@pytest.mark.parametrize("read_old", [False, True])
async def test_a_read_protects_from_eviction(tmp_path: Path, read_old: bool) -> None:
    a, b, c = keys(2), keys(2, seed=1), keys(2, seed=2)
    async with LMDBTier(make_config(tmp_path / "db", num_chunks=4), SMALL_LAYOUT) as tier:
        await tier.put(a, payloads(2))
        await tier.put(b, payloads(2))
        if read_old:
            assert await tier.get(a, payloads(2)) == [True, True]
        await tier.put(c, payloads(2))  # flushes the touch, then evicts two
        assert await tier.contains(a) == [read_old] * 2
        assert await tier.contains(b) == [not read_old] * 2


async def test_touches_are_flushed_on_close(tmp_path: Path) -> None:
    a, b, c = keys(2), keys(2, seed=1), keys(2, seed=2)
    path = tmp_path / "db"
    async with LMDBTier(make_config(path, num_chunks=4), SMALL_LAYOUT) as tier:
        await tier.put(a, payloads(2))
        await tier.put(b, payloads(2))
        await tier.get(a, payloads(2))
    async with LMDBTier(make_config(path, num_chunks=4), SMALL_LAYOUT) as tier:
        await tier.put(c, payloads(2))
        assert await tier.contains([*a, *b]) == [True, True, False, False]


async def test_full_map_evicts_more_and_retries(tmp_path: Path) -> None:
    # a map far smaller than the capacity: puts hit MapFullError long before the capacity
    config = make_config(tmp_path / "db", num_chunks=2000, map_size="1MiB")
    async with LMDBTier(config, SMALL_LAYOUT) as tier:
        for seed in range(8):
            ks = keys(50, seed=seed)
            assert await tier.put(ks, payloads(50, seed=seed)) == [True] * 50
        assert tier.counters.evictions > 0
        assert tier.counters.declined == 0
        usage = tier.usage()
        assert usage.used_bytes == usage.num_entries * VALUE_BYTES
        huge = keys(600, seed=99)  # more than the whole map holds: a prefix at most fits
        stored = await tier.put(huge, payloads(600))
        num = stored.count(True)
        assert stored == [True] * num + [False] * (600 - num) and num < 600
        assert tier.counters.declined == 600 - num
        assert await tier.contains(huge) == stored


# -- sizes kept beside recency: values are not read to learn they exist ---------------------

BIG = KVLayout(model="big", num_layers=4, num_kv_heads=8, head_size=128, dtype="float16")


async def test_contains_and_evictions_read_no_value(tmp_path: Path) -> None:
    from benchmarks.bench_lmdb import drop_page_cache, resident_fraction

    path, ks = tmp_path / "db", keys(8)
    srcs = [np.full(BIG.chunk_bytes, i, dtype=np.uint8) for i in range(8)]  # 4 MiB each
    options = {"path": str(path), "readahead": False}  # a fault reads its own page only
    config = TierConfig("lmdb", 6 * (BIG.chunk_bytes + 4096), options=options, index=2)
    async with LMDBTier(config, BIG) as tier:
        assert await tier.put(ks[:6], srcs[:6]) == [True] * 6
    data = path / "data.mdb"
    drop_page_cache([data])  # closed: no page is mapped, so all can go
    if resident_fraction([data]) > 0.02:
        pytest.skip("this filesystem keeps its pages in memory (tmpfs?)")
    async with LMDBTier(config, BIG) as tier:
        assert await tier.contains(ks) == [True] * 6 + [False] * 2
        assert resident_fraction([data]) < 0.02  # a few tree pages, no 4 MiB value
        assert await tier.put(ks[6:], srcs[6:]) == [True, True]  # evicts two cold values
        assert len(tier.take_evicted()) == 2
        assert tier.usage().used_bytes == 6 * value_bytes(BIG.fingerprint, BIG.chunk_bytes)
        resident = resident_fraction([data]) * data.stat().st_size
        assert resident < 2.5 * BIG.chunk_bytes  # the two new values, not the two evicted


async def test_entries_of_an_earlier_release_are_measured_from_their_values(
    tmp_path: Path,
) -> None:
    path, old, new = tmp_path / "db", keys(4), keys(2, seed=1)
    await put_and_close(path, old, payloads(4))
    env = lmdb.open(str(path), max_dbs=4)  # `seqs` as releases before sizes wrote it
    try:
        seqs = env.open_db(b"seqs")
        with env.begin(write=True, db=seqs) as txn:
            for key in old:
                txn.put(key, bytes(txn.get(key))[:8])
    finally:
        env.close()
    async with LMDBTier(make_config(path, num_chunks=4), SMALL_LAYOUT) as tier:
        assert await tier.contains(old) == [True] * 4
        assert await tier.put(new, payloads(2, seed=1)) == [True, True]
        assert await tier.contains(old) == [True, True, False, False]  # the recency kept
        assert tier.usage().used_bytes == 4 * VALUE_BYTES  # sizes measured, not guessed
        dsts = [np.zeros(SMALL_LAYOUT.chunk_bytes, dtype=np.uint8) for _ in range(2)]
        assert await tier.get(old[:2], dsts) == [True, True]
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads(4)[:2], strict=True))


# -- config and open errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"read_threads": 0}, "read_threads"),
        ({"read_threads": "4"}, "read_threads"),
        ({"read_threads": True}, "read_threads"),
        ({"max_readers": 0}, "max_readers"),
        ({"sync": "yes"}, "sync"),
        ({"map_size": "lots"}, "map_size"),
        ({"map_size": 4096}, "map_size"),
        ({"path": ""}, "path"),
        ({"path": 3}, "path"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_option_names_the_field(tmp_path: Path, options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^tiers\[2\]\.{field}: "):
        LMDBTier(make_config(tmp_path, **options), SMALL_LAYOUT)


def test_path_is_required() -> None:
    config = TierConfig("lmdb", 1 << 20, options={}, index=2)
    with pytest.raises(ConfigError, match=r"^tiers\[2\]\.path: required"):
        LMDBTier(config, SMALL_LAYOUT)


def test_eviction_other_than_lru_is_refused(tmp_path: Path) -> None:
    config = TierConfig("lmdb", 1 << 20, eviction="arc", options={"path": str(tmp_path)}, index=1)
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.eviction: .*least-recently-used"):
        LMDBTier(config, SMALL_LAYOUT)


def test_capacity_below_one_chunk_is_refused(tmp_path: Path) -> None:
    config = TierConfig("lmdb", VALUE_BYTES - 1, options={"path": str(tmp_path)}, index=3)
    with pytest.raises(ConfigError, match=r"^tiers\[3\]\.capacity: capacity too small for one"):
        LMDBTier(config, SMALL_LAYOUT)
    LMDBTier(make_config(tmp_path, num_chunks=1), SMALL_LAYOUT)  # exactly one fits


def test_options_and_default_map_size(tmp_path: Path) -> None:
    tier = LMDBTier(make_config(tmp_path, read_threads=2, sync=True), SMALL_LAYOUT)
    options = tier.options
    assert (options.read_threads, options.sync, options.max_readers) == (2, True, 256)
    assert tier.map_size % (1 << 20) == 0
    assert tier.map_size >= 64 * VALUE_BYTES + (64 << 20)
    assert LMDBTier(make_config(tmp_path, map_size="2GiB"), SMALL_LAYOUT).map_size == 2 << 30


@pytest.mark.parametrize("where", ["file", "under_file", "proc"])
async def test_unwritable_path_raises_tier_io_error(tmp_path: Path, where: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"in the way")
    path = {
        "file": blocker,
        "under_file": blocker / "db",
        "proc": Path("/proc/kvtiers-test/db"),
    }[where]
    tier = LMDBTier(make_config(path), SMALL_LAYOUT)
    with pytest.raises(TierIOError, match="cannot open lmdb at") as info:
        await tier.open()
    assert str(path) in str(info.value)
    await tier.close()


async def test_usage_outside_the_open_state_is_the_last_seen(tmp_path: Path) -> None:
    tier = LMDBTier(make_config(tmp_path / "db"), SMALL_LAYOUT)
    assert tier.usage().num_entries == 0  # not open yet: nothing seen
    async with tier:
        await tier.put([b"k" * 16], [np.zeros(SMALL_LAYOUT.chunk_bytes, np.uint8)])
        assert tier.usage().num_entries == 1
    assert tier.usage().num_entries == 1  # closed: as seen at close


async def test_same_path_twice_in_one_process_raises(tmp_path: Path) -> None:
    async with LMDBTier(make_config(tmp_path / "db"), SMALL_LAYOUT):
        with pytest.raises(TierIOError, match="already open"):
            await LMDBTier(make_config(tmp_path / "db"), SMALL_LAYOUT).open()


def _recency(batches: list[list[bytes]]) -> list[bytes]:
    """Keys from oldest to newest after touching `batches` in order, as `Writer.touch` does."""
    seq: dict[bytes, int] = {}
    base = 0
    for batch in batches:
        for i, key in enumerate(batch):
            seq[key] = base + len(batch) - 1 - i
        base += len(batch)
    return sorted(seq, key=seq.__getitem__)


@given(st.lists(st.lists(st.sampled_from([bytes([i]) * 16 for i in range(8)]), max_size=6)))
def test_dropping_earlier_touches_keeps_the_recency_order(batches: list[list[bytes]]) -> None:
    from kvtiers.tiers._lmdb_writes import last_touches

    kept = last_touches(batches)
    assert _recency(kept) == _recency(batches)
    assert sum(map(len, kept)) == len({key for batch in batches for key in batch})


DEAD_READER = textwrap.dedent(
    """
    import os, sys, time
    import lmdb
    env = lmdb.open(sys.argv[1], subdir=True, max_dbs=8, readonly=True, lock=True)
    txn = env.begin()  # a reader slot, pinning this snapshot
    open(sys.argv[2], "w").close()
    time.sleep(60)
    """
)


async def test_a_dead_reader_does_not_fill_the_map_of_a_long_running_tier(
    tmp_path: Path,
) -> None:
    """A process killed mid-read keeps its reader slot, pinning an old snapshot, so the
    pages freed by evictions since cannot be reused and the map fills up although the
    capacity holds. The tier frees dead readers' slots when that happens, and goes on
    storing at its full capacity (a real process, killed with SIGKILL)."""
    path, ready = tmp_path / "db", tmp_path / "ready"
    config = make_config(path, num_chunks=16, map_size="1MiB")
    async with LMDBTier(config, SMALL_LAYOUT) as tier:
        assert all(await tier.put(keys(16, seed=1), payloads(16)))
        child = subprocess.Popen([sys.executable, "-c", DEAD_READER, str(path), str(ready)])
        try:
            for _ in range(200):
                if ready.exists():
                    break
                await asyncio.sleep(0.05)
            assert ready.exists(), "the reader did not start"
        finally:
            child.kill()
            child.wait()
        limit = tier._limit
        for seed in range(2, 100):  # 16 chunks churned 49 times over
            assert all(await tier.put(keys(8, seed=seed), payloads(8, seed=seed)))
        assert tier._limit == limit  # the map never held less than the capacity
        assert not tier._health.map_was_full


# -- reads in parts ------------------------------------------------------------------------


@given(
    st.integers(0, 512),
    st.integers(1, 16 << 20),
    st.integers(1, 16),
)
def test_read_parts_keeps_small_values_together(num: int, value_bytes: int, most: int) -> None:
    parts = read_parts(num, value_bytes, most)
    assert 1 <= parts <= max(1, min(most, num))
    if value_bytes < SPLIT_MIN_VALUE:
        assert parts == 1
    if parts > 1:  # each part carries at least its share, and never less than 4 MiB
        assert num * value_bytes // parts >= part_bytes(value_bytes) >= SPLIT_PART_BYTES
    elif value_bytes >= SPLIT_MIN_VALUE and min(most, num) > 1:  # one part: too few bytes
        assert num * value_bytes < 2 * part_bytes(value_bytes)
    assert read_parts(num + 1, value_bytes, most) >= parts  # more values, never fewer parts


@given(st.integers(SPLIT_MIN_VALUE, 64 << 20), st.integers(1, 64 << 20))
def test_a_part_of_larger_values_may_be_smaller(value_bytes: int, more: int) -> None:
    assert part_bytes(value_bytes + more) <= part_bytes(value_bytes)


@pytest.mark.parametrize(
    ("num", "value_kib", "parts"),
    [(16, 256, 1), (128, 256, 1), (64, 320, 1), (96, 320, 2), (16, 384, 1), (64, 384, 2),
     (16, 512, 1), (32, 512, 2), (8, 768, 1), (16, 768, 2), (16, 4096, 2)],
)  # fmt: skip
def test_read_parts_at_the_measured_batches(num: int, value_kib: int, parts: int) -> None:
    # The batches `read_parts`' docstring quotes, on two cores.
    assert read_parts(num, value_kib << 10, 2) == parts


BIG = KVLayout(
    model="m", num_layers=2, num_kv_heads=4, head_size=64, dtype="float16", chunk_size=512
)
"""1 MiB chunks: a batch of nine is split in two parts."""


@pytest.mark.parametrize(("layout", "num", "parts"), [(SMALL_LAYOUT, 64, 1), (BIG, 9, 2)])
async def test_a_batch_is_read_in_parts_only_when_its_values_are_large(
    tmp_path: Path, layout: KVLayout, num: int, parts: int
) -> None:
    rng = np.random.default_rng(7)
    srcs = [rng.integers(0, 256, layout.chunk_bytes, dtype=np.uint8) for _ in range(num)]
    ks = keys(num)
    config = TierConfig("lmdb", 64 << 20, options={"path": str(tmp_path / "db")})
    async with LMDBTier(config, layout) as tier:
        assert all(await tier.put(ks[:-2] + ks[-1:], srcs[:-2] + srcs[-1:]))  # one missing
        tier._parts = 2  # as on two cores or more
        threads: list[int] = []
        read = tier._read

        def counted(*args: Any) -> list[bool]:
            threads.append(threading.get_ident())
            return read(*args)

        tier._read = counted  # type: ignore[method-assign]
        dsts = [np.zeros(layout.chunk_bytes, dtype=np.uint8) for _ in range(num)]
        assert await tier.get(ks, dsts) == [True] * (num - 2) + [False, True]
        assert len(threads) == parts
        assert all(np.array_equal(d, s) for d, s in zip(dsts[:-2], srcs[:-2], strict=True))
        assert np.array_equal(dsts[-1], srcs[-1]) and not dsts[-2].any()
        assert tier.counters.bytes_read == (num - 1) * layout.chunk_bytes


# -- reads of some layers ------------------------------------------------------------------


async def test_get_layers_checks_each_value_whole(tmp_path: Path) -> None:
    """py-lmdb reads a whole value anyway, so a read of some layers checks it whole: a
    corrupt byte in layer 1 makes a read of layer 0 a miss too, deleted and counted."""
    path, ks, srcs = tmp_path / "db", keys(2), payloads(2)
    await put_and_close(path, ks, srcs)
    step = SMALL_LAYOUT.layer_bytes
    rewrite_value(path, ks[0], flip_payload_byte)  # a byte of the last layer (layer 1)
    async with LMDBTier(make_config(path), SMALL_LAYOUT) as tier:
        assert not tier.layer_reads
        dsts = [np.zeros(SMALL_LAYOUT.chunk_bytes, dtype=np.uint8) for _ in range(2)]
        assert await tier.get_layers(ks, [0], dsts) == [False, True]
        assert not dsts[0].any()
        assert np.array_equal(dsts[1][:step], srcs[1][:step]) and not dsts[1][step:].any()
        assert tier.counters.corrupt == 1 and await tier.contains(ks) == [False, True]
        assert tier.counters.bytes_read == step  # one layer of one chunk delivered


async def test_values_with_layer_checksums_are_read_too(tmp_path: Path) -> None:
    """A value in the remote tier's form (a checksum per layer) reads like the tier's own."""
    path, ks, srcs = tmp_path / "db", keys(1), payloads(1)
    await put_and_close(path, ks, srcs)
    fingerprint, num_layers = SMALL_LAYOUT.fingerprint, SMALL_LAYOUT.num_layers
    rewrite_value(
        path, ks[0], lambda _: pack_value(fingerprint, ks[0], srcs[0].data, num_layers=num_layers)
    )
    async with LMDBTier(make_config(path), SMALL_LAYOUT) as tier:
        dst = np.zeros(SMALL_LAYOUT.chunk_bytes, dtype=np.uint8)
        assert await tier.get(ks, [dst]) == [True] and np.array_equal(dst, srcs[0])
        step, part = SMALL_LAYOUT.layer_bytes, np.zeros(SMALL_LAYOUT.chunk_bytes, np.uint8)
        assert await tier.get_layers(ks, [1], [part], tally=False) == [True]
        assert np.array_equal(part[step:], srcs[0][step:]) and not part[:step].any()
        assert tier.counters.hits == 1  # the second read did not count


# -- contains on the event loop ----------------------------------------------------------


async def test_a_contains_answers_on_the_loop_and_falls_back_to_the_pool(tmp_path: Path) -> None:
    # A small contains reads `seqs` on the loop; a large one, and one whose inline read
    # fails, go through the thread pool, with the same answers.
    async with LMDBTier(make_config(tmp_path / "db", num_chunks=256), SMALL_LAYOUT) as tier:
        ks = keys(100)
        assert await tier.put(ks[:50], payloads(50)) == [True] * 50
        want = [True] * 50 + [False] * 50
        pooled = []
        run = tier._run

        async def counting(jobs):
            pooled.append(len(jobs))
            return await run(jobs)

        tier._run = counting
        assert await tier.contains(ks[45:55]) == want[45:55]
        assert pooled == []  # answered on the loop
        assert await tier.contains(ks) == want
        assert pooled == [1]  # more keys than run inline
        begin = tier._gate.env.begin

        def failing_begin(**kwargs):
            raise lmdb.ReadersFullError("no reader slot")

        tier._gate.env = _EnvWith(tier._gate.env, begin=failing_begin)
        assert keys_present_now(tier._gate, tier._dbs.seqs, ks[:4]) is None
        tier._gate.env = tier._gate.env.inner
        assert tier._gate.env.begin == begin
        assert await tier.contains(ks[:4]) == [True] * 4
        assert pooled == [1]


class _EnvWith:
    """An lmdb environment with some methods replaced."""

    def __init__(self, inner: Any, **methods: Any) -> None:
        self.inner = inner
        self.__dict__.update(methods)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_contains_during_a_remap_waits_off_the_loop(tmp_path: Path) -> None:
    # A remap waits for every transaction of the process and holds new ones back: a
    # contains then waits in the thread pool, and the loop goes on meanwhile.
    async with LMDBTier(make_config(tmp_path / "db"), SMALL_LAYOUT) as tier:
        ks = keys(3)
        assert await tier.put(ks[:2], payloads(2)) == [True, True]
        started, release = threading.Event(), threading.Event()

        def remap() -> bool:
            started.set()
            release.wait(10)  # a guard: a blocked loop would stall the test this long
            return False

        remapper = threading.Thread(target=tier._gate._alone, args=(remap,))
        remapper.start()
        started.wait()
        try:
            answer = asyncio.ensure_future(tier.contains(ks))
            await asyncio.sleep(0.05)
            assert not answer.done()  # waiting in the pool, not on the loop
        finally:
            release.set()
        assert await answer == [True, True, False]
        await asyncio.to_thread(remapper.join)
