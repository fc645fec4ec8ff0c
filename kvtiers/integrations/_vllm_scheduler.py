"""The scheduler side of the vLLM connector: lookups, load and save planning.

Each request's lookup is started and awaited by `_vllm_lookups`; this module turns its
answer into vLLM's and plans each step's loads and saves.

vLLM objects are used duck-typed (`request.request_id`, `all_token_ids`, ...), so this
module imports no vLLM and is tested with stand-ins.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtiers.integrations._counters import Counters
from kvtiers.integrations._vllm_counts import COUNTERS
from kvtiers.integrations._vllm_events import block_origin
from kvtiers.integrations._vllm_handoff import HandoffWaits, Role, announce, params_of
from kvtiers.integrations._vllm_lookups import Lookup, Lookups
from kvtiers.integrations._vllm_plan import (
    BlockOrigin,
    ConnectorSettings,
    GroupBlocks,
    LoadSpec,
    SaveSpec,
    StepPlan,
    tokens_to_bytes,
)
from kvtiers.integrations._vllm_prompt import has_items, keyable
from kvtiers.integrations._vllm_sources import tokens_by_tier
from kvtiers.integrations._vllm_states import StatePlanner
from kvtiers.integrations._vllm_tracked import Tracked, salt_of

__all__ = ["Lookup", "SchedulerSide"]


class SchedulerSide:
    """Answer `get_num_new_matched_tokens` and build each step's `StepPlan`.

    Args:
        settings: the connector settings.
        block_size: vLLM's block size in tokens.
        chunk_size: kvtiers' chunk size, a multiple of `block_size`.
        lookup: starts a lookup; resolved on first use (it may need the workers up).
        clock: monotonic seconds (injected for tests).
        kv_events: send vLLM's block hashes with each load and save, for the workers'
            KV events.
        role: what the engine's `kv_role` lets the connector do (`kv_both` by default).
        multimodal: whether the engine names multimodal items by their content
            (`_vllm_prompt.items_hashed`); if not, requests with items are not keyed.
        async_loads: load outside the forward pass (vLLM's hybrid KV-cache manager with
            several KV-cache groups, where vLLM takes no block-level load errors): the
            request waits for its load, and a failed load recomputes the whole request.
        mamba_groups: a state-space model's Mamba groups (`_vllm_mamba`): hits end where
            a state is kept, loads carry the state's blocks there, and the step that ends
            a prompt's prefill saves the state at its checkpoint. Needs `async_loads` and
            a chunk of one block.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        block_size: int,
        chunk_size: int,
        lookup: Callable[[], Lookup],
        clock: Callable[[], float] = time.monotonic,
        kv_events: bool = False,
        *,
        role: Role | None = None,
        multimodal: bool = True,
        async_loads: bool = False,
        mamba_groups: tuple[int, ...] = (),
    ) -> None:
        self._settings = settings
        self._async_loads = async_loads
        self._block = block_size
        self._multimodal = multimodal
        self._chunk = chunk_size
        self._clock = clock
        self._kv_events = kv_events
        self._role = role or Role.of(None)
        self._reqs: dict[str, Tracked] = {}
        self._plan = StepPlan()
        self._counts = Counters(COUNTERS)
        self._handoffs = HandoffWaits(settings, clock, self._count)
        self._lookups = Lookups(settings, lookup, clock, self._handoffs, self._count)
        self._states = StatePlanner(mamba_groups, block_size, self._count) if mamba_groups else None

    # -- requests ----------------------------------------------------------------------

    def _track(self, request: Any) -> Tracked:
        tracked = self._reqs.get(request.request_id)
        if tracked is None:
            eligible = keyable(request) and (self._multimodal or not has_items(request))
            tracked = Tracked(request=request, salt=salt_of(request), eligible=eligible)
            params = params_of(request, self._count, eligible)
            tracked.awaited, tracked.keep = params.stored_tokens or 0, params.keep_tokens
            self._reqs[request.request_id] = tracked
        return tracked

    def on_new_request(self, request: Any) -> None:
        """Start tracking `request`."""
        self._track(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return how many tokens past `num_computed_tokens` kvtiers can load.

        Side-effect free for vLLM: callable many times; the answer of a finished lookup is
        kept until blocks are allocated. `None` means 'ask again later' (a lookup is still
        running, e.g. on a slow shared tier, or the request waits for KV that a producer
        announced and the lookups have not found yet). The second value says whether the
        load is asynchronous: only with `async_loads`; otherwise loads run layer by layer
        in the forward pass.
        """
        tracked = self._track(request)
        # NOTE: whole chunks are looked up, up to the whole prompt, but vLLM must compute
        # at least one token itself: when every token is cached, all but the last one are
        # offered. The load still fills the last token's slot (its block is whole), and
        # vLLM's own write of that token's KV comes after it in the layer's forward pass.
        whole = request.num_tokens // self._chunk * self._chunk
        limit = min(whole, request.num_tokens - 1)
        if self._states is not None:  # a prefill resumes from a state, kept at chunk ends
            limit = limit // self._chunk * self._chunk
        if not tracked.eligible or tracked.load_failed or limit <= num_computed_tokens:
            return 0, False
        tracked.asked_computed = num_computed_tokens
        if tracked.answer is None:
            if tracked.future is None and self._clock() < tracked.next_lookup_at:
                return self._ask_later()
            hit = self._lookups.await_hit(tracked, whole)
            if hit is not None and tracked.awaited:
                hit = self._handoffs.answer(
                    tracked, hit, min(tracked.awaited, whole), num_computed_tokens
                )
            if hit is None:
                return self._ask_later()
            tracked.answer = hit
            tracked.cached = max(tracked.cached, hit)
        offered = max(0, min(tracked.answer, limit) - num_computed_tokens)
        return offered, self._async_loads and offered > 0

    def _ask_later(self) -> tuple[None, bool]:
        """Answer 'ask again later', and tell this step's workers a request waits."""
        self._plan.waiting = True
        return None, False

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Plan the load of the `num_external_tokens` tokens vLLM accepted.

        Args:
            request: the request.
            block_ids: its blocks per KV-cache group, in token order.
            num_external_tokens: tokens vLLM takes from kvtiers.
        """
        tracked = self._track(request)
        answer, tracked.answer = tracked.answer, None
        if num_external_tokens <= 0 or answer is None:
            return
        start = tracked.asked_computed
        end = start + num_external_tokens
        # NOTE: the hit is whole chunks and chunks are whole blocks, so rounding `end` up
        # to a block stays inside the loaded prefix (with a whole prompt cached, `end` is
        # its last token, whose slot the load fills before vLLM computes it).
        end_block = -(-end // self._block)
        tracked.loaded = (start, end)
        states = self._states.load_blocks(tracked, block_ids, end) if self._states else ()
        spec = LoadSpec(
            req_id=request.request_id,
            tokens=tokens_to_bytes(tracked.keyed(answer)),
            salt=tracked.salt,
            block_ids=_cut(block_ids, start // self._block, end_block),
            start=start,
            end=end_block * self._block,
            origin=self._origin(request, answer),
            state_blocks=states,
        )
        self._plan.loads.append(spec)
        self._count("planned_load_tokens", spec.end - spec.start)

    def take_load_tiers(self, request: Any) -> dict[str, int]:
        """Return the tokens of `request`'s accepted load by tier name, once.

        Keys are the tier names its lookup found the chunks in; "" counts tokens of no
        known tier (a hand-off's answer taken from an earlier lookup).
        """
        tracked = self._reqs.get(request.request_id)
        if tracked is None or tracked.loaded is None:
            return {}
        (start, end), tracked.loaded = tracked.loaded, None
        # NOTE: split here, not when the load is planned: vLLM asks only with stats on.
        return tokens_by_tier(tracked.tiers, self._chunk, start, end)

    # -- steps -------------------------------------------------------------------------

    def build_plan(
        self,
        num_scheduled_tokens: dict[str, int],
        block_ids_of: Callable[[str], Sequence[Sequence[int]] | None],
    ) -> StepPlan:
        """Return this step's plan and start a new one.

        The prompt's chunks are saved step by step: each step saves the chunks that its
        forward pass completes (their KV is gathered layer by layer during that pass and
        stored in the background). So every block of a saved chunk is still allocated,
        also where vLLM frees sliding-window blocks behind the window.

        Args:
            num_scheduled_tokens: tokens scheduled this step per request id.
            block_ids_of: the block ids of a scheduled request, per KV-cache group.
        """
        plan, self._plan = self._plan, StepPlan()
        plan.idle = not any(num_scheduled_tokens.values())
        for req_id, num_new in num_scheduled_tokens.items():
            tracked = self._reqs.get(req_id)
            if tracked is None or not tracked.eligible or tracked.stale or not self._role.saves:
                continue
            request = tracked.request
            target = request.num_prompt_tokens // self._chunk * self._chunk
            done_after = request.num_computed_tokens + num_new
            if self._states is not None:
                self._states.plan_save(tracked, block_ids_of(req_id), plan, done_after)
            end = min(target, done_after // self._chunk * self._chunk)
            start = tracked.cached
            if end <= start:
                continue
            block_ids = block_ids_of(req_id)
            if block_ids is None or any(len(ids) * self._block < end for ids in block_ids):
                continue
            plan.saves.append(
                SaveSpec(
                    req_id=req_id,
                    tokens=tokens_to_bytes(tracked.keyed(end)),
                    salt=tracked.salt,
                    block_ids=_cut(block_ids, start // self._block, end // self._block),
                    start=start,
                    origin=self._origin(request, end),
                    keep_tokens=tracked.keep,
                )
            )
            tracked.cached = end
            self._count("planned_save_tokens", end - start)
        return plan

    def load_failed(self, req_ids: set[str]) -> None:
        """Note asynchronous loads that failed: those requests load nothing more."""
        for req_id in req_ids:
            tracked = self._reqs.get(req_id)
            if tracked is not None and not tracked.load_failed:
                tracked.load_failed, tracked.state_at = True, 0
                self._count("load_failed_requests")

    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget `request`; return whether its blocks must wait for a save, and its params.

        With `store_generated`, the full chunks of prompt and output that are not stored
        yet are saved in the next step; vLLM keeps the blocks until the workers report the
        save done (`get_finished`). A producer returns, as `kv_transfer_params`, how many
        tokens of the request kvtiers holds (`_vllm_handoff`); other roles return `None`.
        """
        tracked = self._reqs.pop(request.request_id, None)
        if tracked is not None and tracked.future is not None:
            tracked.future.cancel()
        if tracked is None or not tracked.eligible:
            return False, None
        delay = self._save_finished(request, tracked, block_ids)
        # NOTE: a state-space prompt resumes only where its state is kept.
        held = tracked.state_at if self._states is not None else tracked.cached
        params = announce(held) if self._role.announces and held else None
        return delay, params

    def _save_finished(
        self, request: Any, tracked: Tracked, block_ids: Sequence[Sequence[int]]
    ) -> bool:
        """Plan the save of a finished request's generated chunks; return whether planned."""
        if not self._settings.store_generated or not self._role.saves or tracked.stale:
            return False
        target = request.num_computed_tokens // self._chunk * self._chunk
        held = min((len(ids) for ids in block_ids), default=0) * self._block
        target = min(target, held // self._chunk * self._chunk)
        start = tracked.cached
        if target <= start:
            return False
        tracked.cached = target
        self._plan.saves.append(
            SaveSpec(
                req_id=request.request_id,
                tokens=tokens_to_bytes(tracked.keyed(target)),
                salt=tracked.salt,
                block_ids=_cut(block_ids, start // self._block, target // self._block),
                start=start,
                finished=True,
                origin=self._origin(request, target),
                keep_tokens=tracked.keep,
            )
        )
        self._count("planned_save_tokens", target - start)
        return True

    def reset(self) -> None:
        """Forget what lookups found, before the workers' caches are cleared.

        vLLM resets its prefix cache, and kvtiers' with it, when the model's weights change
        (an RL trainer's weight sync) or to drop what was cached. The KV of requests live
        now may predate the change, so none of it is saved from here on: those requests
        are marked stale, and saves planned but not handed out yet are dropped (a finished
        request's, whose blocks vLLM holds for it, is reported finished at once). They may
        still load what is stored after the reset.
        """
        for tracked in self._reqs.values():
            tracked.forget_lookups()
            tracked.stale = True
        self._plan.released.extend(s.req_id for s in self._plan.saves if s.finished)
        self._plan.saves.clear()
        self._plan.state_saves.clear()
        self._count("resets")

    def _origin(self, request: Any, num_tokens: int) -> BlockOrigin | None:
        return block_origin(request, num_tokens, self._block) if self._kv_events else None

    # -- stats -------------------------------------------------------------------------

    def _count(self, name: str, amount: int = 1) -> None:
        self._counts.add(name, amount)

    def take_counts(self) -> dict[str, float]:
        """Return the non-zero counters since the last call and reset them."""
        return self._counts.take()


def _cut(block_ids: Sequence[Sequence[int]], first: int, end: int) -> GroupBlocks:
    """Return blocks `[first, end)` of every KV-cache group."""
    return tuple(tuple(ids[first:end]) for ids in block_ids)
