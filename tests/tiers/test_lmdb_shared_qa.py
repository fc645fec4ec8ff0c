"""The lmdb tier as a store shared by several processes of one node, and its edges.

Other processes are real ones (`subprocess`), on real LMDB files: writers at capacity side
by side, processes with other map sizes, layouts or chunk sizes, processes killed with
SIGKILL mid-write or mid-read, and programs that hold the path's files.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import CacheStateError, ConfigError, TierIOError
from kvtiers.core.layout import KVLayout
from kvtiers.testing.tiers import SMALL_LAYOUT
from kvtiers.tiers._lmdb_format import map_capacity, value_bytes
from kvtiers.tiers.lmdb import LMDBTier
from tests._mounts import tmpfs

lmdb = pytest.importorskip("lmdb")

REPO = Path(__file__).resolve().parents[2]
VALUE_BYTES = value_bytes(SMALL_LAYOUT.fingerprint, SMALL_LAYOUT.chunk_bytes)
# the same model with chunks of another size: another fingerprint, values twice as large
WIDE = dataclasses.replace(SMALL_LAYOUT, chunk_size=32)


def chunk_key(seed: object, i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{seed}:{i}".encode())


def expected(key: bytes, size: int = SMALL_LAYOUT.chunk_bytes) -> np.ndarray:
    """Return the payload stored under `key` by every writer of these tests."""
    rng = np.random.default_rng(np.frombuffer(key, np.uint32))
    return rng.integers(0, 256, size, dtype=np.uint8)


def config(path: Path, num_chunks: int, **options: Any) -> TierConfig:
    return TierConfig(
        "lmdb", num_chunks * VALUE_BYTES, options={"path": str(path), **options}, index=2
    )


# -- a writer in another process ------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, json, os, sys
    import numpy as np
    from kvtiers.core.config import TierConfig
    from kvtiers.core.layout import KVLayout
    from kvtiers.tiers.lmdb import LMDBTier
    from tests.tiers.test_lmdb_shared_qa import chunk_key, expected

    async def main(a):
        layout = KVLayout.from_dict(a["layout"])
        config = TierConfig("lmdb", a["capacity"], options=a["options"])
        size, batch = layout.chunk_bytes, a["batch"]
        out = {"declined": 0, "wrong": 0, "hits": 0, "raised": None}
        async with LMDBTier(config, layout) as tier:
            if a["ready"]:
                open(a["ready"], "w").close()
            while a["go"] and not os.path.exists(a["go"]):
                await asyncio.sleep(0.01)
            r = 0
            while a["rounds"] < 0 or r < a["rounds"]:
                ks = [chunk_key(a["seed"], r * batch + j) for j in range(batch)]
                stored = await tier.put(ks, [expected(k, size) for k in ks])
                out["declined"] += stored.count(False)
                # this batch and the one before, which other writers may have evicted
                back = ks + [chunk_key(a["seed"], (r - 1) * batch + j) for j in range(batch)]
                dsts = [np.empty(size, np.uint8) for _ in back]
                hits = await tier.get(back, dsts)
                out["hits"] += sum(hits)
                out["wrong"] += sum(
                    hit and not np.array_equal(d, expected(k, size))
                    for k, d, hit in zip(back, dsts, hits)
                )
                r += 1
            out["counters"] = {"corrupt": tier.counters.corrupt, "foreign": tier.counters.foreign}
            out["map_was_full"] = tier._health.map_was_full
        print(json.dumps(out))

    asyncio.run(main(json.loads(sys.argv[1])))
    """
)


def spawn_writer(
    path: Path,
    seed: object,
    *,
    num_chunks: int = 64,
    rounds: int = 10,
    batch: int = 8,
    layout: KVLayout = SMALL_LAYOUT,
    ready: Path | None = None,
    go: Path | None = None,
    **options: Any,
) -> subprocess.Popen[str]:
    """Start a process that stores `rounds` batches (forever if negative) and reads them back."""
    args = {
        "layout": dataclasses.asdict(layout),
        "capacity": num_chunks * value_bytes(layout.fingerprint, layout.chunk_bytes),
        "options": {"path": str(path), **options},
        "seed": str(seed),
        "rounds": rounds,
        "batch": batch,
        "ready": str(ready) if ready else None,
        "go": str(go) if go else None,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"writer exited with {proc.returncode}: {stderr[-3000:]}"
    result: dict[str, Any] = json.loads(stdout)
    return result


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    """Wait until `proc` creates `path`; fail if it exits first."""
    while not path.exists():
        if proc.poll() is not None:
            _, stderr = proc.communicate()
            pytest.fail(f"the process exited with {proc.returncode}: {stderr[-3000:]}")
        threading.Event().wait(0.02)


def start_script(script: str, path: Path, ready: Path) -> subprocess.Popen[str]:
    """Run `script` on `path` until its stdin closes; return once it creates `ready`."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(path), str(ready)],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(ready, proc)
    return proc


# -- reading the environment around the tier ------------------------------------------------

_U64 = struct.Struct(">Q")


def check_consistent(env: Any, limit: int) -> dict[bytes, int]:
    """Assert that sizes, recency and values agree; return each key's value size."""
    names = ("chunks", "lru", "seqs", "meta")
    dbs = {name: env.open_db(name.encode(), create=False) for name in names}
    with env.begin() as txn:
        sizes = {bytes(k): len(v) for k, v in txn.cursor(db=dbs["chunks"])}
        seqs = {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs["seqs"])}
        lru = [bytes(k) for k in txn.cursor(db=dbs["lru"]).iternext(values=False)]
        used = _U64.unpack(txn.get(b"used_bytes", db=dbs["meta"]))[0]
    assert set(seqs) == set(sizes), "seqs and chunks disagree"
    assert sorted(k[8:] for k in lru) == sorted(sizes), "lru and chunks disagree"
    assert {k: _U64.unpack(v[8:])[0] for k, v in seqs.items()} == sizes
    assert used == sum(sizes.values()) <= limit
    return sizes


def check_path(path: Path, limit: int) -> dict[bytes, int]:
    env = lmdb.open(str(path), max_dbs=4, readonly=True)
    try:
        return check_consistent(env, limit)
    finally:
        env.close()


# -- writers side by side ---------------------------------------------------------------------


async def test_writers_in_several_processes_stay_within_capacity_and_serve_their_bytes(
    tmp_path: Path,
) -> None:
    """Three processes and this one write at a capacity of 40 chunks at once: every batch
    goes in (evicting the others' chunks), every hit is the bytes stored under its key, and
    the sizes, recency and byte count stay consistent and within the capacity."""
    path, go = tmp_path / "db", tmp_path / "go"
    async with LMDBTier(config(path, 40), SMALL_LAYOUT) as tier:
        ready = [tmp_path / f"ready{n}" for n in range(3)]
        procs = [
            spawn_writer(path, n, num_chunks=40, rounds=60, ready=ready[n], go=go) for n in range(3)
        ]
        for flag, proc in zip(ready, procs, strict=True):
            wait_for(flag, proc)
        go.touch()  # all four write at once
        wrong = 0
        for r in range(60):
            ks = [chunk_key("parent", r * 8 + j) for j in range(8)]
            assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 8
            dsts = [np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in ks]
            hits = await tier.get(ks, dsts)
            wrong += sum(
                h and not np.array_equal(d, expected(k))
                for k, d, h in zip(ks, dsts, hits, strict=True)
            )
        results = [finish(p) for p in procs]
        assert wrong == 0 and tier.counters.corrupt == tier.counters.foreign == 0
        for result in results:
            assert result["declined"] == result["wrong"] == 0, result
            assert result["counters"] == {"corrupt": 0, "foreign": 0}
            assert not result["map_was_full"]
        assert tier.usage().used_bytes <= tier.capacity_bytes
        limit = tier.capacity_bytes
    sizes = check_path(path, limit)
    assert len(sizes) == 40  # full: each batch made room for itself


# -- map sizes that differ between processes --------------------------------------------------


async def test_a_process_with_a_larger_map_leaves_a_smaller_one_working(tmp_path: Path) -> None:
    """A process whose map is larger grows the data past this process's map: LMDB then
    fails every transaction here (MDB_MAP_RESIZED) until this process maps more."""
    path = tmp_path / "db"
    small = config(path, 16, map_size="2MiB")
    async with LMDBTier(small, SMALL_LAYOUT) as tier:
        ks = [chunk_key("small", i) for i in range(4)]
        assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 4
        # ~8 MiB of values into a 64 MiB map, past the 2 MiB of this process's
        big = spawn_writer(path, "big", num_chunks=4000, rounds=25, batch=80, map_size="64MiB")
        result = finish(big)
        assert result["declined"] == 0
        assert await tier.contains(ks) == [True] * 4
        dsts = [np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in ks]
        assert await tier.get(ks, dsts) == [True] * 4
        assert all(np.array_equal(d, expected(k)) for k, d in zip(ks, dsts, strict=True))
        assert tier.usage().num_entries == 2004
        new = [chunk_key("small", i) for i in range(4, 8)]
        assert await tier.put(new, [expected(k) for k in new]) == [True] * 4
        assert tier.usage().num_entries == 16  # evicted down to this process's capacity
        assert not tier._health.map_was_full
        limit = tier.capacity_bytes
    check_path(path, limit)


async def test_a_map_grown_under_concurrent_reads_and_writes(tmp_path: Path) -> None:
    """This process reads and writes from many tasks (its pool's threads in transactions)
    while another process with a larger map grows the data past this one's: it remaps
    only between transactions, and every call answers, with the right bytes."""
    path, go = tmp_path / "db", tmp_path / "go"
    async with LMDBTier(config(path, 32, map_size="2MiB", read_threads=4), SMALL_LAYOUT) as tier:
        own = [chunk_key("own", i) for i in range(8)]
        assert await tier.put(own, [expected(k) for k in own]) == [True] * 8
        big = spawn_writer(path, "big", num_chunks=8000, rounds=60, batch=80, go=go)
        go.touch()
        wrong = 0

        async def reader() -> None:
            nonlocal wrong
            while big.poll() is None:
                dsts = [np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in own]
                hits = await tier.get(own, dsts)
                wrong += sum(
                    h and not np.array_equal(d, expected(k))
                    for k, d, h in zip(own, dsts, hits, strict=True)
                )

        async def writer() -> None:
            # NOTE: write transactions that evict nothing: a put would evict the other
            # process's chunks down to this one's capacity, and the data would not grow.
            r = 0
            while big.poll() is None:
                await tier.delete([chunk_key("never stored", r)])
                tier.usage()
                r += 1

        await asyncio.gather(*(reader() for _ in range(6)), writer())
        assert finish(big)["declined"] == 0
        assert wrong == 0
        dsts = [np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in own]
        assert await tier.get(own, dsts) == [True] * 8  # the other process evicted none
        assert tier.usage().num_entries == 8 + 60 * 80
    check_path(path, 8000 * VALUE_BYTES)


async def test_a_map_smaller_than_the_file_still_has_room_to_write(tmp_path: Path) -> None:
    """A process that opens a file larger than its map (another process's larger map grew
    it) maps the file and its own map size past it, so its writes neither fail the map nor
    lower what it holds."""
    path = tmp_path / "db"
    finish(spawn_writer(path, "big", num_chunks=4000, rounds=25, batch=80, map_size="64MiB"))
    assert (path / "data.mdb").stat().st_size > 4 * 2**20
    async with LMDBTier(config(path, 16, map_size="2MiB"), SMALL_LAYOUT) as tier:
        for r in range(8):
            ks = [chunk_key("small", r * 4 + i) for i in range(4)]
            assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 4
        assert not tier._health.map_was_full
        assert tier.usage().num_entries == 16
        limit = tier.capacity_bytes
    check_path(path, limit)


HOLDER = textwrap.dedent(
    """
    import asyncio, json, os, sys
    import numpy as np
    from kvtiers.core.config import TierConfig
    from kvtiers.testing.tiers import SMALL_LAYOUT
    from tests.tiers.test_lmdb_shared_qa import chunk_key, expected
    from kvtiers.tiers.lmdb import LMDBTier

    async def main(path, ready, go):
        options = {"path": path, "writemap": True, "map_size": "16MiB"}
        async with LMDBTier(TierConfig("lmdb", 3000 * 2107, options=options), SMALL_LAYOUT) as t:
            open(ready, "w").close()
            while not os.path.exists(go):
                await asyncio.sleep(0.01)
            for r in range(30):  # ~7 MiB, far past the other process's 2 MiB map
                ks = [chunk_key("holder", r * 60 + j) for j in range(60)]
                assert all(await t.put(ks, [expected(k) for k in ks]))

    asyncio.run(main(*sys.argv[1:]))
    """
)


def test_writemap_with_a_smaller_map_never_cuts_the_file_of_another_process(
    tmp_path: Path,
) -> None:
    """With writemap LMDB sets the file's length to the map's: a process with a smaller
    map cut the file under a process that had it mapped larger, whose next write past the
    new end was a SIGBUS. Both processes here are children, so a SIGBUS fails the test
    instead of killing the test run."""
    path, ready, go = tmp_path / "db", tmp_path / "ready", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(ready), str(go)],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(ready, holder)
        size = (path / "data.mdb").stat().st_size
        small = spawn_writer(path, "small", num_chunks=16, rounds=2, writemap=True, map_size="2MiB")
        assert finish(small)["declined"] == 0
        assert (path / "data.mdb").stat().st_size == size  # not cut to 2 MiB
        go.touch()
        _, stderr = holder.communicate(timeout=120)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()
    assert holder.returncode == 0, f"exited with {holder.returncode} (SIGBUS is -7): {stderr}"


BIG = KVLayout(model="big", num_layers=4, num_kv_heads=8, head_size=128, dtype="float16")
BIG_VALUE = value_bytes(BIG.fingerprint, BIG.chunk_bytes)  # 4 MiB and a header


def test_a_map_too_small_for_one_chunk_is_refused_at_load(tmp_path: Path) -> None:
    options = {"path": str(tmp_path / "db"), "map_size": "4MiB"}
    with pytest.raises(ConfigError, match=r"tiers\[2\]\.map_size: .* holds no chunk"):
        LMDBTier(TierConfig("lmdb", 4 * BIG_VALUE, options=options, index=2), BIG)
    LMDBTier(TierConfig("lmdb", 4 * BIG_VALUE, options={**options, "map_size": "16MiB"}), BIG)


@pytest.mark.parametrize("writemap", [False, True])
async def test_the_smallest_map_taken_keeps_taking_chunks(tmp_path: Path, writemap: bool) -> None:
    """A map just large enough for one chunk by the tier's estimate (copy-on-write needs
    more): each put goes in, evicting the one before."""
    size = next(m for m in range(1, 64) if map_capacity(m * 2**20, BIG_VALUE) >= BIG_VALUE)
    options = {"path": str(tmp_path / "db"), "map_size": f"{size}MiB", "writemap": writemap}
    async with LMDBTier(TierConfig("lmdb", 8 * BIG_VALUE, options=options), BIG) as tier:
        for i in range(6):
            key = chunk_key("one", i)
            assert await tier.put([key], [expected(key, BIG.chunk_bytes)]) == [True]
        dst = np.empty(BIG.chunk_bytes, np.uint8)
        assert await tier.get([key], [dst]) == [True]
        assert np.array_equal(dst, expected(key, BIG.chunk_bytes))
        assert tier.usage().num_entries == 1


# -- reader slots -----------------------------------------------------------------------------

READER = textwrap.dedent(
    """
    import sys, time
    import lmdb
    env = lmdb.open(sys.argv[1], subdir=True, max_dbs=4, max_readers=4)
    txn = env.begin()  # a reader slot, held until the process ends
    open(sys.argv[2], "w").close()
    time.sleep(120)
    """
)


def hold_reader_slots(path: Path, tmp_path: Path, num: int) -> list[subprocess.Popen[str]]:
    procs = []
    for i in range(num):
        ready = tmp_path / f"reader{i}"
        proc = subprocess.Popen(
            [sys.executable, "-c", READER, str(path), str(ready)],
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        wait_for(ready, proc)
    return procs


async def test_reader_slots_of_killed_processes_are_freed_when_reads_need_them(
    tmp_path: Path,
) -> None:
    """Processes killed mid-read keep their reader slots; once they hold them all, every
    read failed (MDB_READERS_FULL) until the path was opened again. Live readers holding
    every slot are a typed error, and reads work again once slots free."""
    path = tmp_path / "db"
    ks = [chunk_key("r", i) for i in range(4)]
    async with LMDBTier(config(path, 16, max_readers=4), SMALL_LAYOUT) as tier:
        assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 4
        assert tier.usage().num_entries == 4
        readers = hold_reader_slots(path, tmp_path, 4)
        try:
            with pytest.raises(TierIOError, match="MDB_READERS_FULL"):
                await tier.contains(ks)
            assert tier.usage().num_entries == 4  # as last seen, not an exception
        finally:
            for proc in readers:
                proc.send_signal(signal.SIGKILL)
                proc.communicate()
        assert await tier.contains(ks) == [True] * 4
        dsts = [np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in ks]
        assert await tier.get(ks, dsts) == [True] * 4
        assert all(np.array_equal(d, expected(k)) for k, d in zip(ks, dsts, strict=True))


LONG_READER = textwrap.dedent(
    """
    import sys
    import lmdb
    env = lmdb.open(sys.argv[1], subdir=True, max_dbs=4)
    txn = env.begin()  # pins this snapshot's pages until stdin closes
    open(sys.argv[2], "w").close()
    sys.stdin.read()
    """
)


async def test_a_long_read_in_another_process_neither_empties_nor_shrinks_the_tier(
    tmp_path: Path,
) -> None:
    """A live reader (a slow `inspect`, say) pins its snapshot, so LMDB reuses no page
    freed since and the map fills whatever the tier evicts. The tier took that for a map
    too small for its capacity: it evicted everything, and lowered what it holds for good,
    down to one chunk. It now declines writes while the reader lives, and then goes on at
    its full capacity."""
    path, ready = tmp_path / "db", tmp_path / "ready"
    async with LMDBTier(config(path, 16, map_size="1MiB"), SMALL_LAYOUT) as tier:
        limit = tier._limit
        reader = start_script(LONG_READER, path, ready)
        try:
            for r in range(150):  # ~2.5 MiB of values through a 1 MiB map
                ks = [chunk_key("pinned", r * 8 + j) for j in range(8)]
                await tier.put(ks, [expected(k) for k in ks])  # never raises
            assert tier.counters.declined > 0  # the map did fill up
            assert tier.usage().num_entries == 16  # nothing evicted for nothing
        finally:
            reader.communicate("")
        for r in range(20):
            ks = [chunk_key("after", r * 8 + j) for j in range(8)]
            assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 8
        assert tier._limit == limit
        assert tier.usage().num_entries == 16
        limit = tier.capacity_bytes
    check_path(path, limit)


WRITE_HOLDER = textwrap.dedent(
    """
    import sys, time
    import lmdb
    env = lmdb.open(sys.argv[1], subdir=True, max_dbs=4)
    txn = env.begin(write=True)  # LMDB's writer lock, held until the process ends
    txn.put(b"stray", b"never committed")
    open(sys.argv[2], "w").close()
    sys.stdin.read()
    """
)


async def test_a_write_held_open_by_another_process_blocks_no_read(tmp_path: Path) -> None:
    """Readers never wait for the writer lock; a put waits for it, and a holder killed
    mid-transaction loses only its own uncommitted write."""
    path, ready = tmp_path / "db", tmp_path / "ready"
    ks = [chunk_key("w", i) for i in range(4)]
    async with LMDBTier(config(path, 16), SMALL_LAYOUT) as tier:
        assert await tier.put(ks[:2], [expected(k) for k in ks[:2]]) == [True] * 2
        holder = start_script(WRITE_HOLDER, path, ready)
        try:
            dsts = [np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in ks]
            assert await tier.get(ks, dsts) == [True, True, False, False]
            assert await tier.contains(ks) == [True, True, False, False]
            put = asyncio.ensure_future(tier.put(ks[2:], [expected(k) for k in ks[2:]]))
            await asyncio.sleep(0.2)
            assert not put.done()  # waiting for the writer lock
        finally:
            holder.kill()  # dies holding LMDB's writer lock
            holder.communicate()
        assert await put == [True, True]
        assert await tier.contains(ks) == [True] * 4
        limit = tier.capacity_bytes
    check_path(path, limit)


# -- processes killed mid-write ---------------------------------------------------------------


@pytest.mark.slow
async def test_writers_killed_mid_write_leave_the_path_working_for_the_others(
    tmp_path: Path,
) -> None:
    """Writers at capacity (so each write evicts) are killed with SIGKILL, most likely in a
    write transaction, while this process keeps writing and reading the same path."""
    path = tmp_path / "db"
    done = 0
    async with LMDBTier(config(path, 32), SMALL_LAYOUT) as tier:
        for trial in range(4):
            ready = tmp_path / f"ready{trial}"
            writer = spawn_writer(path, f"killed{trial}", num_chunks=32, rounds=-1, ready=ready)
            wait_for(ready, writer)
            for r in range(20):  # both write while the writer lives
                ks = [chunk_key(f"survivor{trial}", r * 4 + j) for j in range(4)]
                assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 4
            writer.send_signal(signal.SIGKILL)
            writer.communicate()
            ks = [chunk_key(f"after{trial}", j) for j in range(8)]
            assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 8
            found = list(check_consistent(tier._gate.env, tier.capacity_bytes))  # type: ignore[union-attr]
            dsts = [np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in found]
            hits = await tier.get(found, dsts)
            assert hits == [True] * len(found)
            assert all(np.array_equal(d, expected(k)) for k, d in zip(found, dsts, strict=True))
            done += len(found)
        assert tier.counters.corrupt == 0
    # a new process opens the path and goes on
    assert finish(spawn_writer(path, "new", num_chunks=32, rounds=4))["declined"] == 0
    check_path(path, 32 * VALUE_BYTES)
    assert done > 0


# -- other layouts and other files at the path ------------------------------------------------


async def test_another_chunk_size_on_the_path_is_never_served_and_counted_by_size(
    tmp_path: Path,
) -> None:
    """A process with another chunk size shares the path: neither serves the other's
    values, even under the same keys, and the byte count holds both sizes."""
    path = tmp_path / "db"
    wide_bytes = value_bytes(WIDE.fingerprint, WIDE.chunk_bytes)
    async with LMDBTier(config(path, 64), SMALL_LAYOUT) as tier:
        ks = [chunk_key("narrow", i) for i in range(8)]
        assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 8
        # the wide process stores its own chunks under its own keys
        wide = finish(spawn_writer(path, "wide", num_chunks=16, rounds=2, batch=4, layout=WIDE))
        assert wide["declined"] == wide["wrong"] == 0
        assert tier.usage().used_bytes == 8 * VALUE_BYTES + 8 * wide_bytes
        wide_keys = [chunk_key("wide", i) for i in range(8)]
        dsts = [np.full(SMALL_LAYOUT.chunk_bytes, 7, np.uint8) for _ in wide_keys]
        assert await tier.get(wide_keys, dsts) == [False] * 8
        assert all((d == 7).all() for d in dsts)  # nothing written into the buffers
        assert tier.counters.foreign == 8
        assert await tier.contains(ks) == [True] * 8  # its own chunks untouched
        limit = tier.capacity_bytes
    check_path(path, limit)


@pytest.mark.parametrize("writemap", [False, True])
def test_processes_opening_a_new_path_at_once(tmp_path: Path, writemap: bool) -> None:
    """Four processes create one path's environment, databases and records at once."""
    path = tmp_path / "db"
    procs = [
        spawn_writer(path, n, num_chunks=64, rounds=4, batch=4, writemap=writemap) for n in range(4)
    ]
    for result in map(finish, procs):
        assert result["declined"] == result["wrong"] == 0
    assert len(check_path(path, 64 * VALUE_BYTES)) == 64


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Iterator[Path]:
    """Yield a tmpfs folder that `remount_read_only` turns read-only; skip without mount."""
    with tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


async def test_a_store_on_a_read_only_file_system_is_a_typed_error(read_only_disk: Path) -> None:
    """LMDB writes its lock file even to read, so a store on a file system remounted
    read-only (a real one) cannot be opened: a `TierIOError`, and the store unchanged."""
    path = read_only_disk / "db"
    ks = [chunk_key("ro", i) for i in range(4)]
    async with LMDBTier(config(path, 16), SMALL_LAYOUT) as tier:
        assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 4
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_disk)], check=True)
    before = (path / "data.mdb").read_bytes()
    for where in (path, read_only_disk / "new"):
        with pytest.raises(TierIOError, match="Read-only file system"):
            await LMDBTier(config(where, 16), SMALL_LAYOUT).open()
    assert (path / "data.mdb").read_bytes() == before


async def test_a_file_that_is_not_lmdb_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "db"
    path.mkdir()
    junk = np.random.default_rng(0).bytes(3 * 4096)
    (path / "data.mdb").write_bytes(junk)
    with pytest.raises(TierIOError, match="MDB_INVALID"):
        await LMDBTier(config(path, 16), SMALL_LAYOUT).open()
    assert (path / "data.mdb").read_bytes() == junk


# -- one process --------------------------------------------------------------------------------


async def test_a_capacity_of_exactly_one_chunk(tmp_path: Path) -> None:
    ks = [chunk_key("one", i) for i in range(3)]
    async with LMDBTier(config(tmp_path / "db", 1), SMALL_LAYOUT) as tier:
        assert await tier.put(ks[:2], [expected(k) for k in ks[:2]]) == [True, False]
        assert await tier.put(ks[2:], [expected(ks[2])]) == [True]
        assert await tier.contains(ks) == [False, False, True]
        assert tier.usage().used_bytes == VALUE_BYTES
        dst = np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8)
        assert await tier.get(ks[2:], [dst]) == [True]
        assert np.array_equal(dst, expected(ks[2]))


@pytest.mark.parametrize("sync", [False, True])
async def test_sync_on_or_off_keeps_what_was_stored(tmp_path: Path, sync: bool) -> None:
    ks = [chunk_key("sync", i) for i in range(6)]
    async with LMDBTier(config(tmp_path / "db", 16, sync=sync), SMALL_LAYOUT) as tier:
        assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 6
    result = finish(spawn_writer(tmp_path / "db", "other", num_chunks=16, rounds=1, sync=sync))
    assert result["declined"] == 0
    async with LMDBTier(config(tmp_path / "db", 16, sync=not sync), SMALL_LAYOUT) as tier:
        dsts = [np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in ks]
        assert await tier.get(ks, dsts) == [True] * 6
        assert all(np.array_equal(d, expected(k)) for k, d in zip(ks, dsts, strict=True))


async def test_close_while_reads_are_in_flight(tmp_path: Path) -> None:
    """Reads started before a close finish whole or not at all; later calls are refused;
    `usage` from another thread during the close never fails."""
    ks = [chunk_key("close", i) for i in range(64)]
    tier = LMDBTier(config(tmp_path / "db", 64, read_threads=4), SMALL_LAYOUT)
    await tier.open()
    assert await tier.put(ks, [expected(k) for k in ks]) == [True] * 64
    stop = threading.Event()
    usages: list[int] = []

    def poll_usage() -> None:
        while not stop.is_set():
            usages.append(tier.usage().num_entries)

    poller = threading.Thread(target=poll_usage)
    poller.start()
    try:
        dsts = [[np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in ks] for _ in range(16)]
        reads = [asyncio.ensure_future(tier.get(ks, d)) for d in dsts]
        await asyncio.sleep(0)
        await tier.close()
        results = await asyncio.gather(*reads, return_exceptions=True)
    finally:
        stop.set()
        poller.join()
    for result, bufs in zip(results, dsts, strict=True):
        if isinstance(result, BaseException):
            assert isinstance(result, CacheStateError), result
        else:
            assert result == [True] * 64
            assert all(np.array_equal(d, expected(k)) for k, d in zip(ks, bufs, strict=True))
    assert set(usages) <= {64}
    with pytest.raises(CacheStateError):
        await tier.get(ks[:1], dsts[0][:1])
    assert tier.usage().num_entries == 64


def test_threads_with_their_own_event_loops_share_one_tier(tmp_path: Path) -> None:
    """Eight threads, each with its own event loop, put and get through one open tier at
    its capacity: every hit is the bytes of its key, and the accounting holds."""
    tier = LMDBTier(config(tmp_path / "db", 48, read_threads=4), SMALL_LAYOUT)
    asyncio.run(tier.open())
    errors: list[BaseException] = []
    wrong = [0]

    async def work(n: int) -> None:
        for r in range(20):
            ks = [chunk_key(f"t{n}", r * 4 + j) for j in range(4)]
            shared = [chunk_key("shared", (r + j) % 12) for j in range(4)]
            await tier.put(ks + shared, [expected(k) for k in ks + shared])
            dsts = [np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in range(8)]
            hits = await tier.get(ks + shared, dsts)
            wrong[0] += sum(
                h and not np.array_equal(d, expected(k))
                for k, d, h in zip(ks + shared, dsts, hits, strict=True)
            )

    def run(n: int) -> None:
        try:
            asyncio.run(work(n))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == [] and wrong == [0]
        check_consistent(tier._gate.env, tier.capacity_bytes)  # type: ignore[union-attr]
        assert tier.usage().used_bytes <= tier.capacity_bytes
    finally:
        asyncio.run(tier.close())
