"""`kvtiers inspect`: counts per layout and a checksum pass over LMDB and remote stores.

Tests are sync: the command runs its own event loop, as on the command line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from kvtiers import TieredCache
from kvtiers.cli import main
from tests._cli_errors import one_line_error
from tests.conftest import make_config, make_kv, same_bytes
from tests.tiers.test_lmdb import flip_payload_byte, rewrite_value


async def fill(cfg, layout, num_tokens: int = 64) -> list[bytes]:
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(list(range(num_tokens)), make_kv(layout, num_tokens))
        return list(cache.keys(list(range(num_tokens))))


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["inspect", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_lmdb_counts_and_verify_finds_corrupt_entry(tmp_path, layout, capsys):
    keys = asyncio.run(fill(make_config(tmp_path, dram_chunks=8, lmdb_chunks=50), layout))
    path = tmp_path / "lmdb"
    code, doc = run_json(capsys, str(path))
    assert code == 0
    assert set(doc) == {"kind", "location", "namespaces", "verified", "checked", "bad"}
    assert doc["kind"] == "lmdb" and doc["verified"] is False and doc["bad"] == []
    [ns] = doc["namespaces"]
    assert ns["fingerprint"] == layout.fingerprint.hex() and ns["entries"] == 4
    assert ns["bytes"] > 4 * layout.chunk_bytes
    assert ns["layout"] == layout.to_dict()  # the record the tier left at open

    rewrite_value(path, keys[1], flip_payload_byte)
    code, doc = run_json(capsys, str(path), "--verify")
    assert code == 1
    assert doc["verified"] is True and doc["checked"] == 4
    assert doc["bad"] == [
        {
            "key": keys[1].hex(),
            "fingerprint": layout.fingerprint.hex(),
            "problem": "corrupt",
            "path": "",
            "num_bytes": ns["bytes"] // 4,
        }
    ]
    # text output names the bad key
    assert main(["inspect", str(path), "--verify"]) == 1
    assert keys[1].hex() in capsys.readouterr().out


def test_remote_verify_finds_corrupt_object(tmp_path, layout, capsys):
    url = f"file://{tmp_path}/pool"
    cfg = make_config(dram_chunks=8)
    cfg["tiers"].append({"kind": "remote", "url": url, "capacity": 50 * (layout.chunk_bytes + 512)})
    keys = asyncio.run(fill(cfg, layout))
    code, doc = run_json(capsys, url)
    assert code == 0 and doc["kind"] == "remote"
    assert doc["namespaces"] == [
        {
            "fingerprint": layout.fingerprint.hex(),
            "entries": 4,
            "bytes": doc["namespaces"][0]["bytes"],
            "layout": layout.to_dict(),
        }
    ]
    [victim] = [p for p in Path(tmp_path, "pool").rglob(keys[2].hex())]
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, doc = run_json(capsys, url, "--verify")
    assert code == 1 and doc["checked"] == 4
    assert [(b["key"], b["problem"]) for b in doc["bad"]] == [(keys[2].hex(), "corrupt")]


def test_each_namespace_is_named_by_its_layout_record(tmp_path, layout, capsys):
    """Two TP ranks share an LMDB path and a pool: inspect tells their namespaces apart."""
    url = f"file://{tmp_path}/pool"
    ranks = [dataclasses.replace(layout, tp_rank=r, tp_size=2) for r in (0, 1)]
    for rank in ranks:
        cfg = make_config(
            tmp_path, dram_chunks=8, lmdb_chunks=50, layout={"tp_rank": rank.tp_rank, "tp_size": 2}
        )
        cfg["tiers"].append({"kind": "remote", "url": url, "capacity": 2**20})
        asyncio.run(fill(cfg, rank))
    for where in (str(tmp_path / "lmdb"), url):
        _, doc = run_json(capsys, where)
        named = {ns["fingerprint"]: ns["layout"] for ns in doc["namespaces"]}
        assert named == {r.fingerprint.hex(): r.to_dict() for r in ranks}
        assert main(["inspect", where]) == 0
        out = capsys.readouterr().out
        assert f"{layout.model}, tp 1/2, {layout.num_layers} layers" in out


def test_a_missing_or_foreign_layout_record_leaves_the_namespace_unnamed(tmp_path, layout, capsys):
    import lmdb

    url = f"file://{tmp_path}/pool"
    cfg = make_config(tmp_path, dram_chunks=8, lmdb_chunks=50)
    cfg["tiers"].append({"kind": "remote", "url": url, "capacity": 2**20})
    asyncio.run(fill(cfg, layout))
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=4)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"layout:" + layout.fingerprint, b"\x93\xa4KVTL")  # truncated msgpack
    env.close()
    [record] = Path(tmp_path, "pool").rglob("_layout")
    record.unlink()
    for where in (str(tmp_path / "lmdb"), url):
        code, doc = run_json(capsys, where)
        assert code == 0 and [ns["layout"] for ns in doc["namespaces"]] == [None]
        assert main(["inspect", where]) == 0
        assert "entries" in capsys.readouterr().out


def test_not_an_lmdb_path_exits_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "not an LMDB environment" in capsys.readouterr().err


@pytest.mark.parametrize("options", ["{", "[1]", "[" * 100_000])
def test_bad_storage_options_exit_2(tmp_path, capsys, options):
    assert main(["inspect", f"file://{tmp_path}", "--storage-options", options]) == 2
    assert "--storage-options" in capsys.readouterr().err


# -- purge -------------------------------------------------------------------------------


def purge_json(capsys, *argv: str) -> dict:
    assert main(["purge", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


async def load_all(cfg, layout, num_tokens: int, salt=None):
    async with TieredCache.from_config(cfg) as cache:
        tokens = list(range(num_tokens))
        return await cache.lookup(tokens, salt=salt), await cache.load(tokens, salt=salt)


def test_lmdb_purge_removes_only_what_it_was_told(tmp_path, layout, capsys):
    kept_cfg = make_config(tmp_path, dram_chunks=8, lmdb_chunks=50)
    other_cfg = make_config(tmp_path, dram_chunks=8, lmdb_chunks=50, layout={"model": "other"})
    asyncio.run(fill(kept_cfg, layout, 64))
    asyncio.run(fill(other_cfg, layout, 32))
    path = str(tmp_path / "lmdb")
    other = TieredCache.from_config(other_cfg).layout.fingerprint.hex()
    dry = purge_json(capsys, path, "--fingerprint", other[:8], "--dry-run")
    assert (dry["removed"], dry["kept"], dry["dry_run"]) == (2, 4, True)
    done = purge_json(capsys, path, "--fingerprint", other[:8])
    assert (done["removed"], done["kept"]) == (2, 4) and done["fingerprint"] == other
    # the other layout is gone; the rest still loads bit-identical
    assert asyncio.run(load_all(other_cfg, layout, 32))[0] == 0
    hit, kv = asyncio.run(load_all(kept_cfg, layout, 64))
    assert hit == 64 and same_bytes(kv, make_kv(layout, 64))


def test_lmdb_purge_bad_removes_the_corrupt_entry(tmp_path, layout, capsys):
    cfg = make_config(tmp_path, dram_chunks=8, lmdb_chunks=50)
    keys = asyncio.run(fill(cfg, layout, 64))
    path = tmp_path / "lmdb"
    rewrite_value(path, keys[3], flip_payload_byte)
    done = purge_json(capsys, str(path), "--bad")
    assert (done["removed"], done["kept"]) == (1, 3)
    assert main(["inspect", str(path), "--verify"]) == 0
    hit, kv = asyncio.run(load_all(cfg, layout, 64))
    assert hit == 48 and same_bytes(kv, make_kv(layout, 64)[:, :, :48])


def test_remote_purge_by_layout_and_bad(tmp_path, layout, capsys):
    url = f"file://{tmp_path}/pool"
    cap = 50 * (layout.chunk_bytes + 512)
    cfg = make_config(dram_chunks=8)
    cfg["tiers"].append({"kind": "remote", "url": url, "capacity": cap})
    other = make_config(dram_chunks=8, layout={"model": "other"})
    other["tiers"].append({"kind": "remote", "url": url, "capacity": cap})
    keys = asyncio.run(fill(cfg, layout, 64))
    asyncio.run(fill(other, layout, 32))
    [victim] = [p for p in Path(tmp_path, "pool").rglob(keys[1].hex())]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = purge_json(capsys, url, "--bad")
    assert (bad["removed"], bad["kept"], bad["removed_bytes"]) == (1, 5, len(data))
    assert not victim.exists()
    fp = TieredCache.from_config(other).layout.fingerprint.hex()
    gone = purge_json(capsys, url, "--fingerprint", fp)
    assert (gone["removed"], gone["kept"]) == (2, 3)
    code, doc = run_json(capsys, url)
    assert [ns["fingerprint"] for ns in doc["namespaces"]] == [layout.fingerprint.hex()]
    hit, kv = asyncio.run(load_all(cfg, layout, 64))
    assert hit == 16 and same_bytes(kv, make_kv(layout, 64)[:, :, :16])


def test_remote_purge_by_age_takes_only_the_idle_objects(tmp_path, layout, capsys):
    import os
    import time

    url = f"file://{tmp_path}/pool"
    cfg = make_config(dram_chunks=8)
    cfg["tiers"].append({"kind": "remote", "url": url, "capacity": 50 * (layout.chunk_bytes + 512)})
    other = make_config(dram_chunks=8, layout={"model": "other"})
    other["tiers"].append(dict(cfg["tiers"][1]))
    keys = asyncio.run(fill(cfg, layout, 64))
    asyncio.run(fill(other, layout, 32))
    two_days_ago = time.time() - 2 * 86400
    for log in Path(tmp_path, "pool", layout.fingerprint.hex(), "_access").iterdir():
        log.unlink()  # the writers' access records: last access is then the last write
    for key in keys[2:]:  # the deepest two chunks were last written two days ago
        [path] = Path(tmp_path, "pool").rglob(key.hex())
        os.utime(path, (two_days_ago, two_days_ago))
    fp = layout.fingerprint.hex()
    dry = purge_json(capsys, url, "--fingerprint", fp, "--older-than", "1d", "--dry-run")
    assert (dry["removed"], dry["kept"]) == (2, 4)
    done = purge_json(capsys, url, "--fingerprint", fp, "--older-than", "1d")
    assert (done["removed"], done["kept"]) == (2, 4)
    assert [bool(list(Path(tmp_path, "pool").rglob(k.hex()))) for k in keys] == [1, 1, 0, 0]
    hit, kv = asyncio.run(load_all(cfg, layout, 64))
    assert hit == 32 and same_bytes(kv, make_kv(layout, 64)[:, :, :32])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fingerprint", "ffff"], "no layout"),
        ([], "one of the arguments"),
        (["--bad", "--older-than", "1d"], "only with --fingerprint on a URL"),
    ],
)
def test_purge_bad_arguments_exit_2(tmp_path, layout, capsys, argv, message):
    asyncio.run(fill(make_config(tmp_path, dram_chunks=8, lmdb_chunks=50), layout, 32))
    assert main(["purge", str(tmp_path / "lmdb"), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("prefix", ["", "  "])
def test_purge_refuses_an_empty_fingerprint_and_keeps_everything(tmp_path, layout, capsys, prefix):
    asyncio.run(fill(make_config(tmp_path, dram_chunks=8, lmdb_chunks=50), layout, 32))
    before = run_json(capsys, str(tmp_path / "lmdb"))[1]["namespaces"]
    code = main(["purge", str(tmp_path / "lmdb"), "--fingerprint", prefix])
    assert "--fingerprint: empty" in one_line_error(capsys, code, status=2)
    assert run_json(capsys, str(tmp_path / "lmdb"))[1]["namespaces"] == before


@pytest.mark.parametrize(
    "argv", [["inspect"], ["purge", "--bad"], ["purge", "--fingerprint", "ab"]]
)
def test_a_data_mdb_that_is_no_lmdb_file_is_a_one_line_error(tmp_path, capsys, argv):
    store = tmp_path / "store"
    store.mkdir()
    (store / "data.mdb").write_bytes(bytes(range(256)) * 256)
    command, *flags = argv
    code = main([command, str(store), *flags])
    line = one_line_error(capsys, code, status=1)
    assert "TierIOError" in line and "cannot open the LMDB environment" in line
