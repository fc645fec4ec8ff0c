"""Tenant isolation: chunks stored under one salt are invisible under another, in every tier.

Each tier is checked on its own (the tiers above it empty, as after a restart), so a hit
could only come from that tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtiers import TieredCache
from tests.conftest import SMALL_LAYOUT, make_kv, same_bytes, small_layout

pytestmark = pytest.mark.reliability

LAY = small_layout()
TOKENS = list(range(100, 164))
SALTS: list[Any] = ["tenant-a", "tenant-b", b"tenant-a\x00", None, ""]


def _tiers(tmp_path: Path) -> dict[str, dict[str, Any]]:
    return {
        "dram": {"kind": "dram", "capacity": 64 * LAY.chunk_bytes},
        "lmdb": {"kind": "lmdb", "capacity": "4MiB", "path": str(tmp_path / "db")},
        "remote": {"kind": "remote", "capacity": "4MiB", "url": f"file://{tmp_path}/pool"},
    }


@pytest.mark.parametrize("tier", ["lmdb", "remote"])
async def test_salts_isolate_in_shared_tiers_after_restart(tmp_path: Path, tier: str) -> None:
    tiers = _tiers(tmp_path)
    cfg = {"layout": SMALL_LAYOUT, "tiers": [tiers["dram"], tiers[tier]]}
    kvs = {i: make_kv(LAY, 64, seed=i) for i in range(len(SALTS))}
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(TOKENS, kvs[0], salt=SALTS[0])
    # restart: DRAM is empty, so only the shared tier can answer
    async with TieredCache.from_config(cfg) as cache:
        for salt in SALTS[1:]:
            assert await cache.lookup(TOKENS, salt=salt) == 0, salt
            assert (await cache.load(TOKENS, salt=salt)).shape[2] == 0, salt
        assert await cache.lookup(TOKENS, salt=SALTS[0]) == 64
        assert same_bytes(await cache.load(TOKENS, salt=SALTS[0]), kvs[0])
        # every tenant stores its own KV under the same tokens; each sees only its own
        for i, salt in enumerate(SALTS[1:], start=1):
            assert await cache.store(TOKENS, kvs[i], salt=salt) == 64
        await cache.flush()
    async with TieredCache.from_config(cfg) as cache:
        for i, salt in enumerate(SALTS):
            assert same_bytes(await cache.load(TOKENS, salt=salt), kvs[i]), salt


async def test_salts_isolate_in_dram(tmp_path: Path) -> None:
    cfg = {"layout": SMALL_LAYOUT, "tiers": [_tiers(tmp_path)["dram"]]}
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(TOKENS, make_kv(LAY, 64), salt="tenant-a")
        for salt in SALTS[1:]:
            assert await cache.lookup(TOKENS, salt=salt) == 0, salt
        assert await cache.lookup(TOKENS, salt="tenant-a") == 64


def test_salted_keys_differ_from_the_first_chunk_on(tmp_path: Path) -> None:
    cache = TieredCache.from_config({"layout": SMALL_LAYOUT, "tiers": [_tiers(tmp_path)["dram"]]})
    chains = [cache.keys(TOKENS, salt=salt) for salt in SALTS]
    firsts = [chain[0] for chain in chains]
    assert len(set(firsts)) == len(SALTS)  # no chunk of any tenant is shared with another
