"""The worker side of the vLLM connector: layer-wise loads and saves against vLLM's KV.

Loads: `start_load` submits one layer-wise load per request to the cache's loop, of the
chunks from the one holding vLLM's first uncomputed token on (those before it are in
vLLM's blocks already, so they are not read again). The cache reports the load wave by
wave of layers (1, 2, 4, ... layers; see `kvtiers._streaming`), so `wait_for_layer` waits
only for the wave holding its layer, and writes that layer's blocks: the tier reads of
later layers overlap the attention of earlier ones. On a CUDA device a layer's copies are
queued on a copy stream with one event per layer, and each layer's compute waits only for
its own event. A block is loaded only if every layer was written with it and the whole
load delivered it; the others are reported to vLLM, which recomputes them. Saves are the
other half (`kvtiers.integrations._vllm_saves`): each layer's blocks are staged as the
forward pass leaves the layer and stored in the background. Every failure is logged,
counted, and becomes a miss (loads: the blocks are reported to vLLM, which recomputes
them).

Under vLLM's hybrid KV-cache manager (sliding-window or chunked-local-attention layers
beside full-attention ones) each layer moves through the blocks of its KV-cache group, and
loads are asynchronous: vLLM takes no block-level load errors with several groups, so the
request waits while its chunks are read, `take_loads` writes every layer at once (skipping
the null blocks vLLM freed; `kvtiers.integrations._vllm_async_loads`) and reports the
request received, or failed, which vLLM recomputes whole.

vLLM objects are not imported here; the connector passes tensors and plans.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time

import torch

from kvtiers.core.layout import KVLayout
from kvtiers.gpu._streams import CopyStream, Event
from kvtiers.integrations._counters import Counters
from kvtiers.integrations._runtime import SharedCache
from kvtiers.integrations._staging import StagingTensors
from kvtiers.integrations._vllm_async_loads import settle_whole
from kvtiers.integrations._vllm_counts import COUNTERS, HITS_PREFIX
from kvtiers.integrations._vllm_kv import PagedLayout
from kvtiers.integrations._vllm_loads import LayerSet, Load, idle_wait, layer_order, load_from
from kvtiers.integrations._vllm_mamba import StateStore
from kvtiers.integrations._vllm_plan import ConnectorSettings, StepPlan, tokens_of
from kvtiers.integrations._vllm_saves import SaveSide

__all__ = ["WorkerSide", "layer_order"]

logger = logging.getLogger("kvtiers.vllm")


class WorkerSide:
    """Move KV between vLLM's paged layers and one shared `TieredCache`.

    Args:
        settings: the connector settings.
        entry: the shared cache and its loop.
        layers: vLLM's KV tensors by layer name, as `register_kv_caches` gave them.
        paged: their layout.
        layout: the kvtiers layout (this rank's shard).
        groups: the KV-cache group of each layer, by name (none: one group).
        async_loads: load outside the forward pass (`take_loads`), whole requests.
        states: a state-space model's states (`_vllm_mamba`), loaded after a request's
            KV and saved at the step's end.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        entry: SharedCache,
        layers: dict[str, torch.Tensor],
        paged: PagedLayout,
        layout: KVLayout,
        groups: dict[str, int] | None = None,
        async_loads: bool = False,
        states: StateStore | None = None,
    ) -> None:
        self._settings = settings
        self._entry = entry
        self._kv = LayerSet(layers, paged, groups)
        self._async_loads = async_loads
        self._waiting: list[Load] = []  # asynchronous loads in flight
        self.layout = layout
        self._loads: list[Load] = []
        self._failed: set[int] = set()
        self._counts = Counters(COUNTERS)
        self._states = states
        if states is not None:
            states.count = self._count
        self._tier_hits = [0] * len(entry.cache.tiers)
        self._copies = CopyStream(self._kv.device)
        self._staging = StagingTensors(
            layout, pinned=self._copies.is_cuda, keep_bytes=settings.staging_keep_mib << 20
        )
        self._saves = SaveSide(
            entry, self._kv, layout, self._staging, settings.max_pending_saves, self._count
        )
        self._pipelined = self._copies.is_cuda
        """Whether a step's loads are queued for every layer at once (`_queue_copies`)."""
        self._layer_events: dict[int, Event] = {}  # this step's queued copies, by layer
        self._arrived = threading.Condition()  # a load reported a wave, or ended
        self._deadline: float | None = None  # this step's load deadline, from its first wait

    # -- loads -------------------------------------------------------------------------

    def start_load(self, plan: StepPlan) -> None:
        """Start loading every request of the plan (returns at once)."""
        cache, loop = self._entry.cache, self._entry.loop
        chunk = self.layout.chunk_size
        for spec in plan.loads:
            tokens = tokens_of(spec.tokens)
            first = spec.start // chunk
            staging = self._staging.take(len(tokens) - first * chunk)
            ids = self._kv.block_ids(spec.block_ids)
            waves: list[tuple[int, int]] = []
            report = functools.partial(self._wave_arrived, waves)
            loading = load_from(cache, tokens, spec.salt, first, staging, report)
            if spec.state_blocks and self._states is not None:
                loading = self._states.load(loading, spec, tokens)
            try:
                future = loop.submit(loading)
            except Exception:  # the loop is gone: every block of the request fails
                logger.exception("kvtiers: starting a load failed")
                future = concurrent.futures.Future()
                future.set_exception(RuntimeError("kvtiers loop unavailable"))
            future.add_done_callback(self._load_ended)
            job = Load(spec, staging, ids, future, first * chunk, waves, started=time.monotonic())
            (self._waiting if self._async_loads else self._loads).append(job)

    def _wave_arrived(self, waves: list[tuple[int, int]], num_layers: int, num_tokens: int) -> None:
        with self._arrived:
            waves.append((num_layers, num_tokens))
            self._arrived.notify_all()

    def _load_ended(self, _: concurrent.futures.Future[int]) -> None:
        with self._arrived:
            self._arrived.notify_all()

    def _step_deadline(self) -> float:
        """Return this step's load deadline, set by its first wait."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self._settings.load_timeout_s
        return self._deadline

    def _layer_upto(self, job: Load, layer: int) -> int:
        """Wait until layer `layer` of `job` is final; return the tokens it covers.

        Waits at most until the step's load deadline; past it the load is given up (every
        block is then reported, and vLLM recomputes them).
        """
        deadline = self._step_deadline()
        started = time.monotonic()
        with self._arrived:
            while (upto := job.tokens_of_layer(layer)) is None:
                left = deadline - time.monotonic()
                if job.gave_up or job.future.done() or left <= 0:
                    job.gave_up = job.gave_up or left <= 0
                    upto = 0
                    break
                self._arrived.wait(left)
        self._count("load_wait_seconds", time.monotonic() - started)
        block = self._kv.paged.block_size
        upto = min(job.spec.end, upto // block * block)
        job.least = upto if job.least < 0 else min(job.least, upto)
        return upto

    def _resolve_loads(self) -> None:
        """Settle every load of the step: how far each got, and which blocks failed.

        A block counts as loaded only if the whole load delivered it and every layer was
        written with it (a later wave may have come up shorter than an earlier one).
        """
        deadline = self._step_deadline()
        block = self._kv.paged.block_size
        for job in self._loads:
            if job.upto >= 0:
                continue
            spec = job.spec
            started = time.monotonic()
            try:
                if job.gave_up:
                    raise TimeoutError("the load deadline passed")
                left = max(0.0, deadline - time.monotonic())
                loaded = job.future.result(timeout=left)
            except Exception as exc:
                job.future.cancel()
                logger.warning("kvtiers: a load failed (%s); vLLM recomputes", exc)
                loaded = 0
            self._count("load_wait_seconds", time.monotonic() - started)
            job.upto = min(spec.end, loaded // block * block)
            if job.least >= 0:
                job.upto = min(job.upto, job.least)
            if job.upto < spec.end:
                # A failed tier read comes back as a shorter load (the cache turns tier
                # failures into misses); either way these blocks are recomputed.
                self._count("load_errors")
                first_bad = max(0, (job.upto - spec.start) // block)
                self._failed.update(spec.block_ids[0][first_bad:])
                self._count("load_failed_tokens", spec.end - max(job.upto, spec.start))
            self._count("loaded_tokens", max(0, job.upto - spec.start))

    def wait_for_layer(self, name: str) -> None:
        """Write layer `name` of every load of this step into vLLM's blocks.

        On CUDA the first call queues every layer's copies (`_queue_copies`); this layer's
        compute then waits for its own copies on the device, not on the host.
        """
        if not self._loads:
            return
        i = self._kv.index.get(name)
        if i is None:
            return
        if self._pipelined:
            self._queue_copies(i)
            self._copies.hold_current(self._layer_events[i])
            return
        self._scatter_layer(i)

    def _scatter_layer(self, i: int) -> None:
        """Write layer `i` of every load of this step into vLLM's blocks, once it is final."""
        for job in self._loads:
            if i in job.layers_done:
                continue
            job.layers_done.add(i)
            upto = self._layer_upto(job, i)
            count = (upto - job.spec.start) // self._kv.paged.block_size
            if count <= 0:
                continue
            whole = job.staging[i]
            if self._pipelined:
                # NOTE: the layer's whole staging slab is contiguous pinned memory, so this
                # copy does not block the host; a token range of it would (a strided
                # source is first copied into pageable memory), so it is cut on the device.
                whole = whole.to(self._kv.device, non_blocking=True)
            src = whole[:, job.spec.start - job.base : upto - job.base]
            ids = job.block_ids[self._kv.group[i]][:count]
            self._kv.paged.scatter(self._kv.tensors[i], ids, src)

    def _queue_copies(self, layer: int) -> None:
        """Queue the copies of layer `layer` and of every layer final by now, one event each.

        Waits on the host only for `layer`'s wave; layers whose waves have arrived for
        every load are queued at once, so their copies overlap the compute before them.
        """
        if not self._layer_events:
            # NOTE: the blocks may have held another request's KV that queued kernels
            # still read: the copies start after everything the compute stream has queued.
            self._copies.wait_current()
        ready = len(self._kv)
        for job in self._loads:
            if not job.future.done():
                ready = min(ready, job.waves[-1][0] if job.waves else 0)
        with self._copies.use():
            for i in range(len(self._layer_events), max(layer + 1, ready)):
                self._scatter_layer(i)
                self._layer_events[i] = self._copies.record()

    def take_failed_blocks(self) -> set[int]:
        """Return the blocks whose load failed since the last call."""
        failed, self._failed = self._failed, set()
        return failed

    def idle_wait(self, waiting: bool) -> None:
        """Pause a step that computes nothing (`_vllm_loads.idle_wait`)."""
        idle_wait(self._waiting, waiting)

    def take_loads(self) -> tuple[set[str], set[str]]:
        """Settle the asynchronous loads that ended: write them into vLLM's blocks.

        A load that delivered every planned token is written, every layer through its
        group's blocks; one that came up short, failed, or outlived `load_timeout_s` is
        given up (vLLM recomputes the request).

        Returns:
            The requests received (failed ones included, as vLLM wants), and those failed.
        """
        received: set[str] = set()
        failed: set[str] = set()
        still: list[Load] = []
        now = time.monotonic()
        for job in self._waiting:
            spec = job.spec
            if not job.future.done() and now - job.started < self._settings.load_timeout_s:
                still.append(job)
                continue
            received.add(spec.req_id)
            if not settle_whole(job, self._kv, self._staging, self._states, self._count):
                failed.add(spec.req_id)
        self._waiting = still
        return received, failed

    # -- saves (`SaveSide`) -------------------------------------------------------------

    def begin_saves(self, plan: StepPlan) -> None:
        """Prepare the staging tensors of the plan's saves."""
        self._saves.begin(plan)

    def save_layer(self, name: str, layer: torch.Tensor) -> None:
        """Gather layer `name` of every save of this step into its staging tensor."""
        i = self._kv.index.get(name)
        if i is not None:
            self._saves.save_layer(i, layer)

    def finish_step(self, plan: StepPlan | None = None) -> None:
        """Settle this step's loads, hand its staged saves to the cache in the background.

        Layers the forward pass did not visit (an empty step) are gathered here, and the
        plan's recurrent states copied out; vLLM's blocks are no longer needed when this
        returns.
        """
        if self._loads:
            self._resolve_loads()
        for job in self._loads:
            missing = set(range(len(self._kv))) - job.layers_done
            if missing and job.upto != 0:
                # NOTE: the forward pass skipped a layer hook, so those layers hold no loaded
                # KV; report the blocks so vLLM recomputes rather than reads garbage.
                logger.warning("kvtiers: %d layers were never loaded; recomputing", len(missing))
                self._failed.update(job.spec.block_ids[0])
            self._staging.release(job.staging, job.future)
        self._loads = []
        self._layer_events = {}
        self._deadline = None
        self._saves.finish()
        if plan is not None and plan.state_saves and self._states is not None:
            self._states.save_all(plan.state_saves)

    def take_finished(self) -> set[str]:
        """Return the finished requests whose final save no longer needs their blocks."""
        return self._saves.take_finished()

    # -- lifecycle and stats -----------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for saves in flight and the cache's write queues; return whether all ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done, not_done = concurrent.futures.wait(self._saves.pending(), timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            self._entry.loop.run(self._entry.cache.flush(), left)
            if self._states is not None and not self._states.flush(left):
                return False
        except Exception as exc:
            logger.warning("kvtiers: flushing the write queues failed: %s", exc)
            return False
        return not not_done

    async def clear_cache(self, timeout: float) -> int:
        """Clear the cache, once the loads and saves in flight have ended (on its loop).

        A save still running would store KV computed before the clear after it, and a load
        could promote a chunk back into the top tier; both are awaited, for at most
        `timeout` seconds, then `TieredCache.clear` runs.

        Returns:
            Residencies removed.
        """
        jobs = [job.future for job in (*self._loads, *self._waiting)]
        running = [asyncio.wrap_future(f) for f in (*jobs, *self._saves.pending())]
        if running:
            _, late = await asyncio.wait(running, timeout=timeout)
            if late:
                logger.warning("kvtiers: clearing with %d loads or saves still running", len(late))
        removed = await self._entry.cache.clear()
        if self._states is not None:
            removed += await self._states.clear()
        return removed

    def _count(self, name: str, amount: float = 1) -> None:
        self._counts.add(name, amount)

    def take_counts(self) -> dict[str, float]:
        """Return the counters and per-tier hits since the last call, then reset them."""
        counts = self._counts.take()
        for i, tier in enumerate(self._entry.cache.tiers):
            hits = tier.counters.hits
            if hits > self._tier_hits[i]:
                counts[f"{HITS_PREFIX}{tier.name}"] = hits - self._tier_hits[i]
            self._tier_hits[i] = hits
        if counts.get("loaded_tokens"):
            counts["loaded_bytes"] = counts["loaded_tokens"] * self.layout.bytes_per_token
        return counts
