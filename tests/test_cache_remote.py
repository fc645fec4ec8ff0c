"""TieredCache over a remote tier: pooling across caches and processes, outages, the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest

from kvtiers import TieredCache
from kvtiers.cli import main
from tests._pooling import run_child
from tests.conftest import SMALL_LAYOUT, make_kv, same_bytes, small_layout
from tests.tiers.conftest import SECRET, MotoS3, free_port, moto_s3, own_moto_s3

__all__ = ["moto_s3", "own_moto_s3"]  # fixtures, imported to be found here

pytestmark = pytest.mark.filterwarnings("error")

CHUNK_BYTES = small_layout().chunk_bytes
TOKENS = list(range(5000, 5064))  # 4 chunks


def remote_tier(url: str, num_chunks: int = 200, **options: Any) -> dict[str, Any]:
    # room for headers: capacity counts whole objects
    return {"kind": "remote", "url": url, "capacity": num_chunks * (CHUNK_BYTES + 256), **options}


def config(*tiers: dict[str, Any], dram_chunks: int = 32) -> dict[str, Any]:
    dram = {"kind": "dram", "capacity": dram_chunks * CHUNK_BYTES}
    return {"layout": dict(SMALL_LAYOUT), "tiers": [dram, *tiers]}


def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path}/pool"


# -- pooling ---------------------------------------------------------------------------------


async def test_chunks_promoted_from_the_remote_fill_the_lmdb_tier_above(tmp_path, layout):
    def node(name: str) -> dict[str, Any]:
        lmdb = {"kind": "lmdb", "path": str(tmp_path / name), "capacity": "4MiB"}
        return config(lmdb, remote_tier(file_url(tmp_path)), dram_chunks=8)

    kv = make_kv(layout, 64)
    async with TieredCache.from_config(node("a")) as cache:
        await cache.store(TOKENS, kv)
    async with TieredCache.from_config(node("b")) as other:  # another node, empty lmdb
        assert same_bytes(await other.load(TOKENS), kv)
        await other.flush()
        assert await other.tiers[1].contains(other.keys(TOKENS)) == [True] * 4
    lmdb_only = {"layout": dict(SMALL_LAYOUT), "tiers": [node("b")["tiers"][1]]}
    async with TieredCache.from_config(lmdb_only) as local:  # the node's own copy now
        assert same_bytes(await local.load(TOKENS), kv)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_a_fresh_cache_loads_what_another_stored(tmp_path, layout, write_policy):
    cfg = config(remote_tier(file_url(tmp_path), write_policy=write_policy), dram_chunks=4)
    prompts = [(list(range(i * 100, i * 100 + 64)), make_kv(layout, 64, seed=i)) for i in range(3)]
    async with TieredCache.from_config(cfg) as cache:
        for tokens, kv in prompts:
            await cache.store(tokens, kv)
    async with TieredCache.from_config(cfg) as other:  # its own, empty DRAM
        for tokens, kv in prompts if write_policy == "write_through" else prompts[:2]:
            assert await other.lookup(tokens) == 64
            assert same_bytes(await other.load(tokens), kv)
        dram, remote = other.stats().tiers
        assert remote.hits > 0 and dram.promotions > 0


@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_load_split_between_lmdb_and_remote_reads_both_at_once(
    tmp_path, layout, concurrent
):
    url = file_url(tmp_path)
    tokens, kv = list(range(8000, 8128)), make_kv(layout, 128, seed=5)  # 8 chunks
    async with TieredCache.from_config(config(remote_tier(url))) as first:
        await first.store(tokens, kv)
    lmdb = {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "4MiB"}
    split = {**config(lmdb, remote_tier(url), dram_chunks=8), "concurrent_reads": concurrent}
    async with TieredCache.from_config(split) as cache:
        assert await cache.lookup(tokens) == 128  # the index learns: all in remote
        await cache.store(tokens[:64], kv[:, :, :64])  # the first 4 also into lmdb
        await cache.flush()
        await cache.store(list(range(64)), make_kv(layout, 128)[:, :, :64])
        await cache.store(list(range(100, 164)), make_kv(layout, 64))  # dram holds neither
        log: list[str] = []
        for tier in cache.tiers[1:]:
            get = tier.get

            async def logged(keys, dsts, _get=get, _name=tier.name):
                log.append(f"start {_name}")
                await asyncio.sleep(0.05)  # both calls are in flight before either ends
                found = await _get(keys, dsts)
                log.append(f"end {_name}")
                return found

            tier.get = logged
        assert same_bytes(await cache.load(tokens), kv)
    # NOTE: a tier may get two calls (the chunks that got a DRAM block, and those that did
    # not while background writes held blocks), so the order is checked, not the count.
    first_end = next(i for i, entry in enumerate(log) if entry.startswith("end"))
    started = {entry.split()[1] for entry in log[:first_end]}
    if concurrent:
        assert started == {"lmdb", "remote"}  # both in flight before either ended
    else:  # one tier after the other, top first
        last_lmdb = max(i for i, entry in enumerate(log) if entry.endswith("lmdb"))
        assert started == {"lmdb"} and last_lmdb < log.index("start remote")
    assert {entry.split()[1] for entry in log} == {"lmdb", "remote"}


async def test_corrupt_remote_object_is_a_counted_miss(tmp_path, layout):
    cfg = config(remote_tier(file_url(tmp_path)))
    kv = make_kv(layout, 64)
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(TOKENS, kv)
        victim = cache.keys(TOKENS)[2]
        namespace = cache.tiers[1].namespace
    path = Path(f"{namespace}/{victim[:2].hex()}/{victim.hex()}")
    value = bytearray(path.read_bytes())
    value[-10] ^= 0xFF
    path.write_bytes(bytes(value))
    async with TieredCache.from_config(cfg) as cache:
        assert await cache.lookup(TOKENS) == 64  # contains() reads no payload
        got = await cache.load(TOKENS)
        assert got.shape[2] == 32 and same_bytes(got, kv[:, :, :32])
        assert cache.stats().tiers[1].corrupt == 1
        assert await cache.lookup(TOKENS) == 32


@pytest.mark.slow
async def test_another_process_loads_the_prefix_from_s3(moto_s3, layout):
    remote = remote_tier(
        moto_s3.url(), storage_options=moto_s3.storage_options(shared_session=False)
    )
    cfg = config(remote)
    async with TieredCache.from_config(cfg) as cache:
        assert await cache.store(TOKENS, make_kv(layout, 64, seed=42)) == 64
    result = await asyncio.to_thread(run_child, cfg, "load", TOKENS)  # moto runs in this process
    assert result == {"n": 64, "same": True, "hits": {"dram": 0, "remote": 4}}


@pytest.mark.slow
async def test_another_node_with_its_own_lmdb_loads_from_s3(moto_s3, tmp_path, layout):
    remote = remote_tier(
        moto_s3.url(), storage_options=moto_s3.storage_options(shared_session=False)
    )

    def node(name: str) -> dict[str, Any]:
        lmdb = {"kind": "lmdb", "path": str(tmp_path / name), "capacity": 200 * (CHUNK_BYTES + 256)}
        return config(lmdb, remote)

    async with TieredCache.from_config(node("a")) as cache:
        assert await cache.store(TOKENS, make_kv(layout, 64, seed=42)) == 64
    result = await asyncio.to_thread(run_child, node("b"), "load", TOKENS)
    assert result == {"n": 64, "same": True, "hits": {"dram": 0, "lmdb": 0, "remote": 4}}
    result = await asyncio.to_thread(run_child, node("a"), "load", TOKENS)
    assert result["hits"]["lmdb"] == 4  # node a's disk


# -- outage ----------------------------------------------------------------------------------


async def test_store_outage_gives_misses_fast_and_recovers(own_moto_s3: MotoS3, layout):
    s3 = own_moto_s3
    remote = remote_tier(
        s3.url(), storage_options=s3.storage_options(), breaker_cooldown=0.3, timeout=1
    )
    cfg = config(remote)
    local, pooled, fresh = TOKENS, list(range(64)), list(range(900, 964))
    kvs = {id(t): make_kv(layout, 64, seed=i) for i, t in enumerate((local, pooled, fresh))}
    async with TieredCache.from_config(cfg) as writer:
        await writer.store(pooled, kvs[id(pooled)])  # in the pool only, for the cache below
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(local, kvs[id(local)])
        await cache.flush()
        s3.stop()
        start = time.perf_counter()
        for _ in range(3):
            assert await cache.lookup(local) == 64  # DRAM
            assert same_bytes(await cache.load(local), kvs[id(local)])
            assert await cache.lookup(pooled) == 0  # the remote tier answers misses
            assert (await cache.load(pooled)).shape[2] == 0
        await cache.store(fresh, kvs[id(fresh)])
        await cache.flush()  # the write-through to the pool is dropped, not stuck
        assert time.perf_counter() - start < 5
        remote_stats = cache.stats().tiers[1]
        assert remote_stats.declined >= 4
        s3.start()
        await asyncio.sleep(0.35)
        for _ in range(3):  # the first call probes; then everything goes through
            if await cache.lookup(pooled) == 64:
                break
        assert same_bytes(await cache.load(pooled), kvs[id(pooled)])


# -- the command line ------------------------------------------------------------------------


def write_toml(tmp_path: Path, url: str, extra: str = "") -> Path:
    layout = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SMALL_LAYOUT.items())
    path = tmp_path / "tiers.toml"
    path.write_text(
        f"""
[layout]
{layout}

[[tiers]]
kind = "dram"
capacity = "64KiB"

[[tiers]]
kind = "remote"
name = "pool"
url = "{url}"
capacity = "1MiB"
{extra}
"""
    )
    return path


async def test_cli_remote_ls_and_purge(tmp_path, layout, capsys):
    url = file_url(tmp_path)
    toml = write_toml(tmp_path, url)
    async with TieredCache.from_config(toml) as cache:
        await cache.store(TOKENS, make_kv(layout, 64))
        keys = cache.keys(TOKENS)
    fingerprint = layout.fingerprint.hex()

    def cli(*argv: str) -> str:
        code = main(list(argv))
        out = capsys.readouterr()
        assert code == 0, out.err
        return out.out

    out = await asyncio.to_thread(cli, "remote", "ls", str(toml), "--keys")
    assert f"{fingerprint}  this layout: 4 objects" in out
    assert all(key.hex() in out for key in keys)
    out = await asyncio.to_thread(cli, "remote", "purge", str(toml), "--older-than", "1h")
    assert "deleted 0 objects" in out and "4 objects kept" in out
    out = await asyncio.to_thread(cli, "remote", "purge", str(toml), "--all", "--dry-run")
    assert "would delete 4 objects" in out
    out = await asyncio.to_thread(cli, "remote", "purge", str(toml), "--all")
    assert "deleted 4 objects" in out
    fs = fsspec.filesystem("file")
    assert not [p for p in fs.find(f"{tmp_path}/pool") if fingerprint in p]
    assert "empty" in await asyncio.to_thread(cli, "remote", "ls", str(toml))


async def test_cli_remote_ls_shows_cold_objects_first(tmp_path, layout, capsys):
    toml = write_toml(tmp_path, file_url(tmp_path))
    async with TieredCache.from_config(toml) as cache:
        await cache.store(TOKENS, make_kv(layout, 64), keep_tokens=32)  # 2 chunks past it
        keys = cache.keys(TOKENS)
    code = await asyncio.to_thread(main, ["remote", "ls", str(toml), "--keys"])
    out = capsys.readouterr().out
    assert code == 0 and "4 objects" in out and "2 cold (stored with no reuse expected)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("    ")]
    assert [row[0] for row in rows[:2]] == [keys[3].hex(), keys[2].hex()]  # eviction order
    assert [row[-1] == "cold" for row in rows] == [True, True, False, False]


def test_cli_remote_ls_names_other_layouts_by_their_record(tmp_path, layout, capsys):
    url = file_url(tmp_path)
    other = dataclasses.replace(layout, model="other/model", tp_rank=1, tp_size=2)
    cfg = {"tiers": [{"kind": "remote", "url": url, "capacity": "1MiB"}]}

    async def fill() -> None:
        async with TieredCache.from_config(cfg, layout=other) as cache:
            await cache.store(TOKENS, make_kv(other, 64))

    asyncio.run(fill())
    assert main(["remote", "ls", str(write_toml(tmp_path, url))]) == 0
    out = capsys.readouterr().out
    assert f"{other.fingerprint.hex()}  layout (other/model, tp 1/2, " in out
    assert "other files" not in out  # the record is no foreign file


def test_cli_remote_ls_lists_other_layouts(tmp_path, capsys):
    other = tmp_path / "pool" / ("ab" * 16) / "abab" / ("ab" * 16)
    other.parent.mkdir(parents=True)
    other.write_bytes(b"x")
    assert main(["remote", "ls", str(write_toml(tmp_path, file_url(tmp_path)))]) == 0
    assert f"{'ab' * 16}  layout: 1 objects" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["purge", "{toml}"], "one of the arguments --all --older-than is required"),
        (["purge", "{toml}", "--older-than", "soon"], "expected an age"),
        (["ls", "{toml}", "--tier", "nope"], "tiers: no tier named 'nope'"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_cli_remote_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    toml = str(write_toml(tmp_path, file_url(tmp_path)))
    assert main(["remote", *(a.format(toml=toml) for a in argv)]) == 2
    assert message in capsys.readouterr().err


def test_cli_remote_unreachable_store_exits_1_without_secrets(tmp_path, capsys):
    dead = MotoS3(free_port()).storage_options(shared_session=False)
    options = json.dumps(dead).replace('": ', '" = ')  # a TOML inline table
    extra = f"storage_options = {options}\nretries = 0\ntimeout = 2"
    toml = write_toml(tmp_path, f"s3://kvtiers-test/{uuid.uuid4().hex}", extra=extra)
    assert main(["remote", "ls", str(toml)]) == 1
    err = capsys.readouterr().err
    assert "cannot list the pool" in err
    assert SECRET not in err


def test_explain_shows_a_remote_tier(tmp_path, capsys):
    assert main(["explain", str(write_toml(tmp_path, file_url(tmp_path)))]) == 0
    out = capsys.readouterr().out
    assert "tiers[1]      pool (kind remote, kvtiers.tiers.remote.RemoteTier)" in out
    assert "eviction    lru, by the tier itself; shared with other processes" in out
