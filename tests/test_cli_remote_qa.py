"""`kvtiers remote ls`, `remote purge` and `purge URL` on pools that hold more than ours."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgpack

from kvtiers import TieredCache
from kvtiers.cli import main
from tests.conftest import make_kv
from tests.test_cache_remote import TOKENS, file_url, write_toml


def fill(url: str, layout: object) -> list[bytes]:
    """Store `TOKENS` of `layout` in the pool at `url`; return their chunk keys."""

    async def store() -> list[bytes]:
        cfg = {"tiers": [{"kind": "remote", "url": url, "capacity": "1MiB"}]}
        async with TieredCache.from_config(cfg, layout=layout) as cache:
            await cache.store(TOKENS, make_kv(layout, 64))
            return list(cache.keys(TOKENS))

    return asyncio.run(store())


def test_remote_ls_of_a_pool_with_an_access_log_from_the_far_future(tmp_path, layout, capsys):
    url = file_url(tmp_path)
    keys = fill(url, layout)
    log = tmp_path / "pool" / layout.fingerprint.hex() / "_access" / "skewed-node"
    log.write_bytes(msgpack.packb([b"KVTA", 1, {key: 1e20 for key in keys}]))
    assert main(["remote", "ls", str(write_toml(tmp_path, url)), "--keys"]) == 0
    out = capsys.readouterr().out
    assert f"{layout.fingerprint.hex()}  this layout: 4 objects" in out
    assert time.strftime("%Y") in out  # accesses no later than the log was written


def test_purges_of_one_layout_leave_other_layouts_and_foreign_files(tmp_path, layout, capsys):
    url = file_url(tmp_path)
    fill(url, layout)
    other = dataclasses.replace(layout, model="other/model")
    fill(url, other)
    namespace = tmp_path / "pool" / layout.fingerprint.hex()
    foreign = [namespace / "notes.txt", namespace / "abcd" / "keep-me", tmp_path / "pool" / "x"]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not kvtiers'")
    toml = str(write_toml(tmp_path, url))
    assert main(["remote", "purge", toml, "--all"]) == 0
    assert "deleted 4 objects" in capsys.readouterr().out
    assert all(path.exists() for path in foreign)
    assert main(["remote", "ls", toml]) == 0
    out = capsys.readouterr().out
    assert f"{other.fingerprint.hex()}  layout" in out and ": 4 objects" in out
    fill(url, layout)
    fingerprint = layout.fingerprint.hex()[:8]
    assert main(["purge", url, "--fingerprint", fingerprint]) == 0
    assert "removed 4 chunks" in capsys.readouterr().out
    assert all(path.exists() for path in foreign)
    chunks = [p for p in (tmp_path / "pool" / other.fingerprint.hex()).rglob("*") if p.is_file()]
    assert len([p for p in chunks if len(p.name) == 32]) == 4
