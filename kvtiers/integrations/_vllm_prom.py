"""kvtiers' connector counters on vLLM's own Prometheus endpoint.

vLLM sums the counters of `KVTiersConnectorStats` (the workers' and the scheduler's) per
step and hands them to `KVTiersPromMetrics.observe`, so a server's `/metrics` carries
`vllm:kvtiers_<counter>_total` beside vLLM's own metrics, with vLLM's labels (model name,
engine index), and `vllm:kvtiers_tier_hits_total{tier=...}` for the chunks each tier
served. kvtiers' own exporter (`metrics` in the tiers config) is still there for the
cache's view (tier usage, latency histograms, evictions).

This module imports vLLM; only `kvtiers.integrations.vllm` imports it.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from kvtiers.integrations._vllm_counts import COUNTERS, HITS_PREFIX

__all__ = ["KVTiersPromMetrics"]


class KVTiersPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Register kvtiers' counters with vLLM's Prometheus registry and feed them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvtiers_{key}", documentation=doc, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for key, doc in COUNTERS.items()
        }
        self._hits = self._counter_cls(
            name="vllm:kvtiers_tier_hits",
            documentation="Chunks served by each kvtiers tier.",
            labelnames=[*labelnames, "tier"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counters; keys of no known counter are left out."""
        for key, value in transfer_stats_data.items():
            if not value or value < 0:
                continue
            counter = self._counters.get(key)
            if counter is not None:
                counter[engine_idx].inc(value)
            elif key.startswith(HITS_PREFIX):
                labels = self.per_engine_labelvalues[engine_idx]
                self._hits.labels(*labels, key[len(HITS_PREFIX) :]).inc(value)
