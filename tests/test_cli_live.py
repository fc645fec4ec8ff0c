"""`kvtiers inspect`, `purge`, `remote` and `bench` on stores that a live cache uses.

An operator runs these on a serving node while the engines keep going. A second process
(`LIVE_CACHE`) stores and loads prompts in a loop through a `TieredCache` on the same LMDB
path or `file://` pool, and compares every load bit for bit with the KV it stored (derived
from the prompt's tokens), while the commands run here. The commands run in this process
through `main` (as the command line runs them), a few as real `kvtiers` processes.

No timing is asserted: loops are bounded by counts, waits only guard against hangs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtiers import KVLayout, TieredCache
from kvtiers.cli import main
from tests._cli_errors import one_line_error
from tests.conftest import SMALL_LAYOUT, make_kv, same_bytes, small_layout

lmdb = pytest.importorskip("lmdb")

HANG_GUARD_S = 120.0
"""How long a wait may last before the test fails as hung (never reached when healthy)."""

KVTIERS = str(Path(sys.executable).with_name("kvtiers"))

# The live cache. argv: config (JSON), status file, control folder. It stores a prompt on
# a miss and loads what lookup finds, checking each load against the prompt's own KV; a
# file `pause` in the control folder parks it (it answers with `paused`), `stop` ends it.
LIVE_CACHE = r"""
import asyncio, json, os, random, sys, time

import torch

from kvtiers import KVLayout, TieredCache

config, status_path, control = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
layout = KVLayout(**config["layout"])
NUM_PROMPTS, NUM_TOKENS = int(sys.argv[4]), 4 * layout.chunk_size


def prompt(p):
    tokens = [p * 100_000 + j for j in range(NUM_TOKENS)]
    gen = torch.Generator().manual_seed(p)  # the KV follows from the tokens
    shape = (*layout.kv_shape(NUM_TOKENS)[:-1], layout.head_size * layout.itemsize)
    kv = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return tokens, kv.view(getattr(torch, layout.dtype))


def same(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def save(status):
    with open(status_path + ".tmp", "w") as f:
        json.dump(status, f)
    os.replace(status_path + ".tmp", status_path)


async def main():
    prompts = [prompt(p) for p in range(NUM_PROMPTS)]
    status = {"ops": 0, "stores": 0, "loads": 0, "wrong": 0, "errors": []}
    rng = random.Random(0)
    async with TieredCache.from_config(config) as cache:
        save(status)
        while not os.path.exists(os.path.join(control, "stop")):
            if os.path.exists(os.path.join(control, "pause")):
                open(os.path.join(control, "paused"), "w").close()
                time.sleep(0.01)
                continue
            tokens, kv = prompts[rng.randrange(NUM_PROMPTS)]
            try:
                n = await cache.lookup(tokens)
                if n:
                    out = await cache.load(tokens[:n])
                    status["loads"] += 1
                    status["wrong"] += not same(out, kv[:, :, : out.shape[2]])
                if n < NUM_TOKENS:
                    await cache.store(tokens, kv)
                    status["stores"] += 1
            except Exception as exc:
                status["errors"].append(f"{type(exc).__name__}: {exc}")
                if len(status["errors"]) > 10:
                    break
            status["ops"] += 1
            if status["ops"] % 20 == 0:
                save(status)
        tiers = cache.stats().tiers
        status["tiers"] = {t.name: {"errors": t.errors, "corrupt": t.corrupt} for t in tiers}
    save(status)


asyncio.run(main())
"""


# `kvtiers inspect` run `runs` times in one process, each time stopping at its first value
# (its read transaction open) with a file `held<i>` until a file `go<i>` appears; prints a
# line of JSON per run. argv: the command's arguments (JSON), a folder, runs.
HELD_INSPECT = r"""
import contextlib, io, json, os, sys, time

import kvtiers._inspect
from kvtiers.cli import main

argv, control, runs = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
verdict, run = kvtiers._inspect._verdict, {"i": 0, "held": False}


def held_verdict(raw, key):
    if not run["held"]:
        run["held"] = True
        open(os.path.join(control, f"held{run['i']}"), "w").close()
        while not os.path.exists(os.path.join(control, f"go{run['i']}")):
            time.sleep(0.01)
    return verdict(raw, key)


kvtiers._inspect._verdict = held_verdict
for i in range(runs):
    run.update(i=i, held=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    print(json.dumps({"code": code, "doc": json.loads(out.getvalue())}), flush=True)
"""


def wait_for(what: str, done: Any) -> None:
    """Poll `done()` until it is true; fail after `HANG_GUARD_S` as a hang."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not done():
        assert time.monotonic() < deadline, f"hung waiting for {what}"
        time.sleep(0.02)


class LiveCache:
    """A `TieredCache` in another process, storing and loading prompts until stopped."""

    def __init__(self, tmp_path: Path, config: dict[str, Any], num_prompts: int) -> None:
        self.control = tmp_path / "live"
        self.control.mkdir()
        self.status_path = self.control / "status.json"
        script = self.control / "live.py"
        script.write_text(LIVE_CACHE)
        argv = [sys.executable, str(script), json.dumps(config)]
        self.proc = subprocess.Popen(
            [*argv, str(self.status_path), str(self.control), str(num_prompts)],
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for("the live cache to open", lambda: self.status_path.exists() or self._exited())

    def _exited(self) -> bool:
        if self.proc.poll() is None:
            return False
        raise AssertionError(f"the live cache exited early:\n{self.proc.stderr.read()}")  # type: ignore[union-attr]

    def status(self) -> dict[str, Any]:
        return json.loads(self.status_path.read_text())

    def run_on(self, ops: int) -> dict[str, Any]:
        """Let it do `ops` more lookups; return its status then."""
        target = self.status()["ops"] + ops
        wait_for(f"{ops} more live ops", lambda: self._exited() or self.status()["ops"] >= target)
        return self.status()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Park it between two calls (its cache stays open), then let it go on."""
        (self.control / "pause").touch()
        wait_for("the live cache to pause", lambda: (self.control / "paused").exists())
        try:
            yield
        finally:
            (self.control / "paused").unlink()
            (self.control / "pause").unlink()

    def stop(self) -> dict[str, Any]:
        """Stop it; return its last status, having checked it never erred."""
        (self.control / "stop").touch()
        try:
            _, err = self.proc.communicate(timeout=HANG_GUARD_S)
        finally:
            self.proc.kill()
        status = self.status()
        assert self.proc.returncode == 0, err
        assert status["wrong"] == 0, status  # never a byte of KV it did not store
        assert status["errors"] == [], status  # no call raised into the engine
        return status


@contextmanager
def live_cache(
    tmp_path: Path, config: dict[str, Any], num_prompts: int = 10
) -> Iterator[LiveCache]:
    """Run a `LiveCache` on `config` over `num_prompts` prompts of 4 chunks each."""
    live = LiveCache(tmp_path, config, num_prompts)
    try:
        yield live
    finally:
        if live.proc.poll() is None:
            live.proc.kill()
            live.proc.wait()
        if live.proc.stderr is not None:
            live.proc.stderr.close()


def lmdb_config(tmp_path: Path, **options: Any) -> dict[str, Any]:
    """Return a config of one LMDB tier, by default of 30 chunks (the live prompts need 40)."""
    tier = {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": 30 * (2048 + 256)}
    return {"layout": dict(SMALL_LAYOUT), "tiers": [{**tier, **options}]}


def cli_json(capsys: Any, *argv: str) -> tuple[int, Any]:
    """Run `kvtiers *argv --json` here; return its status and its parsed output."""
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.out, captured.err
    return code, json.loads(captured.out)


def fingerprint(**overrides: Any) -> str:
    return small_layout(**overrides).fingerprint.hex()


def digest(path: Path) -> tuple[int, str]:
    return path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


def assert_only_reader(path: Path, pid: int) -> None:
    """Assert that LMDB's reader table at `path` lists process `pid` only."""
    env = lmdb.open(str(path), max_dbs=4, readonly=True, map_size=0)
    try:
        slots = env.readers().splitlines()[1:]
    finally:
        env.close()
    assert all(line.split()[0] == str(pid) for line in slots), slots


async def check_loads(config: dict[str, Any]) -> int:
    """Load every live prompt in a fresh cache; return the tokens found, each bit-exact."""
    layout = KVLayout(**config["layout"])
    num_tokens, found = 4 * layout.chunk_size, 0
    async with TieredCache.from_config(config) as cache:
        for p in range(10):
            tokens = [p * 100_000 + j for j in range(num_tokens)]
            gen = torch.Generator().manual_seed(p)
            shape = (*layout.kv_shape(num_tokens)[:-1], layout.head_size * layout.itemsize)
            kv = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            if n := await cache.lookup(tokens):
                out = await cache.load(tokens[:n])
                assert same_bytes(out.view(torch.uint8), kv[:, :, :n])
                found += n
    return found


# -- inspect -------------------------------------------------------------------------------


def test_inspect_beside_a_live_lmdb_writer_sees_only_intact_entries(tmp_path):
    """Regression: inspect read without LMDB's reader lock, so the live writer reused the
    pages of its snapshot while it read; `--verify` then found entries "corrupt" (values
    of another database), counted garbage (entries under "?") and exited 1, or LMDB
    aborted the process on a page that was no longer a branch or leaf."""
    config = lmdb_config(tmp_path)
    path, control, runs = str(tmp_path / "lmdb"), tmp_path / "inspector", 3
    control.mkdir()
    with live_cache(tmp_path, config) as live:
        live.run_on(50)
        argv = json.dumps(["inspect", path, "--verify", "--json"])
        inspector = subprocess.Popen(
            [sys.executable, "-c", HELD_INSPECT, argv, str(control), str(runs)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(runs):
            held = control / f"held{i}"
            wait_for("inspect to read", lambda h=held: h.exists() or inspector.poll() is not None)
            live.run_on(300)  # while inspect holds its snapshot: evicts, frees, writes
            (control / f"go{i}").touch()
        out, err = inspector.communicate(timeout=HANG_GUARD_S)
        assert live.stop()["loads"] > 0
    assert inspector.returncode == 0 and "Traceback" not in err, (out, err)
    for line in out.splitlines():
        code, doc = json.loads(line).values()
        assert (code, doc["bad"]) == (0, []), doc
        [ns] = doc["namespaces"]
        assert ns["fingerprint"] == fingerprint() and ns["layout"] == small_layout().to_dict()
        assert 0 < ns["entries"] == doc["checked"]
        assert ns["bytes"] <= config["tiers"][0]["capacity"]
    assert len(out.splitlines()) == runs


def test_inspect_and_a_dry_run_leave_a_live_lmdb_path_as_it_was(tmp_path, capsys):
    """Read-only: data.mdb keeps its bytes and mtime, and no reader slot outlives the command."""
    path = tmp_path / "lmdb"
    with live_cache(tmp_path, lmdb_config(tmp_path)) as live:
        live.run_on(50)
        with live.paused():
            before = digest(path / "data.mdb")
            for argv in (["inspect"], ["inspect", "--verify"], ["purge", "--bad", "--dry-run"]):
                code, _ = cli_json(capsys, argv[0], str(path), *argv[1:])
                assert code == 0
            fp = fingerprint()[:8]
            done = subprocess.run(
                [KVTIERS, "purge", str(path), "--fingerprint", fp, "--dry-run", "--json"],
                capture_output=True,
                text=True,
                timeout=HANG_GUARD_S,
            )
            assert done.returncode == 0 and json.loads(done.stdout)["removed"] > 0, done.stderr
            assert digest(path / "data.mdb") == before
            assert_only_reader(path, live.proc.pid)  # the commands' slots are gone
        stores = live.status()["stores"]
        assert live.run_on(100)["stores"] > stores  # its writes go on: no lock was left
        live.stop()


def test_an_inspect_killed_mid_read_leaves_no_reader_behind(tmp_path, capsys):
    """Under the reader lock, an inspect killed mid-read leaves its slot, which pins its
    snapshot: the live writer's pages are never reused and data.mdb only grows. The next
    inspect (or a cache opening the path) frees the slots of dead processes."""
    path, control = tmp_path / "lmdb", tmp_path / "inspector"
    control.mkdir()
    with live_cache(tmp_path, lmdb_config(tmp_path)) as live:
        live.run_on(50)
        argv = json.dumps(["inspect", str(path), "--verify", "--json"])
        inspector = subprocess.Popen(
            [sys.executable, "-c", HELD_INSPECT, argv, str(control), "1"],
            stdout=subprocess.DEVNULL,
        )
        wait_for("inspect to read", lambda: (control / "held0").exists())
        inspector.kill()
        inspector.wait()
        code, doc = cli_json(capsys, "inspect", str(path))
        assert code == 0 and doc["namespaces"]
        assert_only_reader(path, live.proc.pid)
        live.stop()


# -- purge ---------------------------------------------------------------------------------


def test_purge_beside_a_live_lmdb_writer(tmp_path, capsys):
    """Purging an old layout, then the live one's own, while it writes: it never loads a
    wrong byte nor raises, stores again after each purge, and the path stays sound."""
    config = lmdb_config(tmp_path, capacity=60 * (2048 + 256))  # the old layout's 8 fit too
    path = str(tmp_path / "lmdb")
    old = lmdb_config(tmp_path)
    old["layout"]["model"] = "old-model"
    asyncio.run(fill(old, 8))
    with live_cache(tmp_path, config) as live:
        live.run_on(50)
        code, doc = cli_json(capsys, "purge", path, "--fingerprint", fingerprint(model="old-model"))
        assert (code, doc["removed"]) == (0, 8)

        purged = 0
        for _ in range(30):
            live.run_on(10)
            code = main(["purge", path, "--fingerprint", fingerprint()[:6], "--json"])
            out = capsys.readouterr()
            if code == 2 and "the store holds none" in out.err:
                continue  # none of its chunks reached the path since the last purge
            doc = json.loads(out.out)
            assert code == 0 and doc["removed"] + doc["kept"] <= 60, doc
            purged += 1
        assert purged > 0
        stores = live.status()["stores"]
        assert live.run_on(100)["stores"] > stores  # misses, then stores again
        status = live.stop()
    assert status["loads"] > 0 and status["tiers"]["lmdb"]["corrupt"] == 0
    code, doc = cli_json(capsys, "inspect", path, "--verify")
    assert code == 0 and [ns["fingerprint"] for ns in doc["namespaces"]] == [fingerprint()]
    assert asyncio.run(check_loads(config)) > 0  # what it stored after the purges loads


async def fill(config: dict[str, Any], num_chunks: int) -> None:
    layout = KVLayout(**config["layout"])
    num_tokens = num_chunks * layout.chunk_size
    async with TieredCache.from_config(config) as cache:
        await cache.store(list(range(num_tokens)), make_kv(layout, num_tokens))


def test_purge_of_a_store_past_10_mib_beside_a_writer_with_another_map(tmp_path, capsys):
    """Regression: purge opened the environment with py-lmdb's 10 MiB map, which LMDB
    raises only to the pages in use; with no free page to copy into, a purge of any store
    larger than that failed with MDB_MAP_FULL. The live writer maps 256 MiB and reads
    with one thread, the old layout's 12 MiB were written with a map of their own."""
    old = lmdb_config(tmp_path)
    big = {"model": "old-model", "num_kv_heads": 8, "head_size": 64, "chunk_size": 64}
    old["layout"].update(big)  # 256 KiB chunks
    old["tiers"][0]["capacity"] = 60 * (256 * 1024 + 256)
    asyncio.run(fill(old, 48))
    path = tmp_path / "lmdb"
    assert (path / "data.mdb").stat().st_size > 12 * 2**20
    config = lmdb_config(tmp_path, capacity="64MiB", map_size="256MiB", read_threads=1)
    with live_cache(tmp_path, config) as live:
        live.run_on(50)
        code, doc = cli_json(capsys, "purge", str(path), "--fingerprint", fingerprint(**big))
        assert (code, doc["removed"]) == (0, 48), doc
        code, doc = cli_json(capsys, "inspect", str(path))
        assert code == 0 and [ns["fingerprint"] for ns in doc["namespaces"]] == [fingerprint()]
        live.run_on(50)
        live.stop()
    assert asyncio.run(check_loads(config)) > 0


# -- remote pools ----------------------------------------------------------------------------


def remote_config(tmp_path: Path) -> dict[str, Any]:
    """A DRAM tier of 8 chunks over a `file://` pool of 30 (the live prompts need 40)."""
    tiers = [
        {"kind": "dram", "capacity": 8 * 2048},
        {"kind": "remote", "url": f"file://{tmp_path}/pool", "capacity": 30 * (2048 + 512)},
    ]
    return {"layout": dict(SMALL_LAYOUT), "tiers": tiers}


def write_toml(path: Path, config: dict[str, Any]) -> Path:
    lines = ["[layout]", *(f"{k} = {json.dumps(v)}" for k, v in config["layout"].items())]
    for tier in config["tiers"]:
        lines += ["", "[[tiers]]", *(f"{k} = {json.dumps(v)}" for k, v in tier.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_pool_commands_beside_a_live_remote_writer(tmp_path, capsys):
    """Regression: `purge URL --fingerprint F` removed the layout's folder recursively,
    which failed (ENOTEMPTY) whenever the live cache wrote a chunk into it meanwhile."""
    config = remote_config(tmp_path)
    url, fp = config["tiers"][1]["url"], fingerprint()
    toml = str(write_toml(tmp_path / "tiers.toml", config))
    with live_cache(tmp_path, config) as live:
        live.run_on(50)
        for _ in range(8):
            code, doc = cli_json(capsys, "inspect", url, "--verify")
            assert (code, doc["bad"]) == (0, []), doc
            assert [ns["fingerprint"] for ns in doc["namespaces"]] in ([], [fp])
            assert main(["remote", "ls", toml]) == 0
            assert "this layout" in capsys.readouterr().out
            assert cli_json(capsys, "purge", url, "--bad")[0] == 0
            live.run_on(10)
            code, doc = cli_json(capsys, "purge", url, "--fingerprint", fp[:8])
            assert code == 0 and doc["fingerprint"] == fp, doc
            live.run_on(10)
            assert main(["remote", "purge", toml, "--all"]) == 0
            assert "deleted" in capsys.readouterr().out
            live.run_on(10)
        stores = live.status()["stores"]
        assert live.run_on(100)["stores"] > stores
        status = live.stop()
    assert status["loads"] > 0 and status["tiers"]["remote"]["corrupt"] == 0
    code, doc = cli_json(capsys, "inspect", url, "--verify")
    assert code == 0 and doc["bad"] == []
    assert asyncio.run(check_loads(config)) > 0


def test_bench_beside_a_live_cache_leaves_it_serving(tmp_path, capsys):
    config = lmdb_config(tmp_path)
    config["tiers"] = [{"kind": "dram", "capacity": 8 * 2048}, *config["tiers"]]
    config["tiers"].append(remote_config(tmp_path)["tiers"][1])
    toml = str(write_toml(tmp_path / "tiers.toml", config))
    with live_cache(tmp_path, config) as live:
        live.run_on(50)
        code, doc = cli_json(capsys, "bench", toml, "--chunks", "4")
        assert code == 0 and all(tier["clean"] for tier in doc["tiers"]), doc
        live.run_on(50)
        live.stop()
    for where in (str(tmp_path / "lmdb"), config["tiers"][2]["url"]):
        code, doc = cli_json(capsys, "inspect", where, "--verify")
        assert code == 0 and [ns["fingerprint"] for ns in doc["namespaces"]] == [fingerprint()]


# -- what is not a store -------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect"],
        ["inspect", "--verify", "--json"],
        ["purge", "--bad"],
        ["purge", "--fingerprint", "ab", "--json"],
    ],
)
@pytest.mark.parametrize("where", ["missing", "empty", "a-file", "not-lmdb"])
def test_a_path_that_is_no_store_is_a_one_line_error_and_creates_nothing(
    tmp_path, capsys, argv, where
):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "not-lmdb").mkdir()
    (tmp_path / "not-lmdb" / "notes.txt").write_text("x")
    before = sorted(tmp_path.rglob("*"))
    command, *flags = argv
    code = main([command, str(tmp_path / where), *flags])
    assert "not an LMDB environment" in one_line_error(capsys, code, status=2)
    assert sorted(tmp_path.rglob("*")) == before


def test_a_pool_url_with_nothing_there_reads_as_empty_and_creates_nothing(tmp_path, capsys):
    """An object store cannot tell a prefix nobody wrote from an empty pool: by design."""
    url = f"file://{tmp_path}/nothing"
    code, doc = cli_json(capsys, "inspect", url, "--verify")
    assert (code, doc["namespaces"], doc["checked"]) == (0, [], 0)
    code, doc = cli_json(capsys, "purge", url, "--bad")
    assert (code, doc["removed"]) == (0, 0)
    code = main(["purge", url, "--fingerprint", "ab"])
    assert "no layout match" in one_line_error(capsys, code, status=2)
    assert not (tmp_path / "nothing").exists()


def test_inspect_an_lmdb_copy_without_its_lock_file_creates_none(tmp_path, capsys):
    """A data.mdb without lock.mdb (a backup) is open in no process: read it unlocked."""
    asyncio.run(fill(lmdb_config(tmp_path), 4))
    (tmp_path / "lmdb" / "lock.mdb").unlink()
    code, doc = cli_json(capsys, "inspect", str(tmp_path / "lmdb"), "--verify")
    assert code == 0 and doc["checked"] == 4
    assert not (tmp_path / "lmdb" / "lock.mdb").exists()


def test_the_command_line_purges_a_live_path_as_the_cache_exits(tmp_path):
    """The real `kvtiers` process: status 0 and one JSON document on stdout."""
    with live_cache(tmp_path, lmdb_config(tmp_path)) as live:
        live.run_on(50)
        argv = [KVTIERS, "purge", str(tmp_path / "lmdb"), "--fingerprint", fingerprint()[:8]]
        purge = subprocess.Popen([*argv, "--json"], stdout=subprocess.PIPE, text=True)
        live.stop()
        out, _ = purge.communicate(timeout=HANG_GUARD_S)
    assert purge.returncode == 0
    report = json.loads(out)
    assert report["fingerprint"] == fingerprint() and report["dry_run"] is False
    assert report["removed"] + report["kept"] > 0
