"""The paged half of `TieredCache`: stores and loads straight from and into an engine's
paged KV, through a copy engine per device (CUDA streams on a GPU)."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import torch

from kvtiers._activity import Activity, tracked
from kvtiers._endpoints import PagedSink, PagedSource
from kvtiers._keyed import Salt
from kvtiers._movement import Mover
from kvtiers._salts import SaltWitness
from kvtiers._tensors import as_tokens, keep_hint
from kvtiers.core.errors import InvalidInputError
from kvtiers.core.keys import ChunkHasher
from kvtiers.core.layout import KVLayout
from kvtiers.gpu.copy_engine import CopyEngine
from kvtiers.gpu.paged import PagedKV

__all__ = ["PagedAPI"]


class PagedAPI:
    """Store and load through an engine's paged KV; mixed into `TieredCache`."""

    layout: KVLayout
    _hasher: ChunkHasher
    _salts: SaltWitness
    _mover: Mover
    _stack: AsyncExitStack
    _engines: dict[torch.device, CopyEngine]
    _activity: Activity

    if TYPE_CHECKING:  # provided by TieredCache

        def _ensure_open(self) -> None: ...

        def _record_load(self, num_chunks: int, start: float) -> None: ...

        def _record_store(self, new_chunks: int, start: float) -> int: ...

    @tracked
    async def store_paged(
        self,
        tokens: Any,
        paged: PagedKV,
        block_table: Any,
        *,
        salt: Salt = None,
        keep_tokens: int | None = None,
    ) -> int:
        """Cache the full chunks of `tokens` straight from an engine's paged KV.

        Each chunk is gathered from the engine's blocks into its top-tier block with one
        copy (device-to-host on dedicated CUDA streams, awaited without blocking the loop).

        Args:
            tokens: token ids of the request, prefix first.
            paged: the engine's KV (`PagedKV.vllm_flash`, `.sglang_mha`, `.mla`).
            block_table: the request's engine block ids in token order.
            salt: the tenant's namespace.
            keep_tokens: the reuse hint, as `TieredCache.store` takes it.

        Returns:
            Tokens newly stored.

        Raises:
            TokenError: bad token ids.
            LayoutMismatch: `paged` does not match the layout.
            InvalidInputError: a bad block table or hint; nothing is written.
        """
        start = time.perf_counter()
        _check_paged(paged, self.layout)
        keep = keep_hint("keep_tokens", keep_tokens, self.layout.chunk_size)
        arr = as_tokens(tokens)
        keys = self._hasher.keys_of_array(arr, salt)
        self._salts.stored(arr, self._hasher.root(salt))
        engine = await self._copy_engine(paged.device)
        source = PagedSource(self.layout, engine, paged, block_table)
        new_chunks = await self._mover.store(keys, source, keep) if keys else 0
        return self._record_store(new_chunks, start)

    @tracked
    async def load_paged(
        self, tokens: Any, paged: PagedKV, block_table: Any, *, salt: Salt = None
    ) -> int:
        """Load the cached prefix of `tokens` straight into an engine's paged KV.

        Chunks are scattered into the blocks that `block_table` names, with one copy from
        their tier block (host-to-device on dedicated CUDA streams).

        Returns:
            Tokens loaded: the leading full chunks delivered (see `load`).

        Raises:
            TokenError: bad token ids.
            LayoutMismatch: `paged` does not match the layout.
            InvalidInputError: a bad block table; nothing is written.
        """
        start = time.perf_counter()
        _check_paged(paged, self.layout)
        keys = self._hasher.keys_of_array(as_tokens(tokens), salt)
        engine = await self._copy_engine(paged.device)
        sink = PagedSink(self.layout, engine, paged, block_table)
        loaded = await self._mover.load(keys, sink) if keys else 0
        self._record_load(loaded, start)
        return loaded * self.layout.chunk_size

    async def _copy_engine(self, device: torch.device) -> CopyEngine:
        engine = self._engines.get(device)
        if engine is None:
            engine = await self._stack.enter_async_context(CopyEngine(self.layout, device))
            self._engines[device] = engine
        return engine


def _check_paged(paged: Any, layout: KVLayout) -> None:
    if not isinstance(paged, PagedKV):
        raise InvalidInputError(f"paged: expected a PagedKV, got {type(paged).__name__}")
    paged.check_layout(layout)
