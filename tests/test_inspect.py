"""`kvtiers inspect`: counts per layout and a checksum pass over LMDB and remote stores.

Tests are sync: the command runs its own event loop, as on the command line.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvtiers import TieredCache
from kvtiers.cli import main
from tests.conftest import make_config, make_kv
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

    rewrite_value(path, keys[1], flip_payload_byte)
    code, doc = run_json(capsys, str(path), "--verify")
    assert code == 1
    assert doc["verified"] is True and doc["checked"] == 4
    assert doc["bad"] == [
        {"key": keys[1].hex(), "fingerprint": layout.fingerprint.hex(), "problem": "corrupt"}
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
        }
    ]
    [victim] = [p for p in Path(tmp_path, "pool").rglob(keys[2].hex())]
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, doc = run_json(capsys, url, "--verify")
    assert code == 1 and doc["checked"] == 4
    assert [(b["key"], b["problem"]) for b in doc["bad"]] == [(keys[2].hex(), "corrupt")]


def test_not_an_lmdb_path_exits_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "not an LMDB environment" in capsys.readouterr().err


@pytest.mark.parametrize("options", ["{", "[1]"])
def test_bad_storage_options_exit_2(tmp_path, capsys, options):
    assert main(["inspect", f"file://{tmp_path}", "--storage-options", options]) == 2
    assert "--storage-options" in capsys.readouterr().err
