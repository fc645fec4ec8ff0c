"""The KV host pool's pages in the KV cache: moved in place, or as flat-page copies.

HiCache's zero-copy calls (`batch_get_v1`/`batch_set_v1`, the KV pool of the v2 calls)
name host slots: each page moves between the tiers and a payload-order view of the pool's
own memory (`PageMap`). Its generic calls (`batch_get`/`batch_set`) hand flat pages
instead, viewed the same way. Page hashes come checked (`_sglang_args.page_keys`); host
slots and flat pages are checked here, against the pool, before any page moves.

Imports no SGLang module: it reads the pool's attributes only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvtiers._tensors import TORCH_DTYPES
from kvtiers.cache import TieredCache
from kvtiers.core.keys import ChunkKey
from kvtiers.integrations._sglang_args import capacity_of, flat_pages, page_starts
from kvtiers.integrations._sglang_pages import PageMap

__all__ = ["KVPages"]


class KVPages:
    """Moves of the KV host pool's pages to and from the KV cache.

    Args:
        pages: the pool's page map.
        run: runs `make(cache)` on the KV cache's loop, `run(op, make, default)`; a
            failure or timeout gives `default`.
        record: records a transfer, `record(write, num_pages, seconds, chunk_bytes)`.
        salt: the salt of every key.
        writer: whether this rank stores pages (SGLang's `is_storage_writer`: an MLA
            model's pages are the same on every rank, so one rank writes them).
    """

    def __init__(
        self,
        pages: PageMap,
        run: Callable[..., Any],
        record: Callable[[bool, int, float, int], None],
        salt: str | None,
        writer: bool,
    ) -> None:
        self.map = pages
        self._run, self._record = run, record
        self._salt, self._writer = salt, writer
        self._dtype = TORCH_DTYPES[pages.layout.dtype]

    def _keys(self, cache: TieredCache, hashes: list[str]) -> list[ChunkKey]:
        return cache.chunk_keys(hashes, salt=self._salt)

    def transfer(
        self, op: str, hashes: list[str], parent: str | None, host_indices: Any, write: bool
    ) -> list[bool]:
        """Store or read the pages at `host_indices`; per hash, whether done.

        `parent` (the hash before `hashes`) links the pages to their prefix.

        Raises:
            BadArgumentError: the host indices are not one page of the pool per hash.
        """
        layout = self.map.layout
        capacity = capacity_of(self.map.pool)
        starts = page_starts(host_indices, len(hashes), layout.chunk_size, capacity, write=write)
        if write and not self._writer:
            return [True] * len(hashes)  # another rank writes the pages every rank shares
        begin = time.perf_counter()

        async def go(cache: TieredCache) -> list[bool]:
            keys = self._keys(cache, hashes)
            parent_key = self._keys(cache, [parent])[0] if parent else None
            views = self.map.pages_at(starts)
            if write:
                return await cache.put_chunks(keys, views, parent=parent_key)
            return await cache.get_chunks(keys, views, parent=parent_key)

        flags: list[bool] = self._run(op, go, [False] * len(hashes))
        self._record(write, sum(flags), time.perf_counter() - begin, layout.chunk_bytes)
        return flags

    def get_flat(self, hashes: list[str], targets: Any) -> list[torch.Tensor | None]:
        """Fill each flat page of `targets`; per hash, its page, or `None` on a miss.

        Raises:
            BadArgumentError: `targets` are not one contiguous flat page per hash.
        """
        pages = flat_pages(targets, len(hashes), self._dtype, self.map.page_shape, write=False)

        async def go(cache: TieredCache) -> list[bool]:
            views = [self.map.flat(page) for page in pages]
            return await cache.get_chunks(self._keys(cache, hashes), views)

        flags: list[bool] = self._run("batch_get", go, [False] * len(hashes))
        return [page if ok else None for page, ok in zip(pages, flags, strict=True)]

    def set_flat(self, hashes: list[str], values: Any) -> bool:
        """Store the flat pages `values` under `hashes`; whether a tier holds every one.

        Raises:
            BadArgumentError: `values` are not one flat page per hash.
        """
        pages = flat_pages(values, len(hashes), self._dtype, self.map.page_shape, write=True)
        if not self._writer:
            return True
        data = [page.contiguous() for page in pages]

        async def go(cache: TieredCache) -> list[bool]:
            views = [self.map.flat(page) for page in data]
            return await cache.put_chunks(self._keys(cache, hashes), views)

        return all(self._run("batch_set", go, [False] * len(hashes)))
