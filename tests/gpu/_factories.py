"""Factories for the GPU-path tests: layouts, random paged KV, and a reference gather."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtiers.core.config import TierConfig
from kvtiers.core.layout import KVLayout
from kvtiers.gpu.paged import PagedKV
from kvtiers.gpu.pinned import pinned_allocator
from kvtiers.tiers.dram import DRAMTier

KINDS = ("vllm_flash", "vllm_flash_strided", "sglang_mha", "mla")
"""Engine layouts under test; `vllm_flash_strided` keeps K and V of a block side by side
(FlashInfer's `(blocks, 2, ...)` order seen through a transpose), so blocks are strided."""

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
"""The devices every device-generic test runs on; CUDA only where present."""

SENTINEL = 0xAB


def make_layout(
    kind: str,
    dtype: str = "bfloat16",
    chunk_size: int = 32,
    num_layers: int = 2,
    **changes: Any,
) -> KVLayout:
    """Return a small layout matching an engine layout `kind`, with `changes` applied."""
    fields: dict[str, Any] = {
        "model": "m",
        "num_layers": num_layers,
        "num_kv_heads": 2,
        "head_size": 8,
        "dtype": dtype,
        "chunk_size": chunk_size,
    }
    if kind == "mla":
        fields.update(num_kv_heads=1, head_size=16, kind="mla")
    return KVLayout(**{**fields, **changes})


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu"
) -> torch.Tensor:
    """Return a tensor of random bytes (NaN and fp8 bit patterns included)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=gen)
    return raw.to(torch.uint8).view(dtype).to(device)


def make_paged(
    kind: str,
    layout: KVLayout,
    num_blocks: int,
    block_size: int,
    *,
    device: str = "cpu",
    seed: int = 0,
    zero: bool = False,
) -> PagedKV:
    """Return paged KV of `kind` for `layout`, random (or zero) bytes."""
    dtype = getattr(torch, layout.dtype)
    heads, dim = layout.num_kv_heads, layout.head_size

    def new(shape: tuple[int, ...], i: int) -> torch.Tensor:
        if zero:
            return torch.zeros(shape, dtype=dtype, device=device)
        return random_tensor(shape, dtype, seed * 1000 + i, device)

    num = layout.num_layers
    if kind == "vllm_flash":
        return PagedKV.vllm_flash(
            [new((2, num_blocks, block_size, heads, dim), i) for i in range(num)]
        )
    if kind == "vllm_flash_strided":
        layers = [
            new((num_blocks, 2, block_size, heads, dim), i).transpose(0, 1) for i in range(num)
        ]
        return PagedKV.vllm_flash(layers)
    if kind == "sglang_mha":
        tokens = num_blocks * block_size
        ks = [new((tokens, heads, dim), 2 * i) for i in range(num)]
        vs = [new((tokens, heads, dim), 2 * i + 1) for i in range(num)]
        return PagedKV.sglang_mha(ks, vs, block_size)
    return PagedKV.mla([new((num_blocks, block_size, dim), i) for i in range(num)])


def planes(paged: PagedKV, layer: int) -> list[torch.Tensor]:
    """Return a layer's planes as `(blocks, block_size, ...)`, straight from the tensors."""
    kv = paged.layers[layer]
    if paged.kind == "sglang_mha":
        assert isinstance(kv, tuple)
        return [t.view(paged.num_blocks, paged.block_size, *t.shape[1:]) for t in kv]
    assert isinstance(kv, torch.Tensor)
    return [kv] if paged.kind == "mla" else [kv[0], kv[1]]


def reference_chunk(
    paged: PagedKV, layout: KVLayout, block_table: torch.Tensor, chunk_idx: int
) -> torch.Tensor:
    """Return chunk `chunk_idx`'s payload, gathered token by token (as raw bytes)."""
    tokens = torch.arange(chunk_idx * layout.chunk_size, (chunk_idx + 1) * layout.chunk_size)
    blocks = block_table.cpu()[tokens // paged.block_size]
    slots = tokens % paged.block_size
    out = [
        torch.stack([p.cpu()[blocks, slots] for p in planes(paged, layer)])
        for layer in range(paged.num_layers)
    ]
    return torch.stack(out).view(torch.uint8)


def paged_bytes(paged: PagedKV) -> list[torch.Tensor]:
    """Return a CPU copy of every plane's raw bytes, to compare before and after."""
    return [
        p.cpu().contiguous().view(torch.uint8).clone()
        for layer in range(paged.num_layers)
        for p in planes(paged, layer)
    ]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return whether two tensors hold the same bytes."""
    return torch.equal(
        a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8)
    )


def block_table(num_blocks: int, num: int, seed: int) -> torch.Tensor:
    """Return `num` distinct random block ids below `num_blocks`."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:num]


def dram_tier(layout: KVLayout, num_chunks: int, device: str) -> DRAMTier:
    """Return an unopened DRAM tier, its buffer pinned when the test runs on CUDA."""
    allocate = pinned_allocator() if device == "cuda" else None
    return DRAMTier(TierConfig("dram", num_chunks * layout.chunk_bytes), layout, allocate)


def sentinel_payloads(layout: KVLayout, num: int, device: str = "cpu") -> list[torch.Tensor]:
    """Return `num` payload tensors filled with a sentinel byte."""
    dtype = getattr(torch, layout.dtype)
    return [
        torch.full((layout.chunk_bytes,), SENTINEL, dtype=torch.uint8, device=device)
        .view(dtype)
        .view(layout.chunk_shape())
        for _ in range(num)
    ]


def is_sentinel(t: torch.Tensor) -> bool:
    """Return whether a tensor still holds only the sentinel byte."""
    return bool((t.cpu().contiguous().view(torch.uint8) == SENTINEL).all())


__all__ = [
    "DEVICES",
    "KINDS",
    "SENTINEL",
    "block_table",
    "dram_tier",
    "is_sentinel",
    "make_layout",
    "make_paged",
    "paged_bytes",
    "planes",
    "random_tensor",
    "reference_chunk",
    "same",
    "sentinel_payloads",
]
