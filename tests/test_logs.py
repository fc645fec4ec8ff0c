"""Rate-limited warnings: one line per source per interval, with a count of the rest."""

from __future__ import annotations

import logging

from kvtiers import TieredCache
from kvtiers._logs import RateLimitedLog
from tests.conftest import make_config, make_kv


def test_one_line_per_interval_with_a_count(caplog):
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("kvtiers.test"), 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvtiers.test"):
        assert log.warning("a", "tier %s failed", "a", exc=ValueError("x"))
        for _ in range(5):
            now[0] += 1
            assert not log.warning("a", "tier %s failed", "a")
        assert log.warning("b", "tier %s failed", "b")  # another source is independent
        now[0] = 61.0
        assert log.warning("a", "tier %s failed", "a")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "tier a failed",
        "tier b failed",
        "tier a failed (5 more since the last report 61 s ago)",
    ]
    assert caplog.records[0].exc_info is not None  # the first carries its traceback
    assert caplog.records[2].exc_info is None


class _Broken:
    async def contains(self, keys):
        raise OSError("disk gone")


async def test_a_failing_tier_logs_once_not_per_call(tmp_path, layout, caplog):
    async with TieredCache.from_config(make_config(tmp_path, lmdb_chunks=64)) as cache:
        await cache.store(list(range(32)), make_kv(layout, 32))
        lmdb = cache.tiers[1]
        lmdb.contains = _Broken().contains  # the shared tier now fails every lookup
        with caplog.at_level(logging.WARNING, logger="kvtiers"):
            for i in range(20):
                await cache.lookup(list(range(5000 + i, 5032 + i)))
        assert cache.stats().tiers[1].errors == 20
    failed = [r for r in caplog.records if "served as misses" in r.getMessage()]
    assert len(failed) == 1
