"""`PagedKV`: the engine layouts, their checks against a layout, and payload views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtiers.core.errors import InvalidInputError, LayoutMismatch
from kvtiers.gpu import PagedKV, payload_tensor
from kvtiers.gpu._kernels import plan_batch
from kvtiers.gpu.paged import unit_width

from ._factories import KINDS, make_layout, make_paged


@pytest.mark.parametrize("kind", KINDS)
def test_geometry_of_each_layout(kind: str) -> None:
    layout = make_layout(kind, num_layers=3)
    paged = make_paged(kind, layout, 10, 16)
    paged.check_layout(layout)
    assert (paged.num_layers, paged.num_blocks, paged.block_size) == (3, 10, 16)
    assert (paged.num_kv_heads, paged.head_size) == (layout.num_kv_heads, layout.head_size)
    assert paged.num_kv == layout.num_kv and paged.dtype == torch.bfloat16
    assert paged.block_bytes == 16 * layout.num_kv_heads * layout.head_size * 2
    assert paged.unit_width == 8
    # One kernel per layer where one view spans every plane; per plane otherwise.
    has_combined = kind in ("vllm_flash", "mla")
    assert (paged.combined_rows(0, 8) is not None) is has_combined


def test_rows_are_views_of_the_engine_tensors() -> None:
    layout = make_layout("sglang_mha")
    paged = make_paged("sglang_mha", layout, 4, 16, zero=True)
    k_rows, v_rows = paged.rows(1, 2)
    v_rows[3] = -1  # every byte set
    k, v = paged.layers[1]
    assert not k.view(torch.uint8).any()
    assert bool((v.view(torch.uint8)[48:64] != 0).all()) and not v[:48].view(torch.uint8).any()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kind": "mla"}, "kind"),
        ({"num_layers": 3}, "num_layers"),
        ({"dtype": "float16"}, "dtype"),
        ({"num_kv_heads": 4}, "num_kv_heads"),
        ({"head_size": 16}, "head_size"),
        ({"chunk_size": 24}, "block_size"),
    ],
)
def test_check_layout_names_what_differs(changes: dict[str, object], field: str) -> None:
    paged = make_paged("vllm_flash", make_layout("vllm_flash"), 4, 16)
    changes = dict(changes)
    other = make_layout(str(changes.pop("kind", "vllm_flash")), **changes)
    with pytest.raises(LayoutMismatch, match=field):
        paged.check_layout(other)


def test_bad_engine_tensors_are_rejected() -> None:
    bf16 = torch.bfloat16
    with pytest.raises(LayoutMismatch, match="expected per layer"):
        PagedKV.vllm_flash([torch.zeros(4, 16, 2, 8, dtype=bf16)])
    with pytest.raises(LayoutMismatch, match="not \\(2, blocks"):
        PagedKV("vllm_flash", (torch.zeros(3, 4, 16, 2, 8, dtype=bf16),), 16)
    with pytest.raises(LayoutMismatch, match="dtype"):
        PagedKV.mla([torch.zeros(4, 16, 8, dtype=bf16), torch.zeros(4, 16, 8)])
    with pytest.raises(LayoutMismatch, match="shape"):
        PagedKV.mla([torch.zeros(4, 16, 8), torch.zeros(5, 16, 8)])
    with pytest.raises(LayoutMismatch, match="2 K buffers but 1"):
        PagedKV.sglang_mha([torch.zeros(32, 2, 8)] * 2, [torch.zeros(32, 2, 8)], 16)
    with pytest.raises(LayoutMismatch, match="multiple of block_size"):
        PagedKV.sglang_mha([torch.zeros(40, 2, 8)], [torch.zeros(40, 2, 8)], 16)
    with pytest.raises(LayoutMismatch, match="contiguous"):
        # heads and tokens swapped inside each block: a block is no longer one range
        PagedKV.mla([torch.zeros(4, 8, 16).transpose(1, 2)])
    with pytest.raises(InvalidInputError, match="kind"):
        PagedKV("paged_attention", (torch.zeros(4, 16, 8),), 16)
    with pytest.raises(InvalidInputError, match="block_size"):
        PagedKV("mla", (torch.zeros(4, 16, 8),), 0)
    with pytest.raises(InvalidInputError, match="no layers"):
        PagedKV("mla", (), 16)


def test_plan_maps_chunks_to_their_blocks() -> None:
    layout = make_layout("vllm_flash", chunk_size=64)
    paged = make_paged("vllm_flash", layout, 12, 16)
    table = np.array([11, 3, 5, 7, 0, 1, 2, 4, 6, 8, 9, 10])
    plan = plan_batch(paged, layout, table, [2, 0], unique=True)
    assert plan.block_ids.tolist() == [[6, 8, 9, 10], [11, 3, 5, 7]]
    assert plan.combined_ids[0].tolist() == [[6, 8, 9, 10], [18, 20, 21, 22]]
    empty = plan_batch(paged, layout, torch.tensor(table), [], unique=True)
    assert empty.num_chunks == 0 and empty.blocks_per_chunk == 4


def test_payload_tensor_views_block_bytes() -> None:
    layout = make_layout("vllm_flash", dtype="float8_e4m3fn")
    buf = np.zeros(2 * layout.chunk_bytes, dtype=np.uint8)
    payload = payload_tensor(layout, buf[layout.chunk_bytes :])
    assert tuple(payload.shape) == layout.chunk_shape() and payload.dtype == torch.float8_e4m3fn
    payload.view(torch.uint8)[0, 0, 0, 0, 0] = 9
    assert buf[layout.chunk_bytes] == 9
    device_view = torch.zeros(layout.chunk_bytes, dtype=torch.uint8)
    assert payload_tensor(layout, device_view).data_ptr() == device_view.data_ptr()
    with pytest.raises(InvalidInputError, match="uint8 bytes"):
        payload_tensor(layout, buf[:-1])
    with pytest.raises(InvalidInputError, match="contiguous"):
        payload_tensor(layout, np.zeros(2 * layout.chunk_bytes, dtype=np.uint8)[::2])


def test_unit_width() -> None:
    assert unit_width([64, 128, 4096]) == 8
    assert unit_width([64, 12]) == 4
    assert unit_width([64, 6]) == 2
    assert unit_width([63]) == 1
