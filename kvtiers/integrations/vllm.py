"""A vLLM KV connector that pools vLLM's KV cache through kvtiers.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVTiersConnector", "kv_role": "kv_both",
      "kv_connector_module_path": "kvtiers.integrations.vllm",
      "kv_connector_extra_config": {"config": "/etc/kvtiers/tiers.toml"}}'

The layout (layers, KV heads, head size, dtype, TP rank and size, pipeline stage, model name
and revision) comes from vLLM; the tiers from the kvtiers config. See docs/vllm.md.

This module imports vLLM; `import kvtiers` never imports it.
"""

from __future__ import annotations

import logging
import tempfile
import weakref
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtiers.cache import TieredCache
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import CacheStats
from kvtiers.integrations._vllm_events import EventQuorum, WorkerEvents, kv_events_on
from kvtiers.integrations._vllm_handoff import Role
from kvtiers.integrations._vllm_messages import (
    KVTiersConnectorMetadata,
    KVTiersConnectorStats,
    KVTiersKVEvents,
    to_vllm_event,
)
from kvtiers.integrations._vllm_parts import ConnectorParts
from kvtiers.integrations._vllm_plan import ConnectorSettings, StepPlan
from kvtiers.integrations._vllm_prom import KVTiersPromMetrics
from kvtiers.integrations._vllm_prompt import items_hashed
from kvtiers.integrations._vllm_scheduler import SchedulerSide
from kvtiers.integrations._vllm_sources import by_source, sources_of
from kvtiers.integrations._vllm_topology import Topology
from kvtiers.integrations._vllm_worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVTiersConnector", "KVTiersConnectorMetadata", "KVTiersConnectorStats"]

logger = logging.getLogger("kvtiers.vllm")


class KVTiersConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Serve vLLM's prefix KV from kvtiers tiers, and store what vLLM computes.

    The scheduler-side instance answers how many prompt tokens kvtiers holds and plans
    each step's loads and saves; the worker-side instance (one per TP rank of each
    pipeline stage) owns the `TieredCache` of its shard and moves KV layer by layer. A
    tier failure is a miss: logged, counted, and recomputed by vLLM.

    Models with sliding-window or chunked-local-attention layers run under vLLM's hybrid
    KV-cache manager too: each layer moves through its KV-cache group's blocks, each chunk
    is saved in the step that completes it, and loads are asynchronous (see
    `_vllm_worker`).
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._settings = ConnectorSettings.from_extra(extra)
        self._role = Role.of(self._kv_transfer_config.kv_role)
        self._check_config(vllm_config, kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._chunk_size = self._topology.chunk_size(self._block_size, self._settings.chunk_size)
        self._parts = ConnectorParts(
            self._settings,
            self._topology,
            str(self._kv_transfer_config.engine_id),
            self._settings.socket_dir or tempfile.gettempdir(),
            list(self._hit_sources),
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._events: WorkerEvents | None = None
        self._quorum: EventQuorum[KVCacheEvent] | None = None
        # What a step's planned loads lose when the worker has no cache (vLLM recomputes).
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._open_scheduler_side(vllm_config)
        self._finalizer = weakref.finalize(self, self._parts.close)

    def _check_config(self, vllm_config: VllmConfig, kv_cache_config: Any) -> None:
        """Check the settings against the role, tiers and model; set `_hit_sources`, `_topology`."""
        if self._settings.store_generated and not self._role.saves:
            raise ConfigError(
                "kv_connector_extra_config.store_generated: a kv_consumer stores nothing; "
                "use kv_role kv_both or kv_producer, or set store_generated = false"
            )
        # NOTE: a tiers config that cannot be read, or names a bad tier, stops the engine at
        # start-up like a bad extra-config key (a typo must not silently cost all caching);
        # tiers of a valid config that fail to open (a store unreachable) leave it off.
        tiers = TieredCache.check_tiers(self._settings.tiers_source()).tiers
        self._hit_sources = sources_of(tiers)
        self._topology = Topology.of(
            vllm_config, kv_cache_config, store_generated=self._settings.store_generated
        )
        if self._topology.mamba_groups:
            TieredCache.check_tiers(self._settings.states_config())
        elif self._settings.mamba_config is not None:
            logger.warning("kvtiers: the model has no Mamba layers; mamba_config is unused")

    def _open_scheduler_side(self, vllm_config: VllmConfig) -> None:
        """Build the scheduler side: lookups, load and save planning, event quorum."""
        kv_events = kv_events_on(vllm_config, self._settings)
        multimodal = items_hashed(vllm_config)
        if not multimodal:
            logger.warning(
                "kvtiers: with mm_processor_cache_gb = 0 and prefix caching off, vLLM "
                "names images per request, not by their content; prompts with images "
                "are served without kvtiers"
            )
        self._scheduler = SchedulerSide(
            self._settings,
            self._block_size,
            self._chunk_size,
            self._parts.make_lookup,
            kv_events=kv_events,
            role=self._role,
            multimodal=multimodal,
            async_loads=self._topology.hybrid,
            mamba_groups=self._topology.mamba_groups,
        )
        if kv_events:
            self._quorum = EventQuorum(self._topology.num_ranks, self._settings.event_chunks)
        if self._settings.on_load_error == "recompute":
            # NOTE: vLLM reads this right after building the scheduler-side connector;
            # kvtiers is a cache, so a failed load is recomputed, never an error.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"

    # ==== scheduler side =============================================================

    def on_new_request(self, request: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            logger.exception("kvtiers: lookup failed; served as a miss")
            return 0, False

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Split the tokens vLLM takes from kvtiers by the kind of tier they load from."""
        if num_external_tokens <= 0 or self._scheduler is None:
            return {}
        try:
            tokens = self._scheduler.take_load_tiers(request)
            split = by_source(tokens, self._hit_sources, num_external_tokens)
            return {CacheHitSource(source): count for source, count in split.items()}
        except Exception:
            logger.exception("kvtiers: splitting a hit by tier failed")
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVTiersConnectorMetadata:
        assert self._scheduler is not None
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        manager = self._kv_cache_manager

        def block_ids_of(req_id: str) -> Any:
            groups = state.get_block_ids(req_id) if state is not None else None
            if groups is None and manager is not None:
                groups = manager.get_block_ids(req_id)
            return groups or None

        plan = self._scheduler.build_plan(scheduler_output.num_scheduled_tokens, block_ids_of)
        return KVTiersConnectorMetadata(plan=plan)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        try:
            return self._scheduler.request_finished(request, block_ids)
        except Exception:
            logger.exception("kvtiers: request_finished failed; nothing stored")
            return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        failed = getattr(connector_output, "failed_recving", None)
        if failed and self._scheduler is not None:
            self._scheduler.load_failed(set(failed))
        events = getattr(connector_output, "kv_cache_events", None)
        if self._quorum is not None and isinstance(events, KVTiersKVEvents):
            self._quorum.add(events.get_all_events())  # the workers' KV events of a step

    def take_events(self) -> list[KVCacheEvent]:
        return self._quorum.take() if self._quorum is not None else []

    def reset_cache(self) -> bool | None:
        """Clear every worker rank's cache; vLLM's `reset_prefix_cache(reset_connector=True)`.

        Each rank waits for its loads and saves in flight, then removes every chunk its
        cache knows from every tier (`TieredCache.clear`); requests live now save nothing
        more. Returns whether every rank cleared within `close_timeout_s`.
        """
        if self._scheduler is None:
            return None
        self._scheduler.reset()
        try:
            loop, client = self._parts.channel()
            removed = loop.run(client.clear(), self._settings.close_timeout_s)
        except Exception as exc:
            logger.error("kvtiers: the reset did not clear every worker's cache: %s", exc)
            return False
        logger.info("kvtiers: reset: %d chunk copies removed from the tiers", removed)
        return True

    # ==== worker side ================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None or not kv_caches:
            return
        try:
            self._worker = self._start_worker(kv_caches)
        except Exception:
            logger.exception("kvtiers: the cache could not be opened; the connector is off")

    def _start_worker(self, kv_caches: dict[str, torch.Tensor]) -> WorkerSide:
        worker = self._parts.open_worker(
            self._vllm_config, kv_caches, self._block_size, self._chunk_size
        )
        entry = self._parts.entry
        assert entry is not None
        if entry.cache.config.events > 0 and kv_events_on(self._vllm_config, self._settings):
            self._events = WorkerEvents(
                entry, self._settings.event_chunks, self._block_size, self._chunk_size
            )
        return worker

    def _plan(self) -> StepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, KVTiersConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if self._worker is None or plan is None:
            if plan is not None and plan.loads:  # no cache: every planned load fails
                if self._topology.hybrid:
                    self._failed_requests.update(spec.req_id for spec in plan.loads)
                else:
                    self._failed_blocks.update(b for spec in plan.loads for b in spec.block_ids[0])
            return
        self._worker.start_load(plan)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        plan = self._plan()
        if self._events is not None and plan is not None:
            self._events.record(plan)
        if self._worker is not None and plan is not None and (plan.saves or plan.state_saves):
            # NOTE: staging is prepared here, before the forward pass, because vLLM calls
            # start_load_kv after the forward pass when the step has no synchronous load.
            self._worker.begin_saves(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._worker is not None:
            self._worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        plan = self._plan()
        if self._worker is not None and plan is not None:
            self._worker.finish_step(plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        failed, self._failed_requests = self._failed_requests, set()
        received = set(failed)
        plan = self._plan()
        sent = set(plan.released) if plan is not None else set()
        if self._worker is None:
            sent |= {s.req_id for s in plan.saves if s.finished} if plan is not None else set()
        else:
            if plan is not None and plan.idle:
                self._worker.idle_wait(plan.waiting)
            sent |= self._worker.take_finished()
            loaded, load_failed = self._worker.take_loads()
            received |= loaded
            failed |= load_failed
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        if self._worker is not None:
            failed |= self._worker.take_failed_blocks()
        return failed

    def get_kv_connector_kv_cache_events(self) -> KVTiersKVEvents | None:
        events = [to_vllm_event(e) for e in self._events.take()] if self._events is not None else []
        return KVTiersKVEvents(events) if events else None

    # ==== both sides =================================================================

    def get_kv_connector_stats(self) -> KVTiersConnectorStats | None:
        counts: dict[str, Any] = {}
        if self._scheduler is not None:
            counts.update(self._scheduler.take_counts())
        if self._worker is not None:
            counts.update(self._worker.take_counts())
        if self._events is not None:
            counts.update(self._events.take_counts())
        if self._quorum is not None:
            counts.update(self._quorum.take_counts())
        return KVTiersConnectorStats(data=counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTiersConnectorStats:
        return KVTiersConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTiersPromMetrics:
        return KVTiersPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # layer-wise loads and saves run between graph pieces

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never lost data

    @property
    def layout(self) -> KVLayout | None:
        """The kvtiers layout of this worker's shard (`None` on the scheduler side)."""
        return self._worker.layout if self._worker is not None else None

    def stats(self) -> CacheStats | None:
        """Return kvtiers' own stats of the worker-side cache (`None` elsewhere)."""
        entry = self._parts.entry
        return None if entry is None else entry.cache.stats()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save so far is in every write-through tier (worker side)."""
        return self._worker.flush(timeout) if self._worker is not None else True

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.flush(self._settings.close_timeout_s)
        self._finalizer()
