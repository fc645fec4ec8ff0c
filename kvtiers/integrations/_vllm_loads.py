"""vLLM's layers as the worker sees them, and the loads it runs on the cache's loop.

`LayerSet` holds vLLM's KV layers in model order, each with its KV-cache group (both halves
of the worker use it). `load_from` reads a request's cached chunks layer-wise
(`TieredCache.load` or `get_chunks` with `on_layers`) into the request's staging tensor;
`Load` keeps what the waves reported, so `WorkerSide.wait_for_layer` knows which tokens of a
layer are final; `write_whole` writes an asynchronous load's every layer at once.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtiers import TieredCache
from kvtiers._streaming import OnLayers
from kvtiers.integrations._vllm_kv import PagedLayout
from kvtiers.integrations._vllm_plan import NULL_BLOCK, GroupBlocks, LoadSpec, Salt

__all__ = [
    "IDLE_WAIT_S",
    "NULL_BLOCK",
    "LayerSet",
    "Load",
    "idle_wait",
    "layer_order",
    "live_blocks",
    "load_from",
    "write_whole",
]

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_order(names: list[str]) -> list[str]:
    """Return layer names in model order (by the `layers.<i>.` index, else as given)."""
    indexed = [(m.group(1) if (m := _LAYER_INDEX.search(n)) else None, n) for n in names]
    if all(i is not None for i, _ in indexed):
        return [n for _, n in sorted(indexed, key=lambda p: int(p[0] or 0))]
    return list(names)


class LayerSet:
    """vLLM's paged KV layers in model order, each with its KV-cache group.

    Args:
        layers: vLLM's KV tensors by layer name, as `register_kv_caches` gave them.
        paged: their layout.
        groups: the KV-cache group of each layer, by name (none: one group).
    """

    def __init__(
        self,
        layers: dict[str, torch.Tensor],
        paged: PagedLayout,
        groups: dict[str, int] | None = None,
    ) -> None:
        self.names = layer_order(list(layers))
        """Layer names in model order; a layer's position is its index below."""
        self.index = {name: i for i, name in enumerate(self.names)}
        self.group = [(groups or {}).get(name, 0) for name in self.names]
        """The KV-cache group of each layer."""
        self.tensors = [layers[name] for name in self.names]
        self.paged = paged
        self.device = self.tensors[0].device

    def __len__(self) -> int:
        return len(self.names)

    def block_ids(self, block_ids: GroupBlocks) -> list[torch.Tensor]:
        """Return a plan's block ids per KV-cache group as tensors on the KV's device."""
        return [torch.tensor(ids, dtype=torch.int64, device=self.device) for ids in block_ids]


@dataclass(slots=True, eq=False)
class Load:
    """One request's load in a step: where it lands and how far its waves got."""

    spec: LoadSpec
    staging: torch.Tensor
    block_ids: list[torch.Tensor]
    """The spec's block ids per KV-cache group, on the KV's device."""
    future: concurrent.futures.Future[int]
    base: int
    """The request's token at the start of `staging`."""
    waves: list[tuple[int, int]]
    """`(num_layers, num_tokens)` from `staging`'s start, as the layer-wise load reports
    them (appended on the cache's loop thread)."""
    upto: int = -1
    """Tokens usable after the load finished (-1 while unknown)."""
    least: int = -1
    """The fewest tokens any layer was written with (-1: no layer yet)."""
    gave_up: bool = False
    """The step's load deadline passed while waiting for it."""
    layers_done: set[int] = field(default_factory=set)
    started: float = 0.0
    """When the load was submitted (monotonic seconds; asynchronous loads' deadline)."""

    def tokens_of_layer(self, layer: int) -> int | None:
        """Return the request's tokens whose layer `layer` is final, if reported yet."""
        for num_layers, num_tokens in list(self.waves):
            if num_layers > layer:
                return self.base + num_tokens
        return None


async def load_from(
    cache: TieredCache,
    tokens: Any,
    salt: Salt,
    first: int,
    staging: torch.Tensor,
    on_layers: OnLayers,
) -> int:
    """Load the cached chunks of `tokens` from chunk `first` on into `staging`, layer-wise.

    Returns:
        The tokens of the request's cached prefix now in vLLM's reach: `first` chunks plus
        the leading run of chunks delivered.
    """
    if first == 0:
        loaded = await cache.load(tokens, salt=salt, out=staging, on_layers=on_layers)
        return int(loaded.shape[2])
    size = cache.layout.chunk_size
    keys = cache.keys(tokens, salt=salt)
    dsts = [staging.narrow(2, i * size, size) for i in range(len(keys) - first)]
    found = await cache.get_chunks(keys[first:], dsts, parent=keys[first - 1], on_layers=on_layers)
    run = next((i for i, hit in enumerate(found) if not hit), len(found))
    return (first + run) * size


def live_blocks(
    block_ids: torch.Tensor, src: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `block_ids` without vLLM's null block, and the tokens of `src` for the rest.

    Args:
        block_ids: int64 block ids in token order.
        src: KV of their tokens, `(lead, len(block_ids) * block_size, ...)`.
    """
    keep = (block_ids != NULL_BLOCK).nonzero().flatten()
    if keep.numel() == block_ids.numel():
        return block_ids, src
    lead, rest = src.shape[0], src.shape[2:]
    blocks = src.reshape(lead, block_ids.numel(), block_size, *rest)
    kept = blocks.index_select(1, keep.to(src.device))
    return block_ids[keep], kept.reshape(lead, keep.numel() * block_size, *rest)


def write_whole(kv: LayerSet, job: Load) -> None:
    """Write every layer of a finished load into its group's live blocks."""
    spec, block = job.spec, kv.paged.block_size
    for i, layer in enumerate(kv.tensors):
        src = job.staging[i][:, spec.start - job.base : spec.end - job.base]
        ids, src = live_blocks(job.block_ids[kv.group[i]], src, block)
        if ids.numel():
            kv.paged.scatter(layer, ids, src)
    if kv.device.type == "cuda":
        torch.cuda.current_stream(kv.device).synchronize()


IDLE_WAIT_S = 0.005
"""The longest a step that computes nothing pauses (`idle_wait`). Short, so that a request
arriving meanwhile is scheduled with little delay."""


def idle_wait(loads: list[Load], waiting: bool) -> None:
    """Pause a step that computes nothing until a load ends, for `IDLE_WAIT_S` at most.

    An engine whose requests all wait (for asynchronous loads, or told to ask again later)
    steps in a tight loop that holds the GIL the loads' threads need and keeps a core busy,
    while each empty step changes nothing.

    Args:
        loads: the asynchronous loads in flight.
        waiting: the scheduler told a request to ask again later in this step.
    """
    if loads:
        futures = [job.future for job in loads]
        concurrent.futures.wait(futures, IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
    elif waiting:
        time.sleep(IDLE_WAIT_S)
