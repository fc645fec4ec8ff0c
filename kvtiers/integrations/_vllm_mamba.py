"""A state-space model's recurrent state in kvtiers, beside its attention KV.

vLLM's align mode (`--mamba-cache-mode align`, prefix caching on) keeps each Mamba layer's
state at block boundaries. When a prompt's prefill ends, the state at the last block
boundary before the prompt's last token (vLLM's prefill checkpoint: a resumed prompt
computes at least one token) is in a block of each Mamba group, until a later step frees
it. The worker stores that state in that step, under the key of the
chunk that ends there (a chunk is one block for such a model), in a cache of its own; a
lookup offers only a prefix at whose end a state is kept; a load writes the state into
the block vLLM allocated at the end of the loaded prefix, where the next prefill starts.

A Mamba layer's tensor, as `register_kv_caches` gives it, holds one page per block
(`(num_blocks, ..., page bytes)`): the layer's state (its convolution window and SSM state)
packed as vLLM lays it out. The states of a block are moved as the bytes of every Mamba
layer's page, in model order, never read.

This module imports torch but no vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import torch

from kvtiers.core.index import LookupResult
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.integrations._runtime import SharedCache
from kvtiers.integrations._vllm_loads import layer_order
from kvtiers.integrations._vllm_plan import NULL_BLOCK, LoadSpec, Salt, StateSave, tokens_of

__all__ = ["MambaPages", "StateStore", "state_layout"]

logger = logging.getLogger("kvtiers.vllm")

_T = TypeVar("_T")


def state_layout(kv_layout: KVLayout, state_bytes: int, tp_rank: int, tp_size: int) -> KVLayout:
    """Return the layout of a block's states: opaque bytes under `<model>#mamba`.

    Per rank: vLLM splits a Mamba layer's heads across tensor-parallel ranks.
    """
    return KVLayout(
        f"{kv_layout.model}#mamba",
        1,
        1,
        state_bytes,
        "uint8",
        1,
        kind="mla",
        model_revision=kv_layout.model_revision,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


class MambaPages:
    """The Mamba layers' pages: one block's states out of them, and back in.

    Args:
        layers: vLLM's Mamba layer tensors by name, `(num_blocks, ..., page bytes)`.
        groups: the KV-cache group of each layer, by name.
        mamba_groups: the Mamba groups, in the order a plan lists their blocks.
    """

    def __init__(
        self, layers: dict[str, torch.Tensor], groups: dict[str, int], mamba_groups: Sequence[int]
    ) -> None:
        self.names = layer_order(list(layers))
        self._tensors = [layers[name] for name in self.names]
        slot = {g: i for i, g in enumerate(mamba_groups)}
        self._slots = [slot[groups[name]] for name in self.names]
        self._sizes = [t[0].numel() * t.element_size() for t in self._tensors]
        self.state_bytes = sum(self._sizes)
        """Bytes of one block's states, every Mamba layer."""

    def gather(self, blocks: Sequence[int]) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Return a copy of the states in `blocks` (one per Mamba group), flat bytes."""
        out = torch.empty(self.state_bytes, dtype=torch.uint8)
        at = 0
        for tensor, slot, size in zip(self._tensors, self._slots, self._sizes, strict=True):
            page = tensor[blocks[slot]].contiguous().reshape(-1).view(torch.uint8)
            out[at : at + size].copy_(page)
            at += size
        return out.numpy()

    def scatter(self, blocks: Sequence[int], states: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        """Write `states` (as `gather` returns them) into `blocks`, one per Mamba group."""
        src = torch.from_numpy(states)
        at = 0
        for tensor, slot, size in zip(self._tensors, self._slots, self._sizes, strict=True):
            page = tensor[blocks[slot]]
            piece = src[at : at + size]
            if at % page.element_size():  # a view as wider elements must start aligned
                piece = piece.clone()
            page.copy_(piece.to(page.device).view(page.dtype).view(page.shape))
            at += size


class StateStore:
    """A state-space model's states in a cache of their own, beside the KV's cache.

    Each cache runs on its own loop thread: calls on the states' cache from the KV cache's
    loop (a lookup, a load) are handed to the states' loop and awaited.

    Args:
        kv: the worker's KV cache (its keys name the states).
        states: the states' cache (layout `state_layout`).
        pages: the Mamba layers' pages.
        count: counts an event by name (`state_saves`, ...); the worker sets its own.
    """

    def __init__(
        self,
        kv: SharedCache,
        states: SharedCache,
        pages: MambaPages,
        count: Callable[[str], None] | None = None,
    ) -> None:
        self._kv = kv
        self.entry = states
        self.pages = pages
        self.count = count or (lambda name: None)
        self._fetched: dict[str, np.ndarray[Any, np.dtype[np.uint8]]] = {}
        self._pending: set[Future[list[bool]]] = set()

    def _key(self, tokens: Any, salt: Salt) -> ChunkKey:
        """Return the key of the state at the end of `tokens` (whole chunks)."""
        return self.entry.cache.chunk_keys([self._kv.cache.keys(tokens, salt=salt)[-1]])[0]

    async def _on_states(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return await asyncio.wrap_future(self.entry.loop.submit(coro))

    async def locate(self, tokens: Any, salt: Salt) -> LookupResult:
        """Return the cached prefix of `tokens` that ends where a state is kept (KV loop).

        The KV's cached prefix, cut back to the last chunk whose end has a state: a prefill
        resumes only from a kept state.
        """
        cache = self._kv.cache
        found = await cache.locate(tokens, salt=salt)
        if not found.keys:
            return found
        states = self.entry.cache
        kept = await self._on_states(states.contains_keys(states.chunk_keys(found.keys)))
        last = max((i + 1 for i, hit in enumerate(kept) if hit), default=0)
        return LookupResult(last * cache.layout.chunk_size, found.tiers[:last], found.keys[:last])

    def save(
        self, tokens: Any, salt: Salt, blocks: Sequence[int], cold: bool = False
    ) -> Future[list[bool]]:
        """Copy the states in `blocks` now; store them under the end of `tokens` (later).

        A `cold` state (past the request's reuse hint) is stored to be evicted first.
        """
        payload = self.pages.gather(blocks)
        key = self._key(tokens, salt)
        keep = 0 if cold else None
        return self.entry.loop.submit(
            self.entry.cache.put_chunks([key], [payload], keep_chunks=keep)
        )

    async def fetch(self, tokens: Any, salt: Salt) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Return the state kept at the end of `tokens` (on the KV loop).

        Raises:
            LookupError: no tier holds it (or its copy failed its checksum).
        """
        out = np.empty(self.pages.state_bytes, dtype=np.uint8)
        key = self._key(tokens, salt)
        if not (await self._on_states(self.entry.cache.get_chunks([key], [out])))[0]:
            raise LookupError("the recurrent state at the end of the prefix is not cached")
        return out

    # -- the worker's loads and saves ------------------------------------------------------

    async def load(self, loading: Awaitable[int], spec: LoadSpec, tokens: Any) -> int:
        """Run a request's KV load, then fetch the state at its end (on the KV loop).

        Returns:
            The KV load's tokens; the state waits for `write`.

        Raises:
            LookupError: the state is not cached.
        """
        loaded = await loading
        if loaded >= spec.end:
            self._fetched[spec.req_id] = await self.fetch(tokens[: spec.end], spec.salt)
        return loaded

    def write(self, spec: LoadSpec) -> None:
        """Write the state `load` fetched for `spec` into its blocks (after its KV).

        Raises:
            LookupError: no state was fetched for it.
            ValueError: vLLM gave no block for the state.
        """
        states = self._fetched.pop(spec.req_id, None)
        if states is None:
            raise LookupError("the recurrent state was not fetched")
        if NULL_BLOCK in spec.state_blocks:
            raise ValueError("vLLM allocated no block for the recurrent state")
        self.pages.scatter(spec.state_blocks, states)
        self.count("state_loads")

    def drop(self, req_id: str) -> None:
        """Forget what was fetched for a request whose load failed."""
        self._fetched.pop(req_id, None)

    def save_all(self, saves: Sequence[StateSave]) -> None:
        """Copy each save's states out of vLLM's blocks now; store them in the background."""
        for spec in saves:
            try:
                future = self.save(tokens_of(spec.tokens), spec.salt, spec.blocks, spec.cold)
            except Exception:
                logger.exception("kvtiers: saving a recurrent state failed")
                self.count("save_errors")
                continue
            self._pending.add(future)
            future.add_done_callback(self._saved)

    def flush(self, timeout: float | None) -> bool:
        """Wait for the saves in flight and the states' write queues; whether all ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        _, late = concurrent.futures.wait(list(self._pending), timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.entry.loop.run(self.entry.cache.flush(), left)
        return not late

    async def clear(self) -> int:
        """Remove every state from the states' cache (on the KV loop); residencies removed."""
        return await self._on_states(self.entry.cache.clear())

    def _saved(self, future: Future[list[bool]]) -> None:
        self._pending.discard(future)
        if future.cancelled() or future.exception() is not None or not future.result()[0]:
            logger.warning("kvtiers: a recurrent state was not stored")
            self.count("save_errors")
        else:
            self.count("state_saves")
