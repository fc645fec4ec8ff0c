"""Page maps of SGLang host pools: the error paths, without SGLang installed.

The pools here are stand-ins with the attributes `layout_of` and `PageMap` read (the real
`MHATokenToKVPoolHost`/`MLATokenToKVPoolHost` run in `test_sglang.py`, in SGLang's own
virtualenv); they keep these checks in the fast suite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvtiers import ConfigError
from kvtiers.integrations._sglang_pages import PageMap, layout_of, pool_pages


@dataclass
class StandInMHAPool:
    layout: str = "layer_first"
    layer_num: int = 2
    head_num: int = 2
    head_dim: int = 8
    v_head_dim: int = 8
    page_size: int = 4
    dtype: torch.dtype = torch.float16
    kv_buffer: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.kv_buffer = torch.arange(2 * 2 * 16 * 2 * 8, dtype=torch.float16).view(2, 2, 16, 2, 8)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + self.page_size]
        return page.flatten() if flat else page


@dataclass
class StorageConfig:
    model_name: str | None = "m"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    logical_page_size: int | None = None


@dataclass
class StandInMLAPool:
    layout: str = "layer_first"
    layer_num: int = 2
    kv_cache_dim: int = 576
    page_size: int = 4
    dtype: torch.dtype = torch.bfloat16


def test_layout_carries_model_shard_and_stage():
    layout = layout_of(StandInMHAPool(), StorageConfig(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2))
    assert (layout.tp_rank, layout.tp_size, layout.chunk_size) == (1, 2, 4)
    assert layout.model == "m#pp1/2"
    assert layout_of(StandInMHAPool(), StorageConfig(), model="other").model == "other"


def test_decode_context_parallel_shards_of_mla_pages_are_keyed_apart():
    """With DCP each rank holds its own slice of every page: shards must never share keys
    (SGLang's own file backend names them apart too); the same shard of another DCP group
    holds the same bytes and shares them."""
    pool = StandInMLAPool()

    def shard(tp_rank: int, tp_size: int, dcp_rank: int) -> bytes:
        config = StorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, dcp_rank=dcp_rank, dcp_size=2, logical_page_size=8
        )
        return layout_of(pool, config).fingerprint

    assert shard(0, 2, 0) != shard(1, 2, 1)
    assert shard(0, 4, 0) == shard(2, 4, 0)  # DCP groups {0, 1} and {2, 3}: shard 0 of each
    assert layout_of(pool, StorageConfig(tp_rank=1, tp_size=2)).fingerprint == (
        layout_of(pool, StorageConfig()).fingerprint  # without DCP: one copy for every rank
    )
    wider = StorageConfig(tp_size=2, dcp_size=2, logical_page_size=16)
    assert layout_of(pool, wider).fingerprint != shard(0, 2, 0)  # other slices of a page
    assert (
        "#dcp0/2/page8"
        in layout_of(pool, StorageConfig(tp_size=2, dcp_size=2, logical_page_size=8)).model
    )


def test_page_views_are_payload_order_and_share_memory():
    pool = StandInMHAPool()
    pages = PageMap.of(pool, layout_of(pool, StorageConfig()))
    view = pages.page(4)
    assert view.shape == (2, 2, 4, 2, 8)  # (layer, k|v, token, head, dim)
    assert torch.equal(view[1, 0], pool.kv_buffer[0, 1, 4:8])  # layer 1, K
    view.zero_()
    assert not pool.kv_buffer[:, :, 4:8].any()  # a view, not a copy
    flat = pool.get_data_page(8, flat=True)
    assert torch.equal(pages.flat(flat), pages.page(8))


def test_unsupported_pools_are_refused_at_registration():
    with pytest.raises(ConfigError, match="K width 8 and V width 4"):
        layout_of(StandInMHAPool(v_head_dim=4), StorageConfig())
    with pytest.raises(ConfigError, match="page_unified"):
        pool = StandInMHAPool(layout="page_unified")
        PageMap.of(pool, layout_of(pool, StorageConfig()))
    with pytest.raises(ConfigError, match="dtype"):
        layout_of(StandInMHAPool(dtype=torch.int32), StorageConfig())


def test_a_non_pool_is_refused_at_registration_with_a_config_error():
    for pool in (None, object(), SimpleNamespace(layer_num="x")):
        with pytest.raises(ConfigError, match="hicache host pool: cannot read"):
            pool_pages(pool, StorageConfig())
