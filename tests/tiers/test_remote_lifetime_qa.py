"""The remote pool's lifetime and sharing: scans, access logs, TTL, eviction and purges.

Every test runs the real components on `memory://`, `file://` or S3 (moto over HTTP
through s3fs). Time is the tier's injected `clock`; no test asserts a speed.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from pathlib import Path

import fsspec
import msgpack
import pytest

from kvtiers.core.errors import ConfigError
from kvtiers.tiers import _remote_access as access
from kvtiers.tiers._remote_access import AccessLog
from kvtiers.tiers._remote_admin import list_pool, purge_namespace
from kvtiers.tiers._remote_catalog import ACCESS_DIR
from kvtiers.tiers._remote_options import RemoteOptions
from tests.tiers.conftest import MotoS3
from tests.tiers.test_remote import (
    LAYOUT,
    VALUE_BYTES,
    dsts,
    keys,
    make_config,
    make_tier,
    memory_url,
    payloads,
)

FINGERPRINT = LAYOUT.fingerprint.hex()


def log_object(times: dict[bytes, float], version: int = 1) -> bytes:
    data: bytes = msgpack.packb([b"KVTA", version, times], use_bin_type=True)
    return data


# -- access logs -------------------------------------------------------------------------------


@pytest.mark.parametrize("when", [math.inf, 1e300, 1e20])
async def test_an_access_log_from_the_far_future_neither_pins_objects_nor_breaks_ls(
    when: float,
) -> None:
    url = memory_url()
    chunk = keys(1)
    async with make_tier(url, ttl=100) as tier:
        start = time.time()
        tier.clock = lambda: start
        await tier.put(chunk, payloads(1))
        fs = fsspec.filesystem("memory")
        fs.pipe_file(f"{tier.namespace}/_access/skewed", log_object({chunk[0]: when}))
        namespaces = await list_pool(make_config(url), LAYOUT)
        (obj,) = namespaces[0].objects
        assert obj.last_access <= time.time() + access.CLOCK_SLACK
        tier.clock = lambda: start + 1000  # idle far longer than the TTL
        await tier.scan_now()
        assert await tier.contains(chunk) == [False]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x93",  # a writer that crashed after the first byte
        log_object({b"k" * 16: 1.0})[:-3],  # truncated
        log_object({b"k" * 16: 1.0}, version=2),  # a later format
        msgpack.packb([b"KVTA", 1, {b"k" * 16: math.nan}]),
        msgpack.packb([b"KVTA", 1, [1, 2]]),
        msgpack.packb({"a": 1}),
        b"\xc1" * 64,  # never valid msgpack
        bytes(range(256)) * 8,
    ],
)
def test_a_bad_access_log_decodes_to_nothing(raw: bytes) -> None:
    assert AccessLog.decode(raw) == {}


async def test_a_huge_file_among_the_access_logs_is_not_read_whole(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/pool"
    chunk = keys(1)
    async with make_tier(url) as tier:
        await tier.put(chunk, payloads(1))
        written = time.time() - 1000
        os.utime(f"{tier.namespace}/{chunk[0][:2].hex()}/{chunk[0].hex()}", (written, written))
        when = time.time() - 5
        log = {i.to_bytes(16, "big"): when for i in range(access.MAX_LOG_BYTES // 26)}
        log[chunk[0]] = when
        huge = Path(f"{tier.namespace}/_access/huge")
        huge.parent.mkdir(parents=True, exist_ok=True)
        huge.write_bytes(log_object(log))
        assert huge.stat().st_size > access.MAX_LOG_BYTES
        listing = await access.scan(tier._store, tier.namespace)
        (obj,) = listing.objects.values()
        # not a log: its record is not believed
        assert obj.last_access == pytest.approx(written, abs=1)


# -- foreign files and purges ------------------------------------------------------------------


async def test_purge_all_leaves_files_that_are_not_ours(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/pool"
    async with make_tier(url) as tier:
        await tier.put(keys(3), payloads(3))
        namespace = Path(tier.namespace)
    foreign = [
        namespace / "README.txt",
        namespace / "abcd" / "not-a-chunk",
        namespace / "abcd" / ("ef" * 16),  # a key name in the wrong prefix folder
        namespace / "backup" / "chunks.tar",
    ]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"someone else's")
    result = await purge_namespace(make_config(url), FINGERPRINT, older_than=None)
    assert result.num_objects == 3
    assert all(path.exists() for path in foreign)
    assert not any((namespace / k[:2].hex() / k.hex()).exists() for k in keys(3))


async def test_purge_of_one_layout_on_s3_leaves_a_sibling_prefix(moto_s3: MotoS3) -> None:
    url = moto_s3.url("purge")
    options = moto_s3.storage_options()
    async with make_tier(url, storage_options=options) as tier:
        await tier.put(keys(2), payloads(2))
        namespace = tier.namespace
    fs = fsspec.filesystem("s3", **moto_s3.storage_options(shared_session=False))
    sibling = f"{namespace}.old/abcd/{'ab' * 16}"  # the fingerprint with a suffix
    fs.pipe_file(sibling, b"kept")
    config = make_config(url, storage_options=options)
    result = await purge_namespace(config, FINGERPRINT, older_than=None)
    assert result.num_objects == 2
    assert fs.cat_file(sibling) == b"kept"


async def test_two_keys_with_one_prefix_folder_evict_alone(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/pool"
    first, second = b"\xab\xcd" + bytes(14), b"\xab\xcd" + bytes(13) + b"\x01"
    async with make_tier(url, num_chunks=2) as tier:
        await tier.put([first], payloads(1))
        await tier.put([second], payloads(1, seed=1))
        await tier.get([second], dsts(1))
        await tier.put(keys(1), payloads(1, seed=2))  # evicts `first` only
        assert await tier.contains([first, second]) == [False, True]
        await tier.scan_now()
        assert tier.usage().num_entries == 2


async def test_a_scan_deletes_what_is_ours_and_leaves_the_rest(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/pool"
    async with make_tier(url, ttl=60) as tier:
        await tier.put(keys(2), payloads(2))
        namespace = Path(tier.namespace)
        ours = [
            namespace / "abcd" / f".{'ab' * 16}.00ff00ff00ff00ff.tmp",
            namespace / "._layout.00ff00ff00ff00ff.tmp",  # a crash while labelling it
        ]
        foreign = [
            namespace / "abcd" / ".notes.tmp",
            namespace / "abcd" / f".{'ab' * 16}.zz.tmp",
            namespace / "abcd" / "ABCD0000000000000000000000000000",
            namespace / "lost+found" / "x",
            namespace.parent / "elsewhere.tmp",
        ]
        for path in [*ours, *foreign]:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
        tier.clock = lambda: time.time() + 2 * 86400
        await tier.scan_now()
        assert tier.usage().num_entries == 0  # expired
        assert not any(path.exists() for path in ours)
        assert all(path.exists() for path in foreign)


# -- TTL and clocks ----------------------------------------------------------------------------


async def test_ttl_keeps_an_object_accessed_exactly_ttl_ago() -> None:
    chunk = keys(1)
    async with make_tier(memory_url(), ttl=100) as tier:
        start = time.time() + 10_000  # the tier's clock runs ahead of the store's
        tier.clock = lambda: start
        await tier.put(chunk, payloads(1))
        tier.clock = lambda: start + 100
        await tier.scan_now()
        assert await tier.contains(chunk) == [True]
        tier.clock = lambda: start + 100.5
        await tier.scan_now()
        assert await tier.contains(chunk) == [False]


# -- the store's answers -----------------------------------------------------------------------


async def test_a_bucket_that_does_not_exist_declines_writes_and_raises_nothing(
    moto_s3: MotoS3,
) -> None:
    url = "s3://kvtiers-no-such-bucket/pool"
    async with make_tier(url, storage_options=moto_s3.storage_options()) as tier:
        assert await tier.put(keys(2), payloads(2)) == [False, False]
        assert tier.counters.declined == 2 and tier.counters.errors == 2
        assert await tier.get(keys(2), dsts(2)) == [False, False]
        await tier.get(keys(1), dsts(1))
        await tier.scan_now()  # its access log cannot be written either


async def test_close_during_a_scan_still_writes_the_access_log(tmp_path: Path) -> None:
    tier = make_tier(f"file://{tmp_path}/pool", max_in_flight=2)
    await tier.open()
    await tier.put(keys(3), payloads(3))
    await tier.get(keys(3), dsts(3))
    started, release = threading.Semaphore(0), threading.Event()

    def occupy() -> None:
        started.release()
        release.wait(30)

    pool = tier._store._pool
    assert pool is not None
    busy = [pool.submit(occupy) for _ in range(2)]  # the scan's requests queue behind
    try:
        assert await asyncio.to_thread(lambda: all(started.acquire(timeout=10) for _ in busy))
        scanning = asyncio.ensure_future(tier.scan_now())
        for _ in range(5):
            await asyncio.sleep(0)
        closing = asyncio.ensure_future(tier.close())
        for _ in range(5):
            await asyncio.sleep(0)
    finally:
        release.set()
        await asyncio.gather(*map(asyncio.wrap_future, busy))
    await asyncio.wait_for(asyncio.gather(scanning, closing), 30)
    (log,) = Path(tier.namespace, ACCESS_DIR).iterdir()
    assert set(AccessLog.decode(log.read_bytes())) == set(keys(3))


async def test_close_during_a_scan_on_s3_writes_the_log_and_closes_cleanly(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url("closing")
    tier = make_tier(url, storage_options=moto_s3.storage_options())
    await tier.open()
    await tier.put(keys(3), payloads(3))
    await tier.get(keys(3), dsts(3))
    scanning = asyncio.ensure_future(tier.scan_now())
    for _ in range(3):
        await asyncio.sleep(0)
    await tier.close()
    await scanning
    fs = fsspec.filesystem("s3", **moto_s3.storage_options(shared_session=False))
    (log,) = fs.find(f"{tier.namespace}/{ACCESS_DIR}")
    assert set(AccessLog.decode(fs.cat_file(log))) == set(keys(3))


@pytest.mark.slow
async def test_scans_and_listings_page_through_more_than_1000_objects(moto_s3: MotoS3) -> None:
    url = moto_s3.url("pages")
    options = {"storage_options": moto_s3.storage_options(), "max_in_flight": 64}
    chunks = keys(1050)
    async with make_tier(url, num_chunks=1100, **options) as big:
        assert await big.put(chunks, payloads(1050)) == [True] * 1050
    namespaces = await list_pool(make_config(url, **options), LAYOUT)
    assert len(namespaces[0].objects) == 1050
    async with make_tier(url, num_chunks=1000, **options) as small:  # evicts 50 at open
        assert small.counters.evictions == 50
        assert small.usage().used_bytes == 1000 * VALUE_BYTES
        assert sum(await small.contains(chunks)) == 1000  # one listing, in pages


@pytest.mark.parametrize("url", ["s3://bucket//pool", "s3:///pool", "gs://bucket/a//b"])
def test_an_object_store_url_with_an_empty_segment_is_refused(url: str) -> None:
    # Objects under `bucket//pool` are stored, but no listing of that prefix finds them.
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.url: has an empty segment"):
        RemoteOptions.from_config(make_config(url))


@pytest.mark.parametrize("url", ["s3://bucket/pool/", "memory://m//pool", "file:///tmp//pool"])
def test_urls_whose_listings_find_their_objects_are_taken(url: str) -> None:
    assert RemoteOptions.from_config(make_config(url)).url == url
