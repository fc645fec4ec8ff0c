"""The save half of the vLLM worker: stage each layer's blocks, store in the background.

Each layer's blocks are gathered into a private staging tensor as the forward pass leaves
the layer (`save_layer`); `finish` gathers the layers the pass did not visit and hands the
staged KV to `TieredCache.store` on the cache's loop, so neither vLLM's blocks nor its
forward pass wait for a tier. A request's final save releases its blocks at once: the
request is reported finished (`take_finished`) the step its KV is staged. A failed save is
logged and counted; the KV is simply not cached.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtiers import TieredCache
from kvtiers.core.layout import KVLayout
from kvtiers.integrations._runtime import SharedCache
from kvtiers.integrations._staging import StagingTensors
from kvtiers.integrations._vllm_loads import LayerSet
from kvtiers.integrations._vllm_plan import SaveSpec, StepPlan, tokens_of

__all__ = ["Save", "SaveSide", "store_from"]

logger = logging.getLogger("kvtiers.vllm")


@dataclass(slots=True, eq=False)
class Save:
    """One request's save in a step: the staged KV and the layers gathered so far."""

    spec: SaveSpec
    staging: torch.Tensor
    """KV of the tokens from `spec.start` on."""
    block_ids: list[torch.Tensor]
    """The spec's block ids per KV-cache group, on the KV's device."""
    layers_done: set[int] = field(default_factory=set)


async def store_from(cache: TieredCache, spec: SaveSpec, first: int, staging: torch.Tensor) -> int:
    """Store the chunks of `spec` from chunk `first` on; `staging` holds their KV.

    The chunks before `first` only key the stored ones (an earlier step saved them).

    Returns:
        Tokens stored: from the first chunk, those newly stored; from a later one, those
        a tier holds after the call.
    """
    tokens, salt, keep = tokens_of(spec.tokens), spec.salt, spec.keep_tokens
    if first == 0:
        return await cache.store(tokens, staging, salt=salt, keep_tokens=keep)
    size = cache.layout.chunk_size
    keys = cache.keys(tokens, salt=salt)
    srcs = [staging.narrow(2, i * size, size) for i in range(len(keys) - first)]
    kept = None if keep is None else max(0, keep // size - first)
    held = await cache.put_chunks(keys[first:], srcs, parent=keys[first - 1], keep_chunks=kept)
    return sum(held) * size


class SaveSide:
    """Stage a step's saves from vLLM's blocks and store them in the background.

    Args:
        entry: the shared cache and its loop.
        layers: vLLM's layers.
        layout: the kvtiers layout (this rank's shard).
        staging: where saves stage.
        max_pending: the most stores in flight; a save past it is skipped and counted.
        count: adds to one of the worker's counters (thread-safe).
    """

    def __init__(
        self,
        entry: SharedCache,
        layers: LayerSet,
        layout: KVLayout,
        staging: StagingTensors,
        max_pending: int,
        count: Callable[[str, float], None],
    ) -> None:
        self._entry = entry
        self._layers = layers
        self._layout = layout
        self._staging = staging
        self._max_pending = max_pending
        self._count = count
        self._saves: list[Save] = []
        self._finished: set[str] = set()
        self._pending: set[concurrent.futures.Future[int]] = set()
        self._lock = threading.Lock()  # guards `_pending`: stores end on the loop thread

    def begin(self, plan: StepPlan) -> None:
        """Prepare the staging tensors of the plan's saves."""
        for spec in plan.saves:
            num_tokens = len(spec.tokens) // 8 - spec.start
            ids = self._layers.block_ids(spec.block_ids)
            self._saves.append(Save(spec, self._staging.take(num_tokens), ids))

    def save_layer(self, i: int, layer: torch.Tensor) -> None:
        """Gather layer `i` (its tensor `layer`) of every save of this step."""
        group = self._layers.group[i]
        for job in self._saves:
            if i not in job.layers_done:
                self._layers.paged.gather(layer, job.block_ids[group], job.staging[i])
                job.layers_done.add(i)

    def finish(self) -> None:
        """Gather what the forward pass left out and hand the saves to the cache.

        vLLM's blocks are no longer needed when this returns.
        """
        saves, self._saves = self._saves, []
        layers = self._layers
        for save in saves:
            try:
                for i in set(range(len(layers))) - save.layers_done:
                    ids = save.block_ids[layers.group[i]]
                    layers.paged.gather(layers.tensors[i], ids, save.staging[i])
                if layers.device.type == "cuda":
                    torch.cuda.current_stream(layers.device).synchronize()
                self._submit(save)
            except Exception:
                logger.exception("kvtiers: a save failed; the KV is not stored")
                self._count("save_errors", 1)
            if save.spec.finished:
                self._finished.add(save.spec.req_id)

    def _submit(self, job: Save) -> None:
        with self._lock:
            skip = len(self._pending) >= self._max_pending
        if skip:
            self._count("saves_skipped", 1)
            self._staging.release(job.staging)
            return
        spec = job.spec
        first = spec.start // self._layout.chunk_size
        future = self._entry.loop.submit(store_from(self._entry.cache, spec, first, job.staging))
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(functools.partial(self._stored, job.staging))

    def _stored(self, staging: torch.Tensor, future: concurrent.futures.Future[int]) -> None:
        self._staging.release(staging, future)
        with self._lock:
            self._pending.discard(future)
        if future.cancelled():
            self._count("save_errors", 1)
            return
        exc = future.exception()
        if exc is not None:
            logger.warning("kvtiers: storing KV failed (%s); not cached", exc)
            self._count("save_errors", 1)
            return
        stored = future.result()
        self._count("saved_tokens", stored)
        self._count("saved_bytes", stored * self._layout.bytes_per_token)

    def take_finished(self) -> set[str]:
        """Return the finished requests whose final save no longer needs their blocks."""
        finished, self._finished = self._finished, set()
        return finished

    def pending(self) -> list[concurrent.futures.Future[int]]:
        """Return the stores still in flight."""
        with self._lock:
            return list(self._pending)
