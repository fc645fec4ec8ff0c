"""TieredCache over a mooncake tier: pooling across processes through a segment process."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

import pytest

from kvtiers.cli import main
from tests._pooling import run_child
from tests.conftest import SMALL_LAYOUT, small_layout
from tests.tiers.servers import MOONCAKE_ENV, MooncakeCluster, mooncake_cluster, unique_prefix

__all__ = ["mooncake_cluster"]  # a fixture, imported to be found here

CHUNK_BYTES = small_layout().chunk_bytes
TOKENS = list(range(8000, 8064))  # 4 chunks


def config(master: str, prefix: str) -> dict[str, Any]:
    dram = {"kind": "dram", "capacity": 32 * CHUNK_BYTES}
    # room for headers: capacity counts whole stored values; segment_size 0: a pure client
    pool = {"kind": "mooncake", "master": master, "prefix": prefix, "segment_size": 0}
    pool["capacity"] = 200 * (CHUNK_BYTES + 256)
    return {"layout": dict(SMALL_LAYOUT), "tiers": [dram, pool]}


@pytest.mark.slow
async def test_a_fresh_process_loads_what_another_stored(mooncake_cluster: MooncakeCluster):
    cfg = config(mooncake_cluster.master, unique_prefix())
    # Two pure clients in two processes: the bytes cross TCP into the segment process's
    # memory and back out of it.
    child = functools.partial(run_child, cfg, tokens=TOKENS, env=MOONCAKE_ENV)
    assert await asyncio.to_thread(child, "store") == {"stored": 64}
    result = await asyncio.to_thread(child, "load")
    assert result == {"n": 64, "same": True, "hits": {"dram": 0, "mooncake": 4}}


def test_explain_shows_a_mooncake_tier(tmp_path: Path, capsys) -> None:
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
kind = "mooncake"
master = "10.0.0.7:50051"
segment_size = "4GiB"
capacity = "1GiB"
"""
    )
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tiers[1]      mooncake (kind mooncake, kvtiers.tiers.mooncake.MooncakeTier)" in out
    assert "master      10.0.0.7:50051 over tcp, metadata P2PHANDSHAKE, 1 replica(s)" in out
    assert "lends 4.00 GiB of this process's memory to the pool" in out
