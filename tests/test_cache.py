"""TieredCache on a DRAM tier: round trips, prefix semantics, eviction, pins, bad input."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import kvtiers
import kvtiers.tiers
from kvtiers import (
    CacheStateError,
    ConfigError,
    LayoutMismatch,
    TieredCache,
    TokenError,
)
from tests.conftest import make_config, make_kv, same_bytes, small_layout


async def test_round_trip_is_bit_identical(layout):
    tokens = list(range(100))  # 6 full chunks of 16, a tail of 4
    kv = make_kv(layout, 100)
    async with TieredCache.from_config(make_config()) as cache:
        assert await cache.store(tokens, kv) == 96
        assert await cache.lookup(tokens) == 96
        out = await cache.load(tokens)
        assert out.shape == layout.kv_shape(96)
        assert same_bytes(out, kv[:, :, :96])


@pytest.mark.parametrize(
    "as_input",
    [list, tuple, np.array, lambda t: np.array(t, dtype=np.int32), torch.tensor],
    ids=["list", "tuple", "int64-array", "int32-array", "tensor"],
)
async def test_token_types_give_the_same_keys(layout, as_input):
    tokens = list(range(40))
    kv = make_kv(layout, 40)
    async with TieredCache.from_config(make_config()) as cache:
        await cache.store(tokens, kv)
        assert await cache.lookup(as_input(tokens)) == 32
        assert same_bytes(await cache.load(as_input(tokens)), kv[:, :, :32])


async def test_load_fills_out_and_returns_a_view(layout):
    tokens = list(range(64))
    kv = make_kv(layout, 64)
    out = torch.zeros(layout.kv_shape(80), dtype=torch.float16)
    async with TieredCache.from_config(make_config()) as cache:
        await cache.store(tokens, kv)
        got = await cache.load(tokens, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert same_bytes(out[:, :, :64], kv)
        assert not out[:, :, 64:].any()


async def test_store_takes_strided_kv(layout):
    base = make_kv(layout, 64)
    strided = base.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not strided.is_contiguous()
    async with TieredCache.from_config(make_config()) as cache:
        await cache.store(list(range(64)), strided)
        assert same_bytes(await cache.load(list(range(64))), base)


async def test_prefix_semantics(layout):
    kv = make_kv(layout, 64)
    async with TieredCache.from_config(make_config()) as cache:
        await cache.store(list(range(64)), kv)
        longer = list(range(64)) + [999] * 40
        assert await cache.lookup(longer) == 64
        diverged = list(range(20)) + [7] * 44  # differs inside chunk 1
        assert await cache.lookup(diverged) == 16
        assert await cache.lookup([5] * 64) == 0
        assert await cache.lookup(list(range(10))) == 0  # no full chunk
        assert (await cache.load([5] * 64)).shape[2] == 0


async def test_store_counts_only_new_chunks(layout):
    kv = make_kv(layout, 64)
    async with TieredCache.from_config(make_config()) as cache:
        assert await cache.store(list(range(32)), kv[:, :, :32]) == 32
        assert await cache.store(list(range(64)), kv) == 32
        assert await cache.store(list(range(64)), kv) == 0
        stats = cache.stats()
        assert stats.stores == 3 and stats.stored_tokens == 64


async def test_salt_isolates_tenants(layout):
    kv = make_kv(layout, 32)
    async with TieredCache.from_config(make_config()) as cache:
        await cache.store(list(range(32)), kv, salt="tenant-a")
        assert await cache.lookup(list(range(32)), salt="tenant-a") == 32
        assert await cache.lookup(list(range(32)), salt="tenant-b") == 0
        assert await cache.lookup(list(range(32))) == 0


@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_capacity_respected_and_leaf_first(layout, eviction):
    cfg = make_config(dram_chunks=8, eviction=eviction)
    async with TieredCache.from_config(cfg) as cache:
        dram = cache.tiers[0]
        for conv in range(10):
            tokens = [conv * 1000 + t for t in range(80)]  # 5 chunks each
            await cache.store(tokens, make_kv(layout, 80, seed=conv))
            usage = dram.usage()
            assert usage.used_bytes <= usage.capacity_bytes
            assert usage.num_entries <= 8
            # no suffix without its prefix in DRAM
            keys = cache.keys(tokens)
            resident = await dram.contains(keys)
            assert resident == sorted(resident, reverse=True)
        assert dram.stats().evictions > 0
        assert cache.pin_count() == 0


async def test_evicted_chunks_are_misses_not_garbage(layout):
    async with TieredCache.from_config(make_config(dram_chunks=4)) as cache:
        kvs = {}
        for conv in range(6):
            tokens = [conv * 1000 + t for t in range(32)]
            kvs[conv] = (tokens, make_kv(layout, 32, seed=conv))
            await cache.store(*kvs[conv])
        for tokens, kv in kvs.values():
            n = await cache.lookup(tokens)
            got = await cache.load(tokens[:n])
            assert same_bytes(got, kv[:, :, :n])


async def test_bad_input_is_typed_and_changes_nothing(layout):
    tokens = list(range(32))
    kv = make_kv(layout, 32)
    async with TieredCache.from_config(make_config()) as cache:
        await cache.store(tokens, kv)
        before = cache.stats().tiers[0]
        other = list(range(100, 132))
        with pytest.raises(LayoutMismatch, match="dtype"):
            await cache.store(other, kv.float())
        with pytest.raises(LayoutMismatch, match="tokens"):
            await cache.store(list(range(100, 148)), kv)  # 48 tokens, KV of 32
        with pytest.raises(LayoutMismatch, match="shape"):
            await cache.store(other, kv[:1])
        with pytest.raises(LayoutMismatch):
            await cache.store(other, kv.numpy())
        with pytest.raises(TokenError, match="non-negative"):
            await cache.store([-1] + other[1:], kv)
        with pytest.raises(TokenError):
            await cache.store([0.5] * 32, kv)
        with pytest.raises(TokenError):
            await cache.lookup(np.zeros((2, 16), dtype=np.int64))
        with pytest.raises(TokenError):
            await cache.lookup(torch.zeros(32))
        with pytest.raises(LayoutMismatch, match="room"):
            await cache.load(tokens, out=torch.empty(layout.kv_shape(16), dtype=torch.float16))
        with pytest.raises(LayoutMismatch, match="dtype"):
            await cache.load(tokens, out=torch.empty(layout.kv_shape(32)))
        assert cache.stats().tiers[0] == before
        assert same_bytes(await cache.load(tokens), kv)
        assert await cache.lookup(other) == 0


async def test_tensors_without_plain_memory_are_refused(layout):
    tokens = list(range(32))
    kv = make_kv(layout, 32)
    async with TieredCache.from_config(make_config()) as cache:
        await cache.store(tokens, kv)
        ids = torch.arange(32)
        for bad in (ids.to_sparse(), ids.to("meta"), np.ma.masked_all(32, np.int64)):
            with pytest.raises(TokenError):
                await cache.lookup(bad)
        for bad in (kv.to_sparse(), kv.to("meta")):
            with pytest.raises(LayoutMismatch, match="kv: expected a dense tensor"):
                await cache.store(list(range(100, 132)), bad)
        shape = layout.kv_shape(32)
        outs = {
            "dense tensor": torch.empty(shape, dtype=kv.dtype, device="meta"),
            "grad": torch.empty(shape, dtype=kv.dtype).requires_grad_(),
            "overlap": torch.empty(*shape[:2], 1, *shape[3:], dtype=kv.dtype).expand(shape),
        }
        for match, out in outs.items():
            with pytest.raises(LayoutMismatch, match=f"out: .*{match}"):
                await cache.load(tokens, out=out)
        keys = cache.keys(tokens)
        grad = [torch.empty(layout.chunk_shape(), dtype=kv.dtype).requires_grad_()]
        frozen = np.zeros(layout.chunk_bytes, np.uint8)
        frozen.flags.writeable = False
        for dsts, match in ((grad, "requires grad"), ([frozen], "read-only")):
            with pytest.raises(LayoutMismatch, match=match):
                await cache.get_chunks(keys[:1], dsts)
        with pytest.raises(kvtiers.InvalidInputError, match="paged: expected a PagedKV"):
            await cache.store_paged(tokens, None, [[0]])
        with pytest.raises(kvtiers.InvalidInputError, match="other: expected a TieredCache"):
            cache.serve_metrics_of(None)
        assert same_bytes(await cache.load(tokens), kv)


async def test_cancelled_loads_and_stores_leave_no_pins(layout):
    cfg = make_config(dram_chunks=16)
    async with TieredCache.from_config(cfg) as cache:

        async def worker(i: int) -> None:
            tokens = [i % 5 * 1000 + t for t in range(64)]
            kv = make_kv(layout, 64, seed=i % 5)
            for _ in range(50):
                await cache.store(tokens, kv)
                n = await cache.lookup(tokens)
                got = await cache.load(tokens[:n])
                assert same_bytes(got, kv[:, :, : got.shape[2]])
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(worker(i)) for i in range(20)]
        await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert cache.pin_count() == 0
        dram = cache.tiers[0]
        assert dram.usage().num_entries + dram.num_free_chunks == dram.num_chunks


async def test_lifecycle():
    cache = TieredCache.from_config(make_config())
    with pytest.raises(CacheStateError):
        await cache.lookup([1, 2, 3])
    async with cache:
        with pytest.raises(CacheStateError):
            await cache.open()
    await cache.close()  # idempotent
    with pytest.raises(CacheStateError):
        await cache.lookup([1, 2, 3])
    with pytest.raises(CacheStateError):
        await cache.open()


def test_config_errors_name_the_field():
    cfg = make_config()
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.kind: unknown tier kind 'tape'"):
        TieredCache.from_config({**cfg, "tiers": [{"kind": "tape", "capacity": "1GiB"}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: .* too small for one chunk"):
        TieredCache.from_config({**cfg, "tiers": [{"kind": "dram", "capacity": 100}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.eviction"):
        TieredCache.from_config(
            {**cfg, "tiers": [{"kind": "dram", "capacity": "1MiB", "eviction": "mru"}]}
        )
    with pytest.raises(ConfigError, match="layout"):
        TieredCache.from_config({"tiers": cfg["tiers"]})
    with pytest.raises(ConfigError, match="config: expected a CacheConfig, got dict"):
        TieredCache(cfg)
    with pytest.raises(ConfigError, match="layout: expected a KVLayout, got str"):
        TieredCache.from_config(cfg, layout="x")
    with pytest.raises(ConfigError, match="registry: expected a TierRegistry, got str"):
        TieredCache.from_config(cfg, registry="x")


def test_tier_errors_from_a_file_name_the_file(tmp_path):
    path = tmp_path / "tiers.toml"
    path.write_text('[[tiers]]\nkind = "dram"\ncapacity = "1MiB"\neviction = "mru"\n')
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.eviction: .*\(in .*tiers\.toml\)$"):
        TieredCache.from_config(path, layout=small_layout())


def test_check_tiers_checks_a_config_without_a_layout_and_opens_nothing(tmp_path):
    lmdb = {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "1MiB"}
    good = {"tiers": [{"kind": "dram", "capacity": "1MiB"}, lmdb]}
    assert TieredCache.check_tiers(good).tiers[1].kind == "lmdb"
    assert not (tmp_path / "lmdb").exists()
    for bad, field in (
        ({"tiers": [{"kind": "dram", "capacity": "1MiB", "bogus": 1}]}, r"tiers\[0\]\.bogus"),
        ({"tiers": [{"kind": "tape", "capacity": "1MiB"}]}, r"tiers\[0\]\.kind"),
        ({"tiers": [good["tiers"][0], {**lmdb, "eviction": "arc"}]}, r"tiers\[1\]\.eviction"),
        ({"tiers": [{"kind": "dram", "capacity": "1MiB", "eviction": "mru"}]}, "eviction"),
    ):
        with pytest.raises(ConfigError, match=field):
            TieredCache.check_tiers(bad)
    path = tmp_path / "t.toml"
    path.write_text('[[tiers]]\nkind = "dram"\ncapacity = "1MiB"\nbogus = 1\n')
    with pytest.raises(ConfigError, match=r"\(in .*t\.toml\)$"):
        TieredCache.check_tiers(path)


async def test_layout_given_by_an_adapter(layout):
    cfg = make_config()
    del cfg["layout"]
    async with TieredCache.from_config(cfg, layout=small_layout(chunk_size=32)) as cache:
        assert cache.layout.chunk_size == 32


async def test_stats_report_hits_and_bandwidth(layout):
    async with TieredCache.from_config(make_config()) as cache:
        await cache.store(list(range(64)), make_kv(layout, 64))
        await cache.lookup(list(range(64)) + [1] * 36)
        await cache.load(list(range(64)))
        stats = cache.stats()
        assert isinstance(stats, kvtiers.CacheStats)
        assert stats.hit_rate == pytest.approx(0.64)
        assert stats.tiers[0].hits == 4
        assert stats.loaded_bytes == 4 * layout.chunk_bytes
        assert stats.load_bandwidth > 0


async def test_mla_layout_round_trip():
    layout = small_layout(kind="mla", num_kv_heads=1, head_size=32)
    cfg = make_config(layout={"kind": "mla", "num_kv_heads": 1, "head_size": 32})
    kv = make_kv(layout, 48)
    assert kv.shape == (2, 1, 48, 32)
    async with TieredCache.from_config(cfg) as cache:
        await cache.store(list(range(48)), kv)
        assert same_bytes(await cache.load(list(range(48))), kv)


async def test_prefetch_reports_the_prefix(layout):
    async with TieredCache.from_config(make_config()) as cache:
        await cache.store(list(range(64)), make_kv(layout, 64))
        assert await cache.prefetch(list(range(64)) + [3] * 16) == 64


class _BrokenTier(kvtiers.tiers.Tier):
    """A shared tier whose backend fails with raw errors, as a buggy plugin might."""

    kind = "broken"
    shared = True
    manages_eviction = True

    async def contains(self, keys):
        raise OSError("backend down")

    async def get(self, keys, dsts):
        raise OSError("backend down")

    async def put(self, keys, srcs):
        raise OSError("backend down")

    async def delete(self, keys):
        raise OSError("backend down")

    def usage(self):
        return kvtiers.TierUsage(self.capacity_bytes, 0, 0)


async def test_a_failing_tier_is_a_counted_miss_never_an_error(layout):
    registry = kvtiers.tiers.TierRegistry(load_entry_points=False)
    registry.register("broken", _BrokenTier)
    cfg = make_config(dram_chunks=2)
    cfg["tiers"].append({"kind": "broken", "capacity": "1MiB"})
    kv = make_kv(layout, 64)
    async with TieredCache.from_config(cfg, registry=registry) as cache:
        await cache.store(list(range(64)), kv)  # 4 chunks, DRAM holds 2
        await cache.flush()
        # DRAM took the first two chunks; the broken tier declined the rest.
        assert await cache.lookup(list(range(64))) == 32
        assert same_bytes(await cache.load(list(range(64))), kv[:, :, :32])
        assert cache.stats().tiers[1].errors > 0


@pytest.mark.parametrize("threads", [1, 2, 3])
async def test_large_host_copies_are_exact_on_any_number_of_threads(threads):
    # 1 MiB chunks: a batch of 12 is past the size from which copies use several threads.
    big = {"num_layers": 8, "num_kv_heads": 4, "head_size": 64, "chunk_size": 256}
    layout = small_layout(**big)
    config = {**make_config(dram_chunks=40, layout=big), "copy_threads": threads}
    tokens = list(range(12 * 256))
    kv = make_kv(layout, len(tokens)).transpose(3, 4).contiguous().transpose(3, 4)  # strided
    out = torch.zeros(layout.kv_shape(len(tokens)), dtype=kv.dtype)
    async with TieredCache.from_config(config) as cache:
        assert await cache.store(tokens, kv) == len(tokens)
        assert (await cache.load(tokens, out=out)).data_ptr() == out.data_ptr()
        assert same_bytes(out, kv)
        keys = cache.chunk_keys([f"page-{i}".encode() for i in range(12)])
        chunks = [kv.narrow(2, i * 256, 256).contiguous() for i in range(12)]
        assert await cache.put_chunks(keys, chunks) == [True] * 12
        got = [torch.empty_like(chunk) for chunk in chunks]
        assert await cache.get_chunks(keys, got) == [True] * 12
        assert all(same_bytes(a, b) for a, b in zip(got, chunks, strict=True))


async def test_tensors_with_a_strided_last_axis_are_copied_in_one_batch(layout, monkeypatch):
    # Neither `kv` nor `out` can be seen as host bytes (their last axis is strided), so
    # their chunks go through the device-copy path: one batch per call, exact.
    import kvtiers._endpoints as endpoints

    batches: list[int] = []
    copy_pairs = endpoints.copy_pairs

    async def counting(stream, pairs, host_copy):
        batches.append(len(pairs))
        await copy_pairs(stream, pairs, host_copy)

    monkeypatch.setattr(endpoints, "copy_pairs", counting)
    tokens = list(range(4 * layout.chunk_size))
    kv = make_kv(layout, len(tokens)).transpose(3, 4).contiguous().transpose(3, 4)
    out = torch.zeros_like(kv).transpose(3, 4).contiguous().transpose(3, 4)
    async with TieredCache.from_config(make_config()) as cache:
        assert await cache.store(tokens, kv) == len(tokens)
        assert (await cache.load(tokens, out=out)).shape[2] == len(tokens)
    assert same_bytes(out, kv)
    assert batches == [4, 4]


@pytest.mark.gpu
async def test_gpu_kv_moves_through_pinned_dram_in_one_batch_per_call(layout):
    # DRAM on top, the caller's KV on the GPU: chunks cross in one batch on a side stream,
    # ordered after the kernels that produced `kv` (queued on the current stream).
    tokens = list(range(4 * layout.chunk_size))
    want = make_kv(layout, len(tokens))
    kv = torch.zeros_like(want, device="cuda")
    kv.add_(want.cuda())  # still queued on the current stream when store starts
    out = torch.full_like(kv, 7)
    async with TieredCache.from_config(make_config()) as cache:
        assert await cache.store(tokens, kv) == len(tokens)
        assert (await cache.load(tokens, out=out)).shape[2] == len(tokens)
    assert same_bytes(out.cpu(), want)
