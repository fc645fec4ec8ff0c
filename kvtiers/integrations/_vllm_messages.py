"""What the connector's two sides exchange through vLLM, as vLLM types.

Scheduler to workers: `KVTiersConnectorMetadata`, each step's plan. Workers to scheduler:
`KVTiersConnectorStats` (counters) and `KVTiersKVEvents` (KV events, which the
scheduler-side connector passes to vLLM's event publisher). Where the workers run in
processes of their own (TP > 1), these travel pickled.

This module imports vLLM; only `kvtiers.integrations.vllm` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtiers.integrations._vllm_events import BlockEvent, BlocksStored
from kvtiers.integrations._vllm_plan import StepPlan

__all__ = [
    "KVTiersConnectorMetadata",
    "KVTiersConnectorStats",
    "KVTiersKVEvents",
    "to_vllm_event",
]


@dataclass
class KVTiersConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, sent from the scheduler-side connector to every worker."""

    plan: StepPlan


class KVTiersConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """kvtiers' counters for one interval: sums over workers and the scheduler.

    Keys: `lookups`, `lookup_hit_tokens`, `loaded_tokens`, `loaded_bytes`,
    `load_wait_seconds`, `load_errors`, `load_failed_tokens`, `saved_tokens`,
    `saved_bytes`, `save_errors`, `saves_skipped`, `hits_<tier>` (chunks per tier),
    `kv_events`, `kv_events_unnamed`, `kv_events_unconfirmed`, ...
    """

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVTiersConnectorStats:
        merged = dict(self.data)
        for key, value in (other.data or {}).items():
            merged[key] = merged.get(key, 0) + value
        return KVTiersConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVTiersKVEvents(KVConnectorKVEvents):  # type: ignore[misc]
    """One step's KV events of a worker (vLLM joins those of all workers)."""

    def __init__(self, events: list[KVCacheEvent] | None = None) -> None:
        self._events = list(events or [])
        self._num_workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVTiersKVEvents:
        """Keep the events every worker reported, once each (vLLM's rule)."""
        aggregator = KVEventAggregator(self._num_workers)
        aggregator.add_events(self._events)
        self._events, self._num_workers = aggregator.get_common_events(), 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._events, self._num_workers = [], 1


def to_vllm_event(event: BlockEvent) -> KVCacheEvent:
    """Return vLLM's struct of a kvtiers block event.

    Hashes are converted as vLLM converts those of its own blocks.
    """
    hashes = [maybe_convert_block_hash(h) for h in event.block_hashes]
    where = event.where
    if isinstance(event, BlocksStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=where.medium,
            lora_name=event.lora_name,
            group_idx=0,
            locality=where.locality,
            ownership=where.ownership,
        )
    return BlockRemoved(
        block_hashes=hashes,
        medium=where.medium,
        group_idx=0,
        locality=where.locality,
        ownership=where.ownership,
    )
