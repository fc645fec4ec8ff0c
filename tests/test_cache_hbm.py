"""TieredCache with an HBM tier on top: device blocks in the cascade.

The HBM tier runs on `device = "cpu"` here (its documented test seam): its blocks are torch
tensors rather than host NumPy views, which is what the cascade must handle; the same
tests run with `cuda:0` where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from kvtiers import TieredCache
from kvtiers.gpu import PagedKV
from tests.conftest import make_config, make_kv, same_bytes
from tests.test_cache_paged import BLOCK, _engine_kv, _tokens_of

DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


def _hbm_config(tmp_path, device, *, hbm_chunks=3, write_policy="write_back"):
    cfg = make_config(tmp_path, dram_chunks=4, lmdb_chunks=100)
    chunk_bytes = 2048
    cfg["tiers"][0]["write_policy"] = write_policy  # dram, below hbm
    cfg["tiers"].insert(0, {"kind": "hbm", "capacity": hbm_chunks * chunk_bytes, "device": device})
    return cfg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
async def test_hbm_dram_lmdb_round_trip(tmp_path, layout, device, write_policy):
    convs = [([c * 1000 + t for t in range(48)], make_kv(layout, 48, seed=c)) for c in range(6)]
    async with TieredCache.from_config(
        _hbm_config(tmp_path, device, write_policy=write_policy)
    ) as cache:
        for tokens, kv in convs:
            assert await cache.store(tokens, kv) == 48
        await cache.flush()
        for tokens, kv in convs:
            assert await cache.lookup(tokens) == 48
            assert same_bytes(await cache.load(tokens), kv)
        hbm, dram, disk = cache.stats().tiers
        assert hbm.evictions > 0 and hbm.promotions > 0
        assert hbm.usage.num_entries <= 3
        if write_policy == "write_back":
            assert dram.demotions > 0
        assert cache.pin_count() == 0


@pytest.mark.parametrize("device", DEVICES)
async def test_hbm_paged_round_trip(tmp_path, device):
    src = [t.to(device) for t in _engine_kv(num_blocks=16, seed=3)]
    dst = [t.to(device) for t in _engine_kv(num_blocks=16, seed=0, zero=True)]
    tokens = list(range(32))
    async with TieredCache.from_config(_hbm_config(tmp_path, device)) as cache:
        assert await cache.store_paged(tokens, PagedKV.vllm_flash(src), [4, 5, 9, 1]) == 32
        assert await cache.load_paged(tokens, PagedKV.vllm_flash(dst), [0, 2, 3, 7]) == 32
        got = _tokens_of([t.cpu() for t in dst], [0, 2, 3, 7])
        want = _tokens_of([t.cpu() for t in src], [4, 5, 9, 1])
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        await cache.flush()  # write-through to LMDB holds pins while it copies
        assert cache.pin_count() == 0
    assert BLOCK == 8


@pytest.mark.parametrize("device", DEVICES)
async def test_promotions_into_hbm_reuse_one_host_stage(tmp_path, layout, device):
    # Each load promotes a prompt from LMDB into HBM blocks (evicting the other one), through
    # host memory: a reused stage, not fresh memory whose pages fault in on every load.
    prompts = [[c * 1000 + t for t in range(48)] for c in range(2)]
    kvs = [make_kv(layout, 48, seed=c) for c in range(2)]
    async with TieredCache.from_config(_hbm_config(tmp_path, device)) as cache:
        for tokens, kv in zip(prompts, kvs, strict=True):
            assert await cache.store(tokens, kv) == 48
        await cache.flush()
        stages = cache._mover._stages
        taken: list[int] = []
        take = stages.take

        def recording(count: int):
            context = take(count)
            taken.append(0)
            return _Recorded(context, taken)

        stages.take = recording  # type: ignore[method-assign]
        for i in range(4):
            tokens, kv = prompts[i % 2], kvs[i % 2]
            assert same_bytes(await cache.load(tokens), kv)
        assert cache.stats().tiers[0].promotions >= 4
        assert len(taken) >= 4 and len(set(taken)) == 1  # one buffer, every time


class _Recorded:
    """Wrap a stage's context manager; record the address of the buffer it yields."""

    def __init__(self, context, taken: list[int]) -> None:
        self._context, self._taken = context, taken

    def __enter__(self):
        buf = self._context.__enter__()
        self._taken[-1] = buf.__array_interface__["data"][0]
        return buf

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)
