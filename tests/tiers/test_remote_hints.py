"""The remote tier's reuse hints: objects written cold go first, in every process.

A cold object (`put_hinted`) is recorded in its writer's access log, so a scan in any
process (of the same namespace) puts it first in line for eviction until someone reads it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from kvtiers.tiers._remote_access import CLOCK_SLACK, AccessLog
from kvtiers.tiers._remote_catalog import Listing, StoredObject
from tests.tiers.conftest import MotoS3
from tests.tiers.test_remote import dsts, keys, make_tier, memory_url, payloads


@pytest.mark.parametrize("store", ["memory", "s3"])
async def test_cold_objects_go_first_in_every_process_after_a_scan(
    store: str, request: pytest.FixtureRequest
) -> None:
    options: dict[str, Any] = {}
    url = memory_url()
    if store == "s3":  # whole-second modification times, over HTTP
        s3: MotoS3 = request.getfixturevalue("moto_s3")
        url, options = s3.url(), {"storage_options": s3.storage_options()}
    a, b, c = keys(2), keys(2, seed=1), keys(2, seed=2)
    async with make_tier(url, num_chunks=4, **options) as one:
        await one.put(a, payloads(2))
        assert await one.put_hinted(b, payloads(2), cold=set(b)) == [True, True]
        await one.scan_now()  # writes its log, then refills its catalog from the listing
        async with make_tier(url, num_chunks=4, **options) as two:  # another process
            assert two.usage().num_entries == 4
            assert await two.put(c, payloads(2)) == [True, True]
            assert await two.contains([*a, *b]) == [True, True, False, False]
            assert sorted(two.take_evicted()) == sorted(b)


async def test_a_scan_keeps_this_process_s_cold_objects_first() -> None:
    a, b, c = keys(2), keys(2, seed=1), keys(1, seed=2)
    async with make_tier(memory_url(), num_chunks=4) as tier:
        await tier.put_hinted(b, payloads(2), cold=set(b))
        await tier.put(a, payloads(2))  # written after b, yet b goes first
        await tier.scan_now()
        await tier.put(c, payloads(1))
        assert await tier.contains([*a, *b]) == [True, True, True, False]  # b's deepest first


async def test_a_read_on_another_node_makes_a_cold_object_warm() -> None:
    url = memory_url()
    a, b, c = keys(2), keys(2, seed=1), keys(2, seed=2)
    async with make_tier(url, num_chunks=4) as one, make_tier(url, num_chunks=4) as two:
        await one.put(a, payloads(2))
        await one.put_hinted(b, payloads(2), cold=set(b))
        await one.scan_now()
        assert await two.get(b, dsts(2)) == [True, True]
        await two.scan_now()  # writes its log, which records the read
        await one.scan_now()
        await one.put(c, payloads(2))
        assert await one.contains([*a, *b]) == [False, False, True, True]


async def test_cold_objects_expire_by_their_write_not_at_once() -> None:
    cold, warm = keys(2), keys(2, seed=1)
    async with make_tier(memory_url(), ttl=100) as tier:
        start = time.time()
        tier.clock = lambda: start
        await tier.put_hinted(cold, payloads(2), cold=set(cold))
        tier.clock = lambda: start + 60
        await tier.put(warm, payloads(2))
        await tier.scan_now()
        assert await tier.contains([*cold, *warm]) == [True] * 4
        tier.clock = lambda: start + 130
        await tier.scan_now()
        assert await tier.contains([*cold, *warm]) == [False, False, True, True]


def _listing(modified: float) -> tuple[bytes, Listing]:
    key = keys(1)[0]
    return key, Listing({key: StoredObject(key, "p", 10, modified, modified)})


def test_merge_takes_a_cold_write_only_for_the_object_s_last_write() -> None:
    key, listing = _listing(1000.0)
    AccessLog.merge(listing, [{key: -(1000.0 - CLOCK_SLACK - 1)}])  # an older incarnation's
    assert not listing.objects[key].cold
    AccessLog.merge(listing, [{key: -999.0}])  # within the clock slack of the write
    assert listing.objects[key].cold and listing.objects[key].last_access == 999.0
    key, listing = _listing(1000.0)
    AccessLog.merge(listing, [{key: -1000.0}, {key: 1001.0}])  # read since, by another process
    assert not listing.objects[key].cold and listing.objects[key].last_access == 1001.0


def test_a_cold_write_survives_the_log_format_and_is_clamped_like_reads() -> None:
    log = AccessLog()
    k1, k2 = keys(2)
    log.park([k1], 500.0)
    log.record([k2], 600.0)
    log.park([k2], 700.0)  # written cold again after a delete
    assert log.dirty
    assert AccessLog.decode(log.encode()) == {k1: -500.0, k2: -700.0}
    assert AccessLog.decode(log.encode(), written=100.0) == {
        k1: -(100.0 + CLOCK_SLACK),
        k2: -(100.0 + CLOCK_SLACK),
    }
    log.record([k1], 800.0)  # a read makes it warm
    assert AccessLog.decode(log.encode())[k1] == 800.0
    log.prune(before=750.0)
    assert list(log.times) == [k1]
    assert math.copysign(1.0, AccessLog.decode(log.encode())[k1]) == 1.0
