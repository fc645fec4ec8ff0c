"""An LMDB store that fails under `kvtiers inspect`, `purge` and `bench`: exit status 1.

A path that is no store is a bad argument (exit status 2); a store that is there but
cannot be read or changed is a store failure (exit status 1), told in one line that names
the path and the cause. Each condition is real where it can be: other processes fill the
reader table, another cache grows the map, data.mdb is damaged or cut short, lock.mdb
cannot be opened. Where a test arranges only the timing of a real error, or simulates
one, its docstring says so. Files the user may not open: `test_cli_permissions.py`.

After a failure the tests check that the command left no reader slot (a slot pins its
snapshot's pages for every writer) and changed nothing in the store.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvtiers import _inspect
from kvtiers.cli import main
from tests._cli_errors import one_line_error
from tests.test_cli_live import (
    HANG_GUARD_S,
    KVTIERS,
    cli_json,
    digest,
    fill,
    fingerprint,
    lmdb_config,
    write_toml,
)

lmdb = pytest.importorskip("lmdb")


# Every command that reads an LMDB path; "{fp}" stands for the stored layout's fingerprint.
READS = [
    ["inspect"],
    ["inspect", "--verify", "--json"],
    ["purge", "--bad"],
    ["purge", "--fingerprint", "{fp}", "--json"],
]

# Holds every free slot of a path's reader table, whatever its size; on each line read,
# prints the pids in the table as LMDB lists them.
HOLD_READERS = r"""
import json, sys

import lmdb

env = lmdb.open(sys.argv[1], max_dbs=4, readonly=True, map_size=0)
held = []
while True:
    try:
        held.append(env.begin())
    except lmdb.ReadersFullError:
        break
print(len(held), flush=True)
for _ in sys.stdin:
    print(json.dumps([row.split()[0] for row in env.readers().splitlines()[1:]]), flush=True)
"""

# A cache of the same layout with a larger map (argv: config as JSON, prompts to store).
GROW = r"""
import asyncio, json, sys

import torch

from kvtiers import KVLayout, TieredCache

config, num_prompts = json.loads(sys.argv[1]), int(sys.argv[2])
layout = KVLayout(**config["layout"])


async def grow():
    async with TieredCache.from_config(config) as cache:
        for p in range(num_prompts):
            tokens = [p * 100_000 + j for j in range(16 * layout.chunk_size)]
            kv = torch.zeros(layout.kv_shape(len(tokens)), dtype=torch.float16)
            await cache.store(tokens, kv)


asyncio.run(grow())
"""


def stored(tmp_path: Path, **options: Any) -> Path:
    """Return the path of an LMDB tier holding 4 chunks; no process has it open."""
    asyncio.run(fill(lmdb_config(tmp_path, **options), 4))
    return tmp_path / "lmdb"


def run_here(argv: list[str], target: Path | str) -> int:
    """Run `kvtiers COMMAND TARGET FLAGS` in this process; return its exit status."""
    command, *flags = (arg.format(fp=fingerprint()[:8]) for arg in argv)
    return main([command, str(target), *flags])


def reader_pids(path: Path) -> set[str]:
    """Return the pids in the reader table at `path` (opening it here, so none of ours
    may be open: py-lmdb refuses a second open in one process)."""
    env = lmdb.open(str(path), max_dbs=4, readonly=True, map_size=0)
    try:
        return {row.split()[0] for row in env.readers().splitlines()[1:]}
    finally:
        env.close()


class ReaderHog:
    """Another process holding every slot of a path's reader table."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_READERS, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.slots = int(self.proc.stdout.readline())  # type: ignore[union-attr]

    def reader_pids(self) -> set[str]:
        """Return the pids in the table, as read by the hog (no slot is free for us)."""
        self.proc.stdin.write("readers\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return set(json.loads(self.proc.stdout.readline()))  # type: ignore[union-attr]


@contextmanager
def reader_hog(path: Path) -> Iterator[ReaderHog]:
    hog = ReaderHog(path)
    try:
        yield hog
    finally:
        hog.proc.stdin.close()  # type: ignore[union-attr]
        hog.proc.wait(timeout=HANG_GUARD_S)
        hog.proc.stdout.close()  # type: ignore[union-attr]


def assert_left_as_it_was(path: Path, before: tuple[int, str], capsys: Any) -> None:
    """No reader slot left, data.mdb unchanged, and the store reads again."""
    assert reader_pids(path) == set()
    assert digest(path / "data.mdb") == before
    code, doc = cli_json(capsys, "inspect", str(path), "--verify")
    assert (code, doc["checked"], doc["bad"]) == (0, 4, [])


# -- LMDB: the reader table, the map, a slot ----------------------------------------------


@pytest.mark.parametrize("argv", READS)
def test_a_full_reader_table_exits_1_and_the_command_keeps_no_slot(tmp_path, capsys, argv):
    """Real: another process holds every slot of the reader table. The command fails at
    its open (status 1 before too, under py-lmdb's advice to raise a parameter the command
    line does not have); it must say so, keep no slot of its own, and change nothing."""
    path = stored(tmp_path)
    before = digest(path / "data.mdb")
    with reader_hog(path) as hog:
        assert hog.slots > 0
        line = one_line_error(capsys, run_here(argv, path), status=1)
        assert line.startswith(f"kvtiers {argv[0]}: TierIOError: {path}: cannot open"), line
        assert "its reader table is full (MDB_READERS_FULL)" in line
        assert "max_readers" in line
        assert hog.reader_pids() == {str(hog.proc.pid)}
    assert_left_as_it_was(path, before, capsys)


@pytest.mark.parametrize("argv", [["inspect", "--verify"], ["purge", "--bad", "--json"]])
def test_a_map_grown_by_another_cache_before_the_first_read_exits_1(
    tmp_path, capsys, monkeypatch, argv
):
    """Real LMDB error, arranged timing: another cache, configured with a larger map,
    stores past the map the command opened with, after its open and before its first
    read (a window of microseconds in the wild; the reads after it share one transaction,
    whose snapshot stays valid). Before, MDB_MAP_RESIZED exited 2, as a bad argument."""
    path = stored(tmp_path, map_size="1MiB")
    bigger = lmdb_config(tmp_path, map_size="16MiB", capacity=1000 * (2048 + 256))
    opened = _inspect.open_lmdb

    def open_then_grow(where: Path, *, readonly: bool) -> Any:
        env = opened(where, readonly=readonly)
        grow = [sys.executable, "-c", GROW, json.dumps(bigger), "40"]  # 640 chunks: 2.5 MiB
        subprocess.run(grow, check=True, timeout=HANG_GUARD_S)
        return env

    monkeypatch.setattr(_inspect, "open_lmdb", open_then_grow)
    line = one_line_error(capsys, run_here(argv, path), status=1)
    assert line.startswith(f"kvtiers {argv[0]}: TierIOError: {path}: cannot read"), line
    assert "another process grew its map meanwhile (MDB_MAP_RESIZED); run the command again" in line
    monkeypatch.undo()
    assert reader_pids(path) == set()
    code, doc = cli_json(capsys, "inspect", str(path))  # run again, it reads the grown store
    assert code == 0 and doc["namespaces"][0]["entries"] > 4


class _RefusingEnv:
    """An open environment whose reads LMDB refuses with MDB_BAD_RSLOT."""

    def __init__(self, env: Any) -> None:
        self.env = env

    def open_db(self, *args: Any, **kwargs: Any) -> Any:
        raise lmdb.BadRslotError(
            "mdb_txn_begin: MDB_BAD_RSLOT: Invalid reuse of reader locktable slot"
        )

    def close(self) -> None:
        self.env.close()


@pytest.mark.parametrize("argv", [["inspect"], ["purge", "--fingerprint", "{fp}"]])
def test_a_refused_reader_slot_exits_1(tmp_path, capsys, monkeypatch, argv):
    """Simulated: LMDB answers MDB_BAD_RSLOT when a thread reuses its reader slot wrongly,
    which py-lmdb's MDB_NOTLS transactions never do, so no other process can provoke it;
    the opened environment raises it at the first read instead. Before, status 2."""
    path = stored(tmp_path)
    before = digest(path / "data.mdb")
    opened = _inspect.open_lmdb
    monkeypatch.setattr(
        _inspect,
        "open_lmdb",
        lambda where, *, readonly: _RefusingEnv(opened(where, readonly=readonly)),
    )
    line = one_line_error(capsys, run_here(argv, path), status=1)
    assert f"TierIOError: {path}: cannot read the LMDB environment: LMDB refused" in line
    assert "(MDB_BAD_RSLOT); run the command again" in line
    monkeypatch.undo()
    assert_left_as_it_was(path, before, capsys)


# -- LMDB: a damaged or short data.mdb ----------------------------------------------------


def damage_chunks_root(path: Path) -> None:
    """Clear the page flags of the `chunks` database's root page: neither branch nor leaf."""
    env = lmdb.open(str(path), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            record = txn.get(b"chunks")  # the database's MDB_db record; md_root comes last
        page_size = env.stat()["psize"]
    finally:
        env.close()
    root = int.from_bytes(record[40:48], "little")
    with open(path / "data.mdb", "r+b") as data:
        data.seek(root * page_size + 10)  # mp_pgno (8), mp_pad (2), then mp_flags (2)
        data.write(b"\0\0")


@pytest.mark.parametrize("argv", READS)
def test_a_damaged_data_mdb_exits_1(tmp_path, capsys, argv):
    """Real: a page of the chunks database is damaged on disk (LMDB finds a page of the
    wrong type, MDB_CORRUPTED). Before, status 2, as if the path were a bad argument."""
    path = stored(tmp_path)
    damage_chunks_root(path)
    before = digest(path / "data.mdb")
    line = one_line_error(capsys, run_here(argv, path), status=1)
    assert f"TierIOError: {path}: cannot read the LMDB environment: data.mdb is damaged" in line
    assert "MDB_CORRUPTED" in line
    assert reader_pids(path) == set()
    assert digest(path / "data.mdb") == before


@pytest.mark.parametrize("argv", [["inspect", "--verify"], ["purge", "--bad"]])
def test_a_data_mdb_cut_short_exits_1_instead_of_a_bus_error(tmp_path, argv):
    """Real: data.mdb ends before its last page (a copy cut short). Before, the first read
    past its end killed the command with SIGBUS (status 135 in a shell); the real
    `kvtiers` runs here, so such a death fails this test instead of the test run."""
    path = stored(tmp_path)
    os.truncate(path / "data.mdb", 3 * 4096)  # the two meta pages and one more
    before = digest(path / "data.mdb")
    done = subprocess.run(
        [KVTIERS, argv[0], str(path), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 1, done
    [line] = done.stderr.splitlines()
    assert line.startswith(f"kvtiers {argv[0]}: TierIOError: {path}: cannot open"), line
    assert "shorter than its" in line and "bytes of pages (truncated?)" in line
    assert reader_pids(path) == set()
    assert digest(path / "data.mdb") == before


# -- LMDB: what is no kvtiers store stays a bad argument -----------------------------------


@pytest.mark.parametrize("chunks", ["absent", "a plain key"])
@pytest.mark.parametrize("argv", READS)
def test_an_lmdb_environment_of_another_program_exits_2(tmp_path, capsys, argv, chunks):
    """Real: an LMDB environment without kvtiers' `chunks` database is a bad argument."""
    path = tmp_path / "other"
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"chunks" if chunks == "a plain key" else b"other", b"value")
    env.close()
    before = digest(path / "data.mdb")
    line = one_line_error(capsys, run_here(argv, path), status=2)
    assert f"{path}: an LMDB environment without kvtiers' databases (no 'chunks')" in line
    assert digest(path / "data.mdb") == before


def test_a_path_with_a_nul_byte_is_a_bad_argument(capsys):
    line = one_line_error(capsys, main(["inspect", "/tmp/a\0b"]), status=2)
    assert "not an LMDB environment" in line


# -- a lock file LMDB cannot open ------------------------------------------------------------


def test_a_lock_file_that_is_a_folder_exits_1(tmp_path, capsys):
    """Real: LMDB cannot open lock.mdb (here a folder stands in its place)."""
    path = stored(tmp_path)
    (path / "lock.mdb").unlink()
    (path / "lock.mdb").mkdir()
    before = digest(path / "data.mdb")
    for argv in READS:
        line = one_line_error(capsys, run_here(argv, path), status=1)
        assert (
            f"TierIOError: {path}: cannot open the LMDB environment: lock.mdb: Is a directory"
            in line
        )
    assert digest(path / "data.mdb") == before


# -- bench -----------------------------------------------------------------------------------


def test_bench_on_a_full_reader_table_fails_the_tier_and_keeps_no_slot(tmp_path, capsys):
    """Real: another process holds every slot; the bench's lmdb tier cannot open."""
    path = stored(tmp_path)
    before = digest(path / "data.mdb")
    toml = write_toml(tmp_path / "tiers.toml", lmdb_config(tmp_path))
    with reader_hog(path) as hog:
        code, doc = cli_json(capsys, "bench", str(toml), "--chunks", "2")
        assert code == 1
        [tier] = doc["tiers"]
        assert tier["status"] == "failed" and "MDB_READERS_FULL" in tier["reason"], tier
        assert hog.reader_pids() == {str(hog.proc.pid)}
    assert_left_as_it_was(path, before, capsys)
