"""Load: 64 tasks in each of two processes on one LMDB path, for a bounded time.

No deadlock (the run ends in time), no error, no wrong byte, RSS flat after warm-up,
every pin released, and the cache's stats add up to what the tasks did.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtiers import TieredCache
from tests.conftest import SMALL_LAYOUT
from tests.reliability import _load

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SECONDS = float(os.environ.get("KVTIERS_LOAD_SECONDS", "20"))
RSS_SLACK = 24 * 2**20  # allocator noise over a run, far below a leak's growth


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from /proc")
async def test_two_processes_64_tasks_each_on_one_lmdb(tmp_path: Path) -> None:
    chunk = _load.LAY.chunk_bytes
    cfg = {
        "layout": SMALL_LAYOUT,
        "tiers": [
            {"kind": "dram", "capacity": 96 * chunk},
            # smaller than the working set (about 450 chunks): the shared tier evicts too
            {"kind": "lmdb", "path": str(tmp_path / "db"), "capacity": 300 * (chunk + 256)},
        ],
        "write_queue_chunks": 64,
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability._load", json.dumps(cfg), str(SECONDS), "2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        async with TieredCache.from_config(cfg) as cache:
            tally = await asyncio.wait_for(_load.run(cache, SECONDS, 1), SECONDS + 60)
            stats = cache.stats()
            pins = cache.pin_count()
        out, err = child.communicate(timeout=SECONDS + 90)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, err[-2000:]
    other = json.loads(out.strip().splitlines()[-1])
    warm = tally.rss_bytes[max(1, len(tally.rss_bytes) // 3)]
    end = tally.rss_bytes[-1]
    ops = tally.lookups + tally.loads + tally.stores
    print(
        f"load: {SECONDS:.0f} s, ops {ops} + {other['lookups'] + other['loads'] + other['stores']}"
        f" (other process), errors {tally.errors} + {other['errors']}, "
        f"RSS start {tally.rss_bytes[0] >> 20} MiB, after warm-up {warm >> 20} MiB, "
        f"end {end >> 20} MiB; lmdb {stats.tiers[1]}"
    )
    assert tally.errors == other["errors"] == 0, (tally.error_text[:3], other["error_text"][:3])
    assert tally.wrong_bytes == other["wrong_bytes"] == 0
    assert pins == other["pins"] == 0
    assert end - warm <= RSS_SLACK, [r >> 20 for r in tally.rss_bytes]
    assert tally.lookups > 100 and other["lookups"] > 100
    # the stats add up to what the tasks did
    assert (stats.lookups, stats.loads, stats.stores) == (tally.lookups, tally.loads, tally.stores)
    assert stats.hit_tokens <= stats.lookup_tokens
    assert stats.write_queue_chunks == 0
    dram, disk = stats.tiers
    assert dram.usage.used_bytes <= dram.usage.capacity_bytes
    assert disk.usage.used_bytes <= disk.usage.capacity_bytes
    assert disk.corrupt == disk.errors == dram.errors == 0
