"""SGLang host pools seen as kvtiers chunks: the layout, and each page as a payload view.

One SGLang page is one kvtiers chunk. A host pool keeps its pages in one of several memory
layouts; a page's bytes are never contiguous in kvtiers' payload order (`[layer][k|v]
[token][head][dim]`), but every layout SGLang uses by default is a permutation of it. So a
page is handed to the cache as a permuted view of the pool's own memory: the tiers read
into it and write from it directly, with no staging copy. Flat pages (SGLang's generic
`batch_get`/`batch_set` path) are the same view of a flat tensor.

Imports no SGLang module: it reads the pool's attributes only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtiers._tensors import TORCH_DTYPES, host_bytes
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout

__all__ = ["PageMap", "layout_of", "pool_pages"]

# (kind, host layout) -> (axis to squeeze from a non-flat page, permutation to payload order)
_ORDERS: dict[tuple[str, str], tuple[int | None, tuple[int, ...]]] = {
    ("mha", "layer_first"): (None, (1, 0, 2, 3, 4)),  # (2, L, P, H, D)
    ("mha", "page_first"): (None, (2, 0, 1, 3, 4)),  # (2, P, L, H, D)
    ("mha", "page_first_direct"): (1, (1, 0, 2, 3, 4)),  # (2, 1, L, P, H, D)
    ("mha", "page_head"): (1, (3, 0, 2, 1, 4)),  # (2, 1, H, P, L, D)
    ("mla", "layer_first"): (None, (0, 2, 1, 3)),  # (L, P, 1, D)
    ("mla", "page_first"): (None, (1, 2, 0, 3)),  # (P, L, 1, D)
    ("mla", "page_first_direct"): (0, (0, 2, 1, 3)),  # (1, L, P, 1, D)
}

_WHERE = "hicache host pool"


def _kind_of(pool: Any) -> str:
    return "mla" if hasattr(pool, "kv_cache_dim") else "mha"


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"{_WHERE}: dtype {dtype} is not one kvtiers stores")


def layout_of(pool: Any, storage_config: Any, model: str | None = None) -> KVLayout:
    """Return the kvtiers layout of an SGLang host pool's pages.

    The model name, tensor-parallel rank and size, the pipeline stage, the attention
    context-parallel rank and the decode context-parallel shard go into the layout (so into
    every key): pages of another model or shard never match. MLA pages are the same on
    every TP rank (of one DCP shard), so they are keyed as rank 0 of 1 and shared.

    Raises:
        ConfigError: a pool kvtiers cannot store (another layout, K and V widths that differ).
    """
    kind = _kind_of(pool)
    name = model or storage_config.model_name or "sglang-model"
    if storage_config.pp_size > 1:
        name = f"{name}#pp{storage_config.pp_rank}/{storage_config.pp_size}"
    if getattr(storage_config, "attn_cp_size", 1) > 1:
        name = f"{name}#cp{storage_config.attn_cp_rank}/{storage_config.attn_cp_size}"
    dcp_size = int(getattr(storage_config, "dcp_size", 1) or 1)
    if dcp_size > 1:
        # NOTE: with decode context parallelism (MLA only) each DCP rank holds its own
        # slice of every logical page, so a shard is keyed by its DCP rank, the DCP size
        # and the logical page size; the same shard of another DCP group (another TP rank
        # with this DCP rank) holds the same bytes and shares the keys.
        logical = getattr(storage_config, "logical_page_size", None)
        name = f"{name}#dcp{storage_config.dcp_rank}/{dcp_size}/page{logical}"
    num_layers, dtype, page_size = int(pool.layer_num), _dtype_name(pool.dtype), int(pool.page_size)
    if kind == "mla":
        return KVLayout(name, num_layers, 1, int(pool.kv_cache_dim), dtype, page_size, kind="mla")
    v_head_dim = getattr(pool, "v_head_dim", pool.head_dim)
    if v_head_dim != pool.head_dim:
        raise ConfigError(
            f"{_WHERE}: K width {pool.head_dim} and V width {v_head_dim} differ; kvtiers "
            f"stores pages whose K and V have one shape"
        )
    return KVLayout(
        name,
        num_layers,
        int(pool.head_num),
        int(pool.head_dim),
        dtype,
        page_size,
        kind="mha",
        tp_rank=int(storage_config.tp_rank),
        tp_size=int(storage_config.tp_size),
    )


@dataclass(frozen=True, slots=True)
class PageMap:
    """Payload-order views of one host pool's pages.

    Args:
        pool: the SGLang host pool (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`).
        layout: the pool's kvtiers layout (`layout_of`).
    """

    pool: Any
    layout: KVLayout
    page_shape: tuple[int, ...]
    """A non-flat page's shape in the pool's own layout."""
    squeeze: int | None
    perm: tuple[int, ...]
    base: npt.NDArray[np.uint8] | None = None
    """The whole pool's bytes in payload order, token axis 2, when pages are its slices."""

    @classmethod
    def of(cls, pool: Any, layout: KVLayout) -> PageMap:
        """Build the map of `pool`'s memory layout.

        Raises:
            ConfigError: the pool's layout has no payload-order view.
        """
        host_layout = str(pool.layout)
        order = _ORDERS.get((_kind_of(pool), host_layout))
        if order is None:
            known = sorted({lay for kind, lay in _ORDERS if kind == _kind_of(pool)})
            raise ConfigError(
                f"{_WHERE}: layout {host_layout!r} is not supported; use one of {', '.join(known)}"
            )
        squeeze, perm = order
        shape = tuple(pool.get_data_page(0, flat=False).shape)
        this = cls(pool, layout, shape, squeeze, perm)
        got = tuple(this._canon(torch.empty(shape, device="meta")).shape)
        if got != layout.chunk_shape():
            raise ConfigError(
                f"{_WHERE}: a page of shape {shape} is not a chunk of shape {layout.chunk_shape()}"
            )
        return cls(pool, layout, shape, squeeze, perm, this._whole_bytes())

    def _whole_bytes(self) -> npt.NDArray[np.uint8] | None:
        """Return the pool's bytes in payload order when each page is a slice of them.

        Then a page is one NumPy slice (no torch view per page); checked on a probe page
        against the pool's own `get_data_page`, so a pool that remaps pages falls back.
        """
        buffer = getattr(self.pool, "kv_buffer", None)
        if self.squeeze is not None or not isinstance(buffer, torch.Tensor):
            return None
        base = host_bytes(buffer.permute(self.perm))
        size = self.layout.chunk_size
        probe = host_bytes(self.page(size))
        if base is None or probe is None or base.shape[2] < 2 * size:
            return None
        if base[:, :, size : 2 * size].__array_interface__ != probe.__array_interface__:
            return None
        return base

    def _canon(self, page: torch.Tensor) -> torch.Tensor:
        if self.squeeze is not None:
            page = page.squeeze(self.squeeze)
        return page.permute(self.perm)

    def page(self, token_index: int) -> torch.Tensor:
        """Return the page that starts at host token `token_index`, in payload order."""
        return self._canon(self.pool.get_data_page(token_index, flat=False))

    def pages_at(self, starts: Sequence[int]) -> list[Any]:
        """Return the views of the pages that start at host token indices `starts`."""
        size, base = self.layout.chunk_size, self.base
        if base is not None:
            return [base[:, :, start : start + size] for start in starts]
        return [self.page(int(start)) for start in starts]

    def flat(self, data: torch.Tensor) -> torch.Tensor:
        """Return a flat page (`get_data_page(i, flat=True)`'s form) in payload order."""
        return self._canon(data.view(self.page_shape))


def pool_pages(pool: Any, storage_config: Any, model: str | None = None) -> PageMap:
    """Return the page map of a host pool, under its layout (`layout_of`).

    Raises:
        ConfigError: a pool kvtiers cannot store, or not a host pool at all.
    """
    try:
        return PageMap.of(pool, layout_of(pool, storage_config, model))
    except ConfigError:
        raise
    except Exception as exc:  # not a host pool: refused like one kvtiers cannot store
        raise ConfigError(f"{_WHERE}: cannot read {type(pool).__name__} ({exc})") from exc
