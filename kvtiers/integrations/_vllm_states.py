"""The scheduler's part in pooling a state-space model's recurrent state (vLLM align mode).

vLLM's align mode keeps a Mamba layer's state at block boundaries, each in the block just
before its boundary. The scheduler offers a prefix only up to a chunk end (a chunk is one
block for such a model: `chunk_size_for`), whose state the workers check (`_vllm_mamba`);
a load carries the block of each Mamba group that the state at its end goes into; and a
step saves the state it leaves where vLLM keeps one (the prompt's checkpoint when the
prefill ends, a step's end when a prefill is cut into steps), before a later step frees
its block.

Nothing here imports vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtiers.integrations._vllm_plan import NULL_BLOCK, StateSave, StepPlan, tokens_to_bytes
from kvtiers.integrations._vllm_tracked import Tracked

__all__ = ["StatePlanner", "state_blocks", "state_position"]


def state_position(num_prompt_tokens: int, block_size: int) -> int:
    """Return where vLLM keeps a state-space model's state for reuse: the prefill checkpoint.

    The last block boundary before the prompt's last token (a resumed prompt computes at
    least one token), as vLLM's `get_mamba_prefill_checkpoint_position` without EAGLE.
    """
    return max(0, (num_prompt_tokens - 1) // block_size * block_size)


def state_blocks(
    block_ids: Sequence[Sequence[int]] | None, groups: Sequence[int], at: int, block_size: int
) -> tuple[int, ...]:
    """Return the block holding the state at token `at` in each Mamba group of `groups`.

    vLLM's align mode keeps the state at a block boundary in the block just before it.
    Empty when a group has no live block there (vLLM freed it, or never allocated it).
    """
    column = at // block_size - 1
    if block_ids is None or column < 0:
        return ()
    blocks = tuple(
        block_ids[g][column] if len(block_ids[g]) > column else NULL_BLOCK for g in groups
    )
    return () if NULL_BLOCK in blocks else blocks


class StatePlanner:
    """Plan a state-space model's state loads and saves.

    Args:
        groups: the Mamba groups, in the order plans list their blocks.
        block_size: vLLM's block size (the chunk size).
        count: counts an event by name.
    """

    def __init__(self, groups: tuple[int, ...], block_size: int, count: Callable[[str], None]):
        self._groups = groups
        self._block = block_size
        self._count = count

    def load_blocks(
        self, tracked: Tracked, block_ids: Sequence[Sequence[int]], end: int
    ) -> tuple[int, ...]:
        """Return the blocks the state at `end` goes into; the null block if vLLM gave
        none (the worker then fails the load: a prefill must not start from a stale state)."""
        tracked.state_at = end
        return state_blocks(block_ids, self._groups, end, self._block) or (NULL_BLOCK,)

    def plan_save(
        self,
        tracked: Tracked,
        block_ids: Sequence[Sequence[int]] | None,
        plan: StepPlan,
        done_after: int,
    ) -> None:
        """Save the state this step leaves where vLLM keeps one, unless kvtiers has it.

        That is the prompt's checkpoint in the step that ends its prefill, and the step's
        end where a prefill is cut into steps (align mode ends them on block boundaries;
        vLLM also ends one where a prompt parts from a prefix another prompt shares). The
        state at a step's end is in the block just before it once the step's forward pass
        ran; a later step frees it.

        Args:
            tracked: the request.
            block_ids: its blocks per KV-cache group (`None`: unknown).
            plan: this step's plan, which gets the save.
            done_after: the request's computed tokens after this step.
        """
        request = tracked.request
        prompt = request.num_prompt_tokens
        if request.num_computed_tokens >= prompt:
            return  # decoding: vLLM keeps no state past the prompt's checkpoint
        if done_after >= prompt:
            at = state_position(prompt, self._block)
        elif done_after % self._block == 0:
            at = done_after
        else:
            return
        if at <= tracked.state_at:
            return
        blocks = state_blocks(block_ids, self._groups, at, self._block)
        if not blocks:
            self._count("state_saves_missed")
            return
        keyed = tokens_to_bytes(tracked.keyed(at))
        cold = tracked.keep is not None and at > tracked.keep
        plan.state_saves.append(StateSave(request.request_id, keyed, tracked.salt, blocks, cold))
        tracked.state_at = at
