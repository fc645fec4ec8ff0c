"""Gather and scatter between vLLM's paged layouts and kvtiers' payload layout."""

from __future__ import annotations

import pytest
import torch

from kvtiers import LayoutMismatch
from kvtiers.integrations._vllm_kv import PagedLayout, detect_layout

BS, H, D, NB = 4, 2, 8, 6


def _token_kv(kind: str, layer: torch.Tensor, block: int, offset: int) -> tuple[torch.Tensor, ...]:
    """Return (K, V) of one token, each (heads, head_size), read the obvious way."""
    if kind == "cpu":  # [NB, H, BS, 2D]: per head, rows 0..BS-1 are K, BS..2BS-1 are V
        rows = layer[block].reshape(H, 2 * BS, D)
        return rows[:, offset], rows[:, BS + offset]
    if kind == "flash":  # [2, NB, BS, H, D]
        return layer[0, block, offset], layer[1, block, offset]
    return layer[0, block, :, offset], layer[1, block, :, offset]  # flash_hnd [2, NB, H, BS, D]


def _layer(kind: str) -> torch.Tensor:
    shape = {
        "cpu": (NB, H, BS, 2 * D),
        "flash": (2, NB, BS, H, D),
        "flash_hnd": (2, NB, H, BS, D),
    }[kind]
    return torch.randn(shape).to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["cpu", "flash", "flash_hnd"])
def test_gather_matches_a_per_token_reading(kind):
    layer = _layer(kind)
    paged = detect_layout(
        layer, block_size=BS, num_kv_heads=H, head_size=D, prefer_hnd=kind == "flash_hnd"
    )
    assert paged.kind == kind
    blocks = [4, 1, 3]
    out = torch.empty(2, len(blocks) * BS, H, D, dtype=torch.bfloat16)
    paged.gather(layer, torch.tensor(blocks), out)
    for t in range(len(blocks) * BS):
        k, v = _token_kv(kind, layer, blocks[t // BS], t % BS)
        assert torch.equal(out[0, t], k) and torch.equal(out[1, t], v)


@pytest.mark.parametrize("kind", ["cpu", "flash", "flash_hnd"])
def test_scatter_writes_only_the_given_blocks(kind):
    layer = _layer(kind)
    before = layer.clone()
    paged = detect_layout(
        layer, block_size=BS, num_kv_heads=H, head_size=D, prefer_hnd=kind == "flash_hnd"
    )
    blocks = [2, 5]
    src = torch.randn(2, len(blocks) * BS, H, D).to(torch.bfloat16)
    paged.scatter(layer, torch.tensor(blocks), src)
    for t in range(len(blocks) * BS):
        k, v = _token_kv(kind, layer, blocks[t // BS], t % BS)
        assert torch.equal(k, src[0, t]) and torch.equal(v, src[1, t])
    for b in set(range(NB)) - set(blocks):
        for o in range(BS):
            assert all(
                torch.equal(x, y)
                for x, y in zip(
                    _token_kv(kind, layer, b, o), _token_kv(kind, before, b, o), strict=True
                )
            )


@pytest.mark.parametrize("kind", ["cpu", "flash", "flash_hnd"])
@pytest.mark.parametrize(
    "blocks", [[0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1], [5, 4, 3], [2, 3, 0, 1], [1, 0, 4, 5, 3, 2]]
)
def test_runs_of_consecutive_blocks_move_like_single_blocks(kind, blocks):
    """Blocks in rising or falling runs (as vLLM hands them out) are copied run by run on
    the CPU."""
    layer = _layer(kind)
    paged = detect_layout(
        layer, block_size=BS, num_kv_heads=H, head_size=D, prefer_hnd=kind == "flash_hnd"
    )
    ids = torch.tensor(blocks)
    out = torch.empty(2, len(blocks) * BS, H, D, dtype=torch.bfloat16)
    paged.gather(layer, ids, out)
    for t in range(len(blocks) * BS):
        k, v = _token_kv(kind, layer, blocks[t // BS], t % BS)
        assert torch.equal(out[0, t], k) and torch.equal(out[1, t], v)
    before = layer.clone()
    src = torch.randn(3, 2, len(blocks) * BS, H, D).to(torch.bfloat16)[1]
    paged.scatter(layer, ids, src)
    for t in range(len(blocks) * BS):
        k, v = _token_kv(kind, layer, blocks[t // BS], t % BS)
        assert torch.equal(k, src[0, t]) and torch.equal(v, src[1, t])
    for b in set(range(NB)) - set(blocks):
        assert torch.equal(_token_kv(kind, layer, b, 0)[0], _token_kv(kind, before, b, 0)[0])


def test_scatter_then_gather_round_trips_strided_sources():
    paged = PagedLayout("cpu", NB, BS, H, D)
    layer = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
    big = torch.randn(3, 2, 3 * BS, H, D).to(torch.bfloat16)
    src = big[1, :, BS:]  # a strided view, as a slice of a loaded payload is
    ids = torch.tensor([0, 3])
    paged.scatter(layer, ids, src)
    out = torch.empty(2, 2 * BS, H, D, dtype=torch.bfloat16)
    paged.gather(layer, ids, out)
    assert torch.equal(out, src)


@pytest.mark.parametrize("shape", [(NB, 1, BS, 576), (NB, BS, 576)])
def test_mla_latent_blocks_round_trip_and_only_the_given_blocks_change(shape):
    latent = 576
    layer = torch.randn(shape).to(torch.bfloat16)
    blocks = layer.view(NB, BS, latent)  # the same memory, one latent row per token
    paged = detect_layout(layer, block_size=BS, num_kv_heads=1, head_size=latent, mla=True)
    assert (paged.kind, paged.num_kv_heads) == ("mla", 1)
    out = torch.empty(1, 2 * BS, latent, dtype=torch.bfloat16)
    paged.gather(layer, torch.tensor([4, 1]), out)
    assert torch.equal(out[0], torch.cat([blocks[4], blocks[1]]))
    paged.gather(layer, torch.tensor([2, 3]), out)  # one run of two blocks
    assert torch.equal(out[0], torch.cat([blocks[2], blocks[3]]))
    before = blocks.clone()
    src = torch.randn(3, 1, 3 * BS, latent).to(torch.bfloat16)[1, :, BS:]  # strided
    paged.scatter(layer, torch.tensor([5, 0]), src)
    assert torch.equal(blocks[5], src[0, :BS]) and torch.equal(blocks[0], src[0, BS:])
    assert torch.equal(blocks[1:5], before[1:5])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flash", "flash_hnd", "mla"])
def test_cuda_layers_round_trip_through_host_payloads(kind):
    """On the device vLLM's CUDA backends use: gather to host, scatter back from host."""
    shape = {"flash": (2, NB, BS, H, D), "flash_hnd": (2, NB, H, BS, D), "mla": (NB, 1, BS, 576)}
    heads, size = (1, 576) if kind == "mla" else (H, D)
    layer = torch.randn(shape[kind], device="cuda").to(torch.bfloat16)
    paged = detect_layout(
        layer,
        block_size=BS,
        num_kv_heads=heads,
        head_size=size,
        prefer_hnd=kind == "flash_hnd",
        mla=kind == "mla",
    )
    assert paged.kind == kind
    ids = torch.tensor([4, 1, 3], device="cuda")
    planes = 1 if kind == "mla" else 2
    out = torch.empty(planes, 3 * BS, *(() if kind == "mla" else (H,)), size, dtype=torch.bfloat16)
    paged.gather(layer, ids, out)  # device to host
    copy = torch.zeros_like(layer)
    paged.scatter(copy, ids, out)  # host to device
    view = (lambda t: t.view(NB, BS, size)) if kind == "mla" else (lambda t: t)
    axis = 0 if kind == "mla" else 1  # the block axis
    assert torch.equal(view(copy).index_select(axis, ids), view(layer).index_select(axis, ids))
    untouched = torch.tensor(sorted(set(range(NB)) - set(ids.tolist())), device="cuda")
    assert not view(copy).index_select(axis, untouched).any()


def test_detect_layout_rejects_unknown_and_mismatched_mla_shapes():
    with pytest.raises(LayoutMismatch, match="no known layout"):
        detect_layout(torch.zeros(NB, H, BS, D), block_size=BS, num_kv_heads=H, head_size=D)
    with pytest.raises(LayoutMismatch, match="does not use MLA"):
        detect_layout(torch.zeros(NB, BS, 576), block_size=BS, num_kv_heads=1, head_size=576)
    with pytest.raises(LayoutMismatch, match="latent=576"):
        detect_layout(
            torch.zeros(NB, BS, 512), block_size=BS, num_kv_heads=1, head_size=576, mla=True
        )
    with pytest.raises(LayoutMismatch, match="contiguous"):
        layer = torch.zeros(NB, H, BS, 4 * D)[..., : 2 * D]
        detect_layout(layer, block_size=BS, num_kv_heads=H, head_size=D)
