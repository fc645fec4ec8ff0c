"""TieredCache on an engine's paged KV: store_paged and load_paged through the copy engine.

On this CPU-only suite the paged KV lives on the CPU, where the copy engine's streams and
events are no-ops; the same calls run on CUDA tensors (tests/gpu covers the CUDA side).
"""

from __future__ import annotations

import pytest
import torch

from kvtiers import InvalidInputError, LayoutMismatch, TieredCache
from kvtiers.gpu import PagedKV
from tests.conftest import make_config, small_layout

BLOCK = 8  # engine block size; the test layout's chunk is 16 tokens = 2 blocks


def _engine_kv(num_blocks: int, seed: int, *, zero: bool = False) -> list[torch.Tensor]:
    """Return vLLM-flash-style KV: per layer (2, blocks, block_size, heads, head_size)."""
    layout = small_layout()
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, BLOCK, layout.num_kv_heads, layout.head_size * 2)
    layers = []
    for _ in range(layout.num_layers):
        data = torch.zeros(shape, dtype=torch.uint8)
        if not zero:
            data = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        layers.append(data.view(torch.float16))
    return layers


def _tokens_of(engine_kv: list[torch.Tensor], table: list[int]) -> torch.Tensor:
    """Return the KV of a request's blocks, token order, as (layers, 2, tokens, H, D)."""
    per_layer = [layer[:, table].flatten(1, 2) for layer in engine_kv]
    return torch.stack(per_layer)


@pytest.mark.parametrize("lmdb_chunks", [None, 64], ids=["dram", "dram+lmdb"])
async def test_paged_round_trip_into_other_blocks(tmp_path, lmdb_chunks):
    src = _engine_kv(num_blocks=16, seed=1)
    dst = _engine_kv(num_blocks=16, seed=0, zero=True)
    tokens = list(range(48))  # 3 chunks = 6 engine blocks
    src_table = [3, 9, 0, 12, 5, 7]
    dst_table = [15, 1, 4, 2, 11, 6]
    cfg = make_config(tmp_path, dram_chunks=2, lmdb_chunks=lmdb_chunks)
    async with TieredCache.from_config(cfg) as cache:
        stored = await cache.store_paged(tokens, PagedKV.vllm_flash(src), src_table)
        want = 48 if lmdb_chunks else 32  # DRAM holds 2 of the 3 chunks; LMDB holds all
        assert stored == want  # a chunk no tier took is not counted as stored
        await cache.flush()
        assert await cache.lookup(tokens) == want
        loaded = await cache.load_paged(tokens, PagedKV.vllm_flash(dst), dst_table)
        assert loaded == want
        blocks = want // BLOCK
        got = _tokens_of(dst, dst_table[:blocks]).view(torch.uint8)
        assert torch.equal(got, _tokens_of(src, src_table[:blocks]).view(torch.uint8))
        # blocks outside the table are untouched
        others = [b for b in range(16) if b not in dst_table]
        assert not _tokens_of(dst, others).view(torch.uint8).any()
        # the tensor API sees the same bytes
        kv = await cache.load(tokens)
        assert torch.equal(kv.view(torch.uint8), got[:, :, : kv.shape[2]])
        assert cache.pin_count() == 0


async def test_paged_bad_input_writes_nothing(tmp_path):
    src = _engine_kv(num_blocks=4, seed=1)
    async with TieredCache.from_config(make_config()) as cache:
        with pytest.raises(InvalidInputError):
            await cache.store_paged(list(range(32)), PagedKV.vllm_flash(src), [0, 1, 2, 99])
        with pytest.raises(InvalidInputError):
            await cache.store_paged(list(range(32)), PagedKV.vllm_flash(src), [0, 1])
        wrong = [layer.float() for layer in src]
        with pytest.raises(LayoutMismatch):
            await cache.store_paged(list(range(32)), PagedKV.vllm_flash(wrong), [0, 1, 2, 3])
        assert cache.tiers[0].usage().num_entries == 0
        assert await cache.lookup(list(range(32))) == 0
        assert cache.pin_count() == 0
