"""What one vLLM connector holds open, and how it is opened and closed.

The scheduler side holds the lookup channel to every worker rank, opened on first use. A
worker side holds its shard's `TieredCache` (shared, through `CACHES`, with other
connectors of the process that have the same config and layout), the `LookupServer` that
answers the scheduler's lookups and clears, and the `WorkerSide` that moves KV.
`ConnectorParts.close` releases all of it once: it is the connector's finalizer, so it
must not refer to the connector.

This module imports torch but no vLLM: vLLM objects are used duck-typed (`Topology`, which
imports vLLM, only for its type).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch

from kvtiers.cache import TieredCache
from kvtiers.core.layout import KVLayout
from kvtiers.integrations._amx import request_amx_tiles
from kvtiers.integrations._runtime import CACHES, LoopThread, SharedCache, config_identity
from kvtiers.integrations._vllm_channel import LookupClient, LookupServer, socket_path
from kvtiers.integrations._vllm_kv import PagedLayout
from kvtiers.integrations._vllm_mamba import MambaPages, StateStore, state_layout
from kvtiers.integrations._vllm_plan import ConnectorSettings
from kvtiers.integrations._vllm_scheduler import Lookup
from kvtiers.integrations._vllm_worker import WorkerSide

if TYPE_CHECKING:
    from kvtiers.integrations._vllm_topology import Topology

__all__ = ["ConnectorParts"]

logger = logging.getLogger("kvtiers.vllm")


class ConnectorParts:
    """Open a connector's channel, cache and server on demand; close them once.

    Args:
        settings: the connector settings.
        topology: vLLM's parallel layout and KV-cache groups.
        engine_id: vLLM's engine id (names the sockets and the published cache).
        socket_dir: where the lookup sockets live.
        tier_order: the cache's tier names, top first (merges ranks' per-chunk tiers).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        topology: Topology,
        engine_id: str,
        socket_dir: str,
        tier_order: list[str],
    ) -> None:
        self._settings = settings
        self._topology = topology
        self._engine_id = engine_id
        self._socket_dir = socket_dir
        self._tier_order = tier_order
        self._channel: tuple[LoopThread, LookupClient] | None = None
        self.entry: SharedCache | None = None
        """The worker's shared cache (worker side, once opened)."""
        self._server: LookupServer | None = None
        self.states_entry: SharedCache | None = None
        """The cache of a state-space model's states (worker side, once opened)."""

    # -- scheduler side ----------------------------------------------------------------

    def make_lookup(self) -> Lookup:
        """Return where lookups go: the worker's cache in this process, or the channel."""
        entry = CACHES.find(self._engine_id, 0) if self._topology.num_ranks == 1 else None
        if entry is not None:
            found = entry
            states = entry.extras.get(_states_name(self._engine_id))
            locate = found.cache.locate if states is None else states.locate

            def direct(tokens: Any, salt: Any) -> Any:
                return found.loop.submit(locate(tokens, salt=salt))

            logger.info("kvtiers: scheduler looks up in the worker's cache (same process)")
            return direct
        loop, client = self.channel()

        def remote(tokens: Any, salt: Any) -> Any:
            return loop.submit(client.lookup(tokens, salt))

        return remote

    def channel(self) -> tuple[LoopThread, LookupClient]:
        """Return the channel to every worker rank, opened on first use."""
        # NOTE: vLLM calls the scheduler side from its engine-core thread only.
        if self._channel is None:
            paths = [
                socket_path(self._socket_dir, self._engine_id, self._topology.dp_rank, rank)
                for rank in range(self._topology.num_ranks)
            ]
            client = LookupClient(paths, tier_order=self._tier_order)
            self._channel = (LoopThread(name="kvtiers-lookup"), client)
            logger.info("kvtiers: scheduler reaches the workers through the sockets %s", paths)
        return self._channel

    # -- worker side -------------------------------------------------------------------

    def open_worker(
        self,
        vllm_config: Any,
        kv_caches: dict[str, torch.Tensor],
        block_size: int,
        chunk_size: int,
    ) -> WorkerSide:
        """Open this rank's cache and lookup server; return the worker side over them.

        Raises:
            Exception: whatever opening the tiers or the server raised; what was opened
                before it is released by `close`.
        """
        topology = self._topology
        if next(iter(kv_caches.values())).device.type == "cpu" and request_amx_tiles():
            # NOTE: or a load of all but a token, as a fresh engine's first forward pass,
            # dies in vLLM's AMX attention kernel (see `_amx`).
            logger.debug("kvtiers: this process may use AMX tiles")
        mamba = topology.mamba_layers
        attention = {name: t for name, t in kv_caches.items() if name not in mamba}
        paged, layout = topology.worker_layout(
            vllm_config,
            attention,
            block_size=block_size,
            chunk_size=chunk_size,
            model_name=self._settings.model_name,
        )
        rank = topology.rank()
        entry, states = self._open_caches(kv_caches, layout, rank)
        worker = self._new_worker(entry, attention, paged, layout, states)
        path = self._serve_lookups(entry, worker, states, rank)
        logger.info(
            "kvtiers: worker rank %d serves %s (%s layout, chunk %d tokens, lookups on %s)",
            rank,
            layout.model,
            paged.kind,
            layout.chunk_size,
            path,
        )
        return worker

    def _open_caches(
        self, kv_caches: dict[str, torch.Tensor], layout: KVLayout, rank: int
    ) -> tuple[SharedCache, StateStore | None]:
        """Open this rank's cache and publish it, then its states' cache (Mamba layers)."""
        source = self._settings.tiers_source()
        entry = CACHES.acquire(
            (config_identity(source), layout),
            lambda: TieredCache.from_config(source, layout=layout),
        )
        self.entry = entry
        CACHES.publish(self._engine_id, rank, entry)
        mamba = self._topology.mamba_layers
        if not mamba:
            return entry, None
        states = self._open_states(
            entry, {n: t for n, t in kv_caches.items() if n in mamba}, layout
        )
        return entry, states

    def _new_worker(
        self,
        entry: SharedCache,
        attention: dict[str, torch.Tensor],
        paged: PagedLayout,
        layout: KVLayout,
        states: StateStore | None,
    ) -> WorkerSide:
        """Return the worker side over vLLM's `attention` layers and `entry`."""
        topology = self._topology
        return WorkerSide(
            self._settings,
            entry,
            attention,
            paged,
            layout,
            groups=topology.layer_groups,
            async_loads=topology.hybrid,
            states=states,
        )

    def _serve_lookups(
        self, entry: SharedCache, worker: WorkerSide, states: StateStore | None, rank: int
    ) -> str:
        """Start this rank's lookup server (for the scheduler's lookups); return its path."""
        path = socket_path(self._socket_dir, self._engine_id, self._topology.dp_rank, rank)
        locate = entry.cache.locate if states is None else states.locate
        server = LookupServer(
            path,
            lambda tokens, salt: locate(tokens, salt=salt),
            functools.partial(worker.clear_cache, self._settings.close_timeout_s),
        )
        entry.loop.run(server.start(), 30)
        entry.extras[path] = server
        self._server = server
        return path

    def _open_states(
        self, entry: SharedCache, layers: dict[str, torch.Tensor], layout: KVLayout
    ) -> StateStore:
        """Open the cache of a state-space model's states beside the KV's (`_vllm_mamba`)."""
        topology = self._topology
        pages = MambaPages(layers, topology.layer_groups, topology.mamba_groups)
        own = state_layout(layout, pages.state_bytes, topology.tp_rank(), topology.tp_size)
        settings = self._settings
        source = settings.tiers_source() if settings.mamba_config is None else settings.mamba_config
        self.states_entry = CACHES.acquire(
            (config_identity(source), own),
            lambda: TieredCache(settings.states_config(), layout=own),
        )
        states = StateStore(entry, self.states_entry, pages)
        entry.extras[_states_name(self._engine_id)] = states
        return states

    # -- both sides --------------------------------------------------------------------

    def close(self) -> None:
        """Release what was opened; later calls do nothing."""
        channel, self._channel = self._channel, None
        if channel is not None:
            loop, client = channel
            try:
                loop.run(client.aclose(), 10)
            except Exception:
                logger.exception("kvtiers: closing the lookup channel failed")
            loop.stop()
        entry, self.entry = self.entry, None
        server, self._server = self._server, None
        if entry is not None:
            if server is not None and entry.extras.pop(server.path, None) is not None:
                try:
                    entry.loop.run(server.aclose(), 10)
                except Exception:
                    logger.exception("kvtiers: closing the lookup server failed")
            entry.extras.pop(_states_name(self._engine_id), None)
            CACHES.release(entry)
        states, self.states_entry = self.states_entry, None
        if states is not None:
            CACHES.release(states)


def _states_name(engine_id: str) -> str:
    """Return where a worker's `StateStore` is found among its cache's extras."""
    return f"mamba-states:{engine_id}"
