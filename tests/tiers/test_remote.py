"""The remote tier on memory://, file:// and a real S3 endpoint (moto over HTTP)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError, InvalidInputError
from kvtiers.core.layout import KVLayout
from kvtiers.testing.tiers import SMALL_LAYOUT, TierTests
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers._remote_breaker import BreakerState, CircuitBreaker
from kvtiers.tiers._remote_catalog import Catalog
from kvtiers.tiers._remote_options import Redactor, display_url
from kvtiers.tiers.registry import TierRegistry
from kvtiers.tiers.remote import RemoteTier
from tests.tiers.conftest import KEY_ID, SECRET, MotoS3, free_port

LAYOUT = SMALL_LAYOUT
REPO = Path(__file__).resolve().parents[2]
VALUE_BYTES = fmt.value_bytes(LAYOUT.fingerprint, LAYOUT.chunk_bytes, num_layers=LAYOUT.num_layers)


def memory_url() -> str:
    return f"memory://kvtiers-test/{uuid.uuid4().hex[:12]}"


def make_config(url: str, /, num_chunks: int = 64, index: int = 1, **options: Any) -> TierConfig:
    return TierConfig(
        "remote", num_chunks * VALUE_BYTES, options={"url": url, **options}, index=index
    )


def make_tier(url: str, /, num_chunks: int = 64, **options: Any) -> RemoteTier:
    return RemoteTier(make_config(url, num_chunks, **options), LAYOUT)


def keys(num: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed + 1000)
    return [rng.bytes(16) for _ in range(num)]


def payloads(num: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.chunk_bytes, dtype=np.uint8) for _ in range(num)]


def dsts(num: int, fill: int = 7) -> list[np.ndarray]:
    return [np.full(LAYOUT.chunk_bytes, fill, dtype=np.uint8) for _ in range(num)]


def object_url(tier: RemoteTier, key: bytes) -> str:
    return f"{tier.namespace}/{key[:2].hex()}/{key.hex()}"


# -- the conformance suite, three ways ---------------------------------------------------------


class _RemoteTests(TierTests):
    tier_cls = RemoteTier
    evicts_cold_first = True

    def entry_bytes(self) -> int:
        return VALUE_BYTES


class TestRemoteTierMemory(_RemoteTests):
    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> RemoteTier:
        config = TierConfig("remote", capacity_bytes, options={"url": memory_url()})
        return RemoteTier(config, layout)


class TestRemoteTierFile(_RemoteTests):
    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> RemoteTier:
        config = TierConfig("remote", capacity_bytes, options={"url": f"file://{tmp_path}/pool"})
        return RemoteTier(config, layout)


class TestRemoteTierS3(_RemoteTests):
    @pytest.fixture(autouse=True)
    def _server(self, moto_s3: MotoS3) -> None:
        self.s3 = moto_s3

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> RemoteTier:
        options = {"url": self.s3.url(), "storage_options": self.s3.storage_options()}
        return RemoteTier(TierConfig("remote", capacity_bytes, options=options), layout)


# -- objects: names, format, integrity ---------------------------------------------------------


async def test_object_name_and_format_are_the_lmdb_header_plus_layer_checksums() -> None:
    url = memory_url()
    ks, srcs = keys(2), payloads(2)
    async with make_tier(url) as tier:
        assert await tier.put(ks, srcs) == [True, True]
        assert tier.namespace == f"{url.removeprefix('memory:/')}/{LAYOUT.fingerprint.hex()}"
    fs = fsspec.filesystem("memory")
    raw = fs.cat_file(object_url(tier, ks[0]))
    assert len(raw) == VALUE_BYTES
    verdict, payload = fmt.check_value(
        raw, fingerprint=LAYOUT.fingerprint, key=ks[0], payload_len=LAYOUT.chunk_bytes
    )
    assert verdict is fmt.Verdict.OK and bytes(payload) == srcs[0].tobytes()
    head = fmt.header_bytes(LAYOUT.fingerprint, LAYOUT.chunk_bytes, num_layers=LAYOUT.num_layers)
    verdict, header = fmt.check_header(
        raw[:head],
        fingerprint=LAYOUT.fingerprint,
        key=ks[0],
        payload_len=LAYOUT.chunk_bytes,
        num_layers=LAYOUT.num_layers,
    )
    assert verdict is fmt.Verdict.OK and header is not None
    step = LAYOUT.layer_bytes
    assert all(
        fmt.check_layer(header, i, raw[head + i * step : head + (i + 1) * step]) for i in (0, 1)
    )


def _flip_last(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 0xFF])


EDITS = {
    "payload_byte": _flip_last,
    "truncated": lambda v: v[: len(v) // 2],
    "empty": lambda v: b"",
    "too_long": lambda v: v + b"x",
    "header_garbage": lambda v: v[:2] + b"\xc1" * 8 + v[10:],
}


@pytest.mark.parametrize(
    ("where", "edit"),
    [
        *(("file", edit) for edit in EDITS),
        *(("s3", e) for e in ("payload_byte", "truncated", "empty")),
    ],
)
async def test_bad_object_is_a_deleted_counted_miss(
    tmp_path: Path, moto_s3: MotoS3, where: str, edit: str
) -> None:
    if where == "s3":
        url, opts = moto_s3.url(), {"storage_options": moto_s3.storage_options()}
    else:
        url, opts = f"file://{tmp_path}/pool", {}
    ks, srcs = keys(3), payloads(3)
    async with make_tier(url, **opts) as tier:
        await tier.put(ks, srcs)
        fs, path = tier._store._fs, object_url(tier, ks[1])
        value = await _cat(fs, path)
        await _pipe(fs, path, EDITS[edit](value))
        out = dsts(3)
        assert await tier.get(ks, out) == [True, False, True]
        assert (out[1] == 7).all()
        assert np.array_equal(out[0], srcs[0]) and np.array_equal(out[2], srcs[2])
        assert (tier.counters.corrupt, tier.counters.foreign) == (1, 0)
        assert await tier.contains(ks) == [True, False, True]  # deleted
        assert tier.usage().num_entries == 2


@pytest.mark.parametrize("foreign", ["fingerprint", "key"])
async def test_object_of_another_layout_or_key_is_a_deleted_foreign_miss(foreign: str) -> None:
    ks, srcs = keys(2), payloads(2)
    other = KVLayout(model="other", num_layers=2, num_kv_heads=2, head_size=8, dtype="float16")
    async with make_tier(memory_url()) as tier:
        await tier.put(ks, srcs)
        fingerprint = other.fingerprint if foreign == "fingerprint" else LAYOUT.fingerprint
        key = ks[0] if foreign == "fingerprint" else ks[1]
        fs = fsspec.filesystem("memory")
        fs.pipe_file(object_url(tier, ks[0]), fmt.pack_value(fingerprint, key, srcs[0].data))
        out = dsts(1)
        assert await tier.get(ks[:1], out) == [False]
        assert (tier.counters.corrupt, tier.counters.foreign) == (0, 1)
        assert not fs.exists(object_url(tier, ks[0]))


async def _cat(fs: Any, path: str) -> bytes:
    if fs.async_impl:
        return bytes(await fs._cat_file(path))
    return bytes(fs.cat_file(path))


async def _pipe(fs: Any, path: str, data: bytes) -> None:
    if fs.async_impl:
        await fs._pipe_file(path, data)
    else:
        fs.pipe_file(path, data)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
@pytest.mark.parametrize("read", ["get", "get_layers"])
async def test_a_named_pipe_where_an_object_belongs_is_a_deleted_miss_not_a_hang(
    tmp_path: Path, read: str
) -> None:
    # Opening a named pipe blocks until a writer comes; a read must not wait for one.
    ks, srcs = keys(3), payloads(3)
    async with make_tier(f"file://{tmp_path}/pool", timeout=60.0) as tier:
        await tier.put(ks, srcs)
        path = object_url(tier, ks[1])
        os.unlink(path)
        os.mkfifo(path)
        out = dsts(3)
        call = tier.get(ks, out) if read == "get" else tier.get_layers(ks, [0, 1], out)
        assert await asyncio.wait_for(call, 10) == [True, False, True]
        assert (out[1] == 7).all() and np.array_equal(out[2], srcs[2])
        assert tier.counters.corrupt == 1
        assert not os.path.lexists(path)


async def test_a_folder_where_an_object_belongs_is_a_miss(tmp_path: Path) -> None:
    ks, srcs = keys(2), payloads(2)
    async with make_tier(f"file://{tmp_path}/pool") as tier:
        await tier.put(ks, srcs)
        path = object_url(tier, ks[0])
        os.unlink(path)
        os.mkdir(path)
        out = dsts(2)
        assert await asyncio.wait_for(tier.get(ks, out), 10) == [False, True]
        assert await asyncio.wait_for(tier.get_layers(ks, [1], out), 10) == [False, True]
        assert (out[0] == 7).all() and np.array_equal(out[1], srcs[1])


async def test_a_close_under_queued_requests_is_a_miss_not_a_cancellation(tmp_path: Path) -> None:
    # Closing drops the calls still queued in the tier's thread pool; their callers were
    # not cancelled, so they get misses.
    tier = make_tier(f"file://{tmp_path}/pool", max_in_flight=2)
    await tier.open()
    started, release = threading.Semaphore(0), threading.Event()

    def occupy() -> None:
        started.release()
        release.wait(30)

    pool = tier._store._pool
    busy = [pool.submit(occupy) for _ in range(2)]  # the next requests queue behind
    try:
        assert await asyncio.to_thread(lambda: all(started.acquire(timeout=10) for _ in busy))
        call = asyncio.ensure_future(tier.contains(keys(2)))
        for _ in range(5):
            await asyncio.sleep(0)
        await tier.close()
    finally:
        release.set()
        await asyncio.gather(*map(asyncio.wrap_future, busy))
    assert await asyncio.wait_for(call, 10) == [False, False]


# -- layer-wise reads --------------------------------------------------------------------------


def _layer(src: np.ndarray, i: int) -> np.ndarray:
    step = LAYOUT.layer_bytes
    return src[i * step : (i + 1) * step]


@pytest.mark.parametrize("where", ["memory", "s3"])
async def test_get_layers_reads_ranges_and_leaves_other_layers(
    moto_s3: MotoS3, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = {"storage_options": moto_s3.storage_options()} if where == "s3" else {}
    url = moto_s3.url() if where == "s3" else memory_url()
    ks, srcs = keys(3), payloads(3)
    async with make_tier(url, **opts) as tier:
        await tier.put(ks, srcs)

        async def no_whole_reads(path: str) -> None:
            raise AssertionError(f"whole object read: {path}")

        monkeypatch.setattr(tier._store, "cat", no_whole_reads)
        for layers in ([1], [0], [0, 1]):
            out = dsts(3)
            missing = keys(1, seed=5)
            assert await tier.get_layers([*ks, *missing], layers, [*out, *dsts(1)]) == [
                True,
                True,
                True,
                False,
            ]
            for src, dst in zip(srcs, out, strict=True):
                for i in range(LAYOUT.num_layers):
                    if i in layers:
                        assert np.array_equal(_layer(dst, i), _layer(src, i))
                    else:
                        assert (_layer(dst, i) == 7).all()


async def test_get_layers_into_a_strided_view() -> None:
    ks, srcs = keys(1), payloads(1)
    shape = LAYOUT.chunk_shape()
    byte_shape = (*shape[:-1], shape[-1] * LAYOUT.itemsize)
    base = np.zeros((*byte_shape[:2], 2 * byte_shape[2], *byte_shape[3:]), dtype=np.uint8)
    view = base[:, :, ::2]
    async with make_tier(memory_url()) as tier:
        await tier.put(ks, srcs)
        assert await tier.get_layers(ks, [1], [view]) == [True]
    want = srcs[0].reshape(byte_shape)
    assert np.array_equal(view[1], want[1])
    assert not view[0].any() and not base[:, :, 1::2].any()


async def test_get_layers_with_a_bad_layer_reads_whole_and_deletes() -> None:
    ks, srcs = keys(2), payloads(2)
    async with make_tier(memory_url()) as tier:
        await tier.put(ks, srcs)
        fs = fsspec.filesystem("memory")
        path = object_url(tier, ks[0])
        fs.pipe_file(path, _flip_last(fs.cat_file(path)))  # a byte of the last layer
        out = dsts(2)
        assert await tier.get_layers(ks, [0], out) == [True, True]  # layer 0 is intact
        assert await tier.get_layers(ks, [1], out) == [False, True]
        assert tier.counters.corrupt == 1
        assert not fs.exists(path)


async def test_get_layers_of_an_object_without_layer_checksums_reads_it_whole() -> None:
    ks, srcs = keys(1), payloads(1)
    async with make_tier(memory_url()) as tier:
        await tier.put(ks, srcs)
        fs = fsspec.filesystem("memory")
        fs.pipe_file(
            object_url(tier, ks[0]), fmt.pack_value(LAYOUT.fingerprint, ks[0], srcs[0].data)
        )
        out = dsts(1)
        assert await tier.get_layers(ks, [1], out) == [True]
        assert np.array_equal(_layer(out[0], 1), _layer(srcs[0], 1))
        assert (_layer(out[0], 0) == 7).all()


@pytest.mark.parametrize("layers", [[], [2], [-1], [0, 0], [True]])
async def test_get_layers_refuses_bad_indices(layers: list[int]) -> None:
    async with make_tier(memory_url()) as tier:
        with pytest.raises(InvalidInputError, match="layers"):
            await tier.get_layers(keys(1), layers, dsts(1))


# -- eviction, recency, TTL, scans -------------------------------------------------------------


async def test_eviction_takes_the_least_recently_read() -> None:
    a, b, c = keys(2), keys(2, seed=1), keys(2, seed=2)
    async with make_tier(memory_url(), num_chunks=4) as tier:
        await tier.put(a, payloads(2))
        await tier.put(b, payloads(2))
        assert await tier.get(a, dsts(2)) == [True, True]
        assert await tier.put(c, payloads(2)) == [True, True]
        assert await tier.contains([*a, *b, *c]) == [True, True, False, False, True, True]
        assert tier.counters.evictions == 2
        assert tier.usage().used_bytes == 4 * VALUE_BYTES
        assert sorted(tier.take_evicted()) == sorted(b)  # reported once
        assert tier.take_evicted() == []


async def test_one_batch_over_capacity_keeps_the_prefix() -> None:
    chain = keys(6)
    async with make_tier(memory_url(), num_chunks=4) as tier:
        assert await tier.put(chain, payloads(6)) == [True] * 4 + [False] * 2
        assert tier.counters.declined == 2


async def test_reads_on_another_node_count_for_recency() -> None:
    url = memory_url()
    a, b, c = keys(2), keys(2, seed=1), keys(2, seed=2)
    async with make_tier(url, num_chunks=4) as one, make_tier(url, num_chunks=4) as two:
        await one.put(a, payloads(2))
        await one.put(b, payloads(2))
        assert await two.get(a, dsts(2)) == [True, True]  # only the other node reads `a`
        await two.scan_now()  # writes its access log
        await one.scan_now()  # merges it
        await one.put(c, payloads(2))
        assert await one.contains([*a, *b]) == [True, True, False, False]


async def test_scan_learns_other_writers_and_evicts_over_capacity() -> None:
    url = memory_url()
    async with make_tier(url, num_chunks=6) as one, make_tier(url, num_chunks=6) as two:
        await one.put(keys(4), payloads(4))
        await two.put(keys(4, seed=1), payloads(4))
        assert one.usage().num_entries == 4  # not yet seen
        await one.scan_now()
        assert one.usage().num_entries == 6
        assert one.counters.evictions == 2
        assert len(one.take_evicted()) == 2
        assert sum(await two.contains(keys(4, seed=1))) + sum(await two.contains(keys(4))) == 6


async def test_scan_runs_from_put_when_due(monkeypatch: pytest.MonkeyPatch) -> None:
    url = memory_url()
    async with make_tier(url, scan_interval=0.05) as one, make_tier(url) as two:
        await two.put(keys(3, seed=1), payloads(3))
        await asyncio.sleep(0.06)
        await one.put(keys(1), payloads(1))
        assert one.usage().num_entries == 4


async def test_ttl_expires_idle_objects_and_reads_renew_them() -> None:
    old, read, fresh = keys(2), keys(2, seed=1), keys(2, seed=2)
    async with make_tier(memory_url(), ttl=100) as tier:
        start = time.time()
        tier.clock = lambda: start
        await tier.put(old, payloads(2))
        await tier.put(read, payloads(2))
        tier.clock = lambda: start + 90
        await tier.get(read, dsts(2))
        await tier.put(fresh, payloads(2))
        tier.clock = lambda: start + 150  # `old` was written 150 s ago, `read` read 60 s ago
        await tier.scan_now()
        assert await tier.contains([*old, *read]) == [False, False, True, True]
        assert tier.usage().num_entries == 4
        assert sorted(tier.take_evicted()) == sorted(old)  # expired


async def test_scan_deletes_stale_temporaries(tmp_path: Path) -> None:
    async with make_tier(f"file://{tmp_path}/pool") as tier:
        await tier.put(keys(1), payloads(1))
        leftover = Path(f"{tier.namespace}/abab/.{'ab' * 16}.0123.tmp")
        leftover.parent.mkdir(parents=True, exist_ok=True)
        leftover.write_bytes(b"half a write")
        await tier.scan_now()
        assert leftover.exists()
        tier.clock = lambda: time.time() + 7200
        await tier.scan_now()
        assert not leftover.exists()
        assert tier.usage().num_entries == 1


# -- concurrent writers ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["file", "s3"])
async def test_concurrent_writers_of_one_chunk_leave_one_valid_object(
    tmp_path: Path, moto_s3: MotoS3, where: str
) -> None:
    if where == "s3":
        url, opts = moto_s3.url(), {"storage_options": moto_s3.storage_options()}
    else:
        url, opts = f"file://{tmp_path}/pool", {}
    ks = keys(4)
    a, b = payloads(4, seed=1), payloads(4, seed=2)
    async with make_tier(url, **opts) as one, make_tier(url, **opts) as two:
        for _ in range(2):
            await one.delete(ks)
            await asyncio.gather(one.put(ks, a), two.put(ks, b), one.get(ks, dsts(4)))
        assert one.counters.corrupt == two.counters.corrupt == 0
        out = dsts(4)
        assert await one.get(ks, out) == [True] * 4
        for i in range(4):
            assert np.array_equal(out[i], a[i]) or np.array_equal(out[i], b[i])
        found = await one._store.find(one.namespace)
        chunks = [p for p in found if "_access" not in p and not p.endswith("/_layout")]
        assert len(chunks) == 4  # no temporaries left


WRITER = textwrap.dedent(
    """
    import asyncio, json, sys
    import numpy as np
    from kvtiers.core.config import TierConfig
    from kvtiers.testing.tiers import SMALL_LAYOUT
    from kvtiers.tiers.remote import RemoteTier

    async def main(options, seed):
        config = TierConfig("remote", 1 << 20, options=options)
        rng = np.random.default_rng(1000)
        keys = [rng.bytes(16) for _ in range(4)]
        srcs = [np.full(SMALL_LAYOUT.chunk_bytes, seed, np.uint8) for _ in keys]
        dsts = [np.zeros(SMALL_LAYOUT.chunk_bytes, np.uint8) for _ in keys]
        async with RemoteTier(config, SMALL_LAYOUT) as tier:
            for _ in range(15):
                await tier.delete(keys)
                await asyncio.gather(tier.put(keys, srcs), tier.get(keys, dsts))
                await tier.get(keys, dsts)
            await tier.put(keys, srcs)
            print(json.dumps({"corrupt": tier.counters.corrupt, "errors": tier.counters.errors}))

    asyncio.run(main(json.loads(sys.argv[1]), int(sys.argv[2])))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file", "s3"])
async def test_two_processes_writing_one_chunk_leave_one_valid_object(
    tmp_path: Path, moto_s3: MotoS3, where: str
) -> None:
    if where == "s3":
        opts = {
            "url": moto_s3.url(),
            "storage_options": moto_s3.storage_options(shared_session=False),
        }
    else:
        opts = {"url": f"file://{tmp_path}/pool"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}

    def spawn(seed: int) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", WRITER, json.dumps(opts), str(seed)]
        return subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def run_both() -> list[tuple[int, str, str]]:
        procs = [spawn(1), spawn(2)]
        outputs = [p.communicate(timeout=120) for p in procs]
        return [(p.returncode, *output) for p, output in zip(procs, outputs, strict=True)]

    for code, out, err in await asyncio.to_thread(run_both):
        assert code == 0, err
        assert json.loads(out) == {"corrupt": 0, "errors": 0}
    ks = keys(4)  # the children's keys (same seed)
    tier = RemoteTier(TierConfig("remote", 1 << 20, options=opts), LAYOUT)
    async with tier:
        out = dsts(4)
        assert await tier.get(ks, out) == [True] * 4
        for dst in out:
            assert (dst == 1).all() or (dst == 2).all()
        found = await tier._store.find(tier.namespace)
        chunks = [p for p in found if "_access" not in p and not p.endswith("/_layout")]
        assert len(chunks) == 4  # no temporaries left


# -- outage: breaker, timeouts, recovery -------------------------------------------------------


async def test_outage_serves_misses_fast_drops_writes_and_recovers(own_moto_s3: MotoS3) -> None:
    s3 = own_moto_s3
    opts = {"storage_options": s3.storage_options(), "breaker_cooldown": 0.3, "timeout": 1}
    ks, srcs = keys(8), payloads(8)
    async with make_tier(s3.url(), **opts) as tier:
        assert await tier.put(ks[:4], srcs[:4]) == [True] * 4
        s3.stop()
        start = time.perf_counter()
        for _ in range(5):
            assert await tier.get(ks[:4], dsts(4)) == [False] * 4
            assert await tier.contains(ks) == [False] * 8
            assert await tier.put(ks[4:], srcs[4:]) == [False] * 4
            await tier.delete(ks[4:5])
        assert time.perf_counter() - start < 5
        assert tier._store.breaker.state is not BreakerState.CLOSED
        assert tier.io_counters.refused > 0 and tier.io_counters.dropped_writes >= 4
        assert tier.counters.declined >= 4
        s3.start()
        await asyncio.sleep(0.35)
        # One request probes the store (the batch's others are refused meanwhile) and,
        # as it succeeds, closes the breaker.
        assert (await tier.get(ks[:4], dsts(4)))[0]
        out = dsts(4)
        assert await tier.get(ks[:4], out) == [True] * 4
        assert all(np.array_equal(s, d) for s, d in zip(srcs[:4], out, strict=True))
        assert tier._store.breaker.state is BreakerState.CLOSED
        assert await tier.put(ks[4:], srcs[4:]) == [True] * 4


async def test_unreachable_store_at_open_opens_fast_and_serves_misses() -> None:
    opts = {
        "storage_options": MotoS3(free_port()).storage_options(),
        "breaker_failures": 1,
    }
    start = time.perf_counter()
    async with make_tier("s3://nowhere/pool", **opts) as tier:
        assert await tier.get(keys(2), dsts(2)) == [False, False]
        assert await tier.put(keys(2), payloads(2)) == [False, False]
    assert time.perf_counter() - start < 5


def test_catalog_learns_what_a_check_found() -> None:
    catalog = Catalog()
    catalog.add(b"a" * 16, 10, now=1.0)
    catalog.add(b"b" * 16, 20, now=2.0)
    since = catalog.changes
    catalog.learn([b"a" * 16, b"b" * 16, b"c" * 16], [99, None, 30], now=5.0, since=since)
    assert b"a" * 16 in catalog and catalog.size_of(b"a" * 16) == 10  # known: kept as it was
    assert b"b" * 16 not in catalog  # found absent: forgotten
    assert catalog.size_of(b"c" * 16) == 30 and catalog.used_bytes == 40


def test_catalog_keeps_what_changed_while_a_check_was_in_flight() -> None:
    catalog = Catalog()
    catalog.add(b"a" * 16, 10, now=1.0)
    since = catalog.changes  # a check begins: it sees "a" stored and "b" absent
    catalog.remove(b"a" * 16)  # meanwhile deleted,
    catalog.add(b"b" * 16, 20, now=2.0)  # and written
    catalog.learn([b"a" * 16, b"b" * 16, b"c" * 16], [10, None, 30], now=3.0, since=since)
    assert b"a" * 16 not in catalog and catalog.size_of(b"b" * 16) == 20
    assert catalog.size_of(b"c" * 16) == 30 and catalog.used_bytes == 50


async def test_a_read_across_a_delete_does_not_bring_the_object_back(tmp_path) -> None:
    # The read began before the delete and found the object; it must not re-enter the
    # catalog (the tier would count bytes, and evict for room, that no object holds).
    async with make_tier(f"file://{tmp_path}/pool") as tier:
        assert await tier.put(keys(2), payloads(2)) == [True, True]
        fetch = tier._objects.fetch

        async def fetch_then_delete(key, *args):
            raw = await fetch(key, *args)
            await tier.delete([key])
            return raw

        tier._objects.fetch = fetch_then_delete
        assert await tier.get(keys(1), dsts(1)) == [True]  # read before the delete
        del tier._objects.fetch
        assert tier.usage().num_entries == 1
        assert tier.usage().used_bytes == tier.value_bytes
        assert await tier.contains(keys(2)) == [False, True]


async def test_a_scan_across_a_delete_and_a_put_keeps_what_they_did(tmp_path) -> None:
    # The scan listed the namespace before this process deleted one object and wrote
    # another: its listing must neither bring the deleted one back nor drop the new one.
    async with make_tier(f"file://{tmp_path}/pool") as tier:
        ks, ps = keys(3), payloads(3)
        assert await tier.put(ks[:2], ps[:2]) == [True, True]
        sweep = tier._scanner.sweep

        async def sweep_then_change(*args, **kwargs):
            found = await sweep(*args, **kwargs)
            await tier.delete(ks[:1])
            assert await tier.put(ks[2:], ps[2:]) == [True]
            return found

        tier._scanner.sweep = sweep_then_change
        await tier._scan()
        del tier._scanner.sweep
        assert [key in tier._catalog for key in ks] == [False, True, True]
        assert tier.usage().used_bytes == 2 * tier.value_bytes
        await tier._scan()  # a scan that began after both agrees
        assert [key in tier._catalog for key in ks] == [False, True, True]
        assert await tier.contains(ks) == [False, True, True]


def test_breaker_opens_probes_and_closes() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures=2, cooldown=5.0, clock=lambda: now[0])
    assert breaker.allow() and not breaker.failure()
    assert breaker.failure()  # the second in a row opens it
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    now[0] = 5.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one
    breaker.failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    now[0] = 10.0
    assert breaker.allow()
    breaker.abandon()  # a cancelled probe lets another one try
    assert breaker.allow()
    assert breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.opened == 1


# -- credentials and secrets -------------------------------------------------------------------


async def test_no_secret_is_logged_when_the_store_fails(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    dead = MotoS3(free_port())
    opts = {"storage_options": dead.storage_options(), "retries": 1}
    tier = make_tier("s3://bucket/pool", breaker_failures=2, **opts)
    async with tier:
        await tier.put(keys(2), payloads(2))
        await tier.get(keys(2), dsts(2))
        await tier.contains(keys(2))
    ours = [r.getMessage() for r in caplog.records if r.name == "kvtiers"]
    assert any("failed 2 times in a row" in message for message in ours)
    # The secret key appears in no record, botocore's own debug output included (the key id
    # does: botocore logs request headers, and an access key id is not a secret).
    assert SECRET not in caplog.text
    assert not any(KEY_ID in message for message in ours)


def test_redactor_hides_nested_secrets_user_info_and_environment_credentials() -> None:
    options = {
        "key": "AKIA-EXAMPLE",
        "client_kwargs": {"aws_session_token": "tok-123456", "region_name": "eu-west-1"},
        "endpoint_url": "http://user:pa55word@minio:9000",
        "config_kwargs": {"credentials": {"refresh": "r-abcdef"}},
    }
    redact = Redactor(
        options, "s3://me:hunter22@bucket/p", {"AWS_SECRET_ACCESS_KEY": "env-secret-1"}
    )
    text = redact("AKIA-EXAMPLE tok-123456 eu-west-1 pa55word r-abcdef hunter22 env-secret-1 minio")
    assert text == "*** *** eu-west-1 *** *** *** *** minio"
    assert display_url("s3://me:hunter22@bucket/p?x=1") == "s3://bucket/p"


async def test_credentials_and_endpoint_from_the_environment(
    moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    ks, srcs = keys(2), payloads(2)
    async with make_tier(moto_s3.url()) as tier:
        assert await tier.put(ks, srcs) == [True, True]
        out = dsts(2)
        assert await tier.get(ks, out) == [True, True]
        assert tier.io_counters.failures == 0


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"url": ""}, "url"),
        ({"url": 3}, "url"),
        ({"url": "nope://x"}, "url"),
        ({"storage_options": "key=1"}, "storage_options"),
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"max_in_flight": "16"}, "max_in_flight"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"retries": -1}, "retries"),
        ({"breaker_failures": 0}, "breaker_failures"),
        ({"breaker_cooldown": -1}, "breaker_cooldown"),
        ({"ttl": 0}, "ttl"),
        ({"ttl": "1d"}, "ttl"),
        ({"scan_interval": -1}, "scan_interval"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_option_names_the_field(options: dict[str, Any], field: str) -> None:
    config = TierConfig("remote", 1 << 20, options={"url": memory_url(), **options}, index=2)
    with pytest.raises(ConfigError, match=rf"^tiers\[2\]\.{field}: "):
        RemoteTier(config, LAYOUT)


def test_url_is_required_and_defaults_apply() -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.url: required"):
        RemoteTier(TierConfig("remote", 1 << 20, options={}, index=1), LAYOUT)
    options = make_tier(memory_url()).options
    assert (options.max_in_flight, options.timeout, options.retries) == (16, 10.0, 3)
    assert (options.breaker_failures, options.breaker_cooldown, options.ttl) == (5, 5.0, None)


def test_eviction_other_than_lru_and_tiny_capacity_are_refused() -> None:
    config = TierConfig("remote", 1 << 20, eviction="arc", options={"url": memory_url()}, index=1)
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.eviction: .*least-recently-used"):
        RemoteTier(config, LAYOUT)
    config = TierConfig("remote", VALUE_BYTES - 1, options={"url": memory_url()}, index=3)
    with pytest.raises(ConfigError, match=r"^tiers\[3\]\.capacity: capacity too small"):
        RemoteTier(config, LAYOUT)


def test_registry_resolves_remote() -> None:
    assert TierRegistry(load_entry_points=False).resolve("remote") is RemoteTier
    assert RemoteTier.shared and RemoteTier.manages_eviction


@pytest.mark.parametrize("where", ["file", pytest.param("s3", marks=pytest.mark.slow)])
async def test_objects_are_read_into_reused_buffers(
    tmp_path: Path, request: pytest.FixtureRequest, where: str
) -> None:
    ks, srcs = keys(4), payloads(4)
    if where == "s3":  # the body of a GET, piece by piece, into a buffer: no bytes object
        moto_s3 = request.getfixturevalue("moto_s3")
        url, opts = moto_s3.url(), {"storage_options": moto_s3.storage_options()}
    else:
        url, opts = f"file://{tmp_path}/pool", {}
    async with make_tier(url, max_in_flight=2, **opts) as tier:
        await tier.put(ks, srcs)
        out = dsts(4)
        assert await tier.get(ks, out) == [True] * 4
        pooled = list(tier._buffers._free)
        assert 1 <= len(pooled) <= 4  # given back once copied out (at most 2 x in flight)
        assert await tier.get(ks, dsts(4)) == [True] * 4
        assert {id(b) for b in tier._buffers._free} & {id(b) for b in pooled}  # reused
        assert all(np.array_equal(o, s) for o, s in zip(out, srcs, strict=True))
