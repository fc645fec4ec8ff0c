"""The scheduler's part in pooling a state-space model's state, with stand-in requests."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtiers import ConfigError
from kvtiers.integrations._vllm_handoff import Role, announced_tokens
from kvtiers.integrations._vllm_plan import NULL_BLOCK, ConnectorSettings, chunk_size_for, tokens_of
from kvtiers.integrations._vllm_scheduler import SchedulerSide
from kvtiers.integrations._vllm_states import state_blocks, state_position
from tests.integrations.test_vllm_scheduler import Clock, FakeLookup, request

BLOCK = 96
MAMBA = (0, 2)  # groups 0 and 2 hold Mamba layers, group 1 attention


def side(lookup: FakeLookup, kv_role: str = "kv_both") -> SchedulerSide:
    return SchedulerSide(
        ConnectorSettings(lookup_wait_ms=0),
        BLOCK,
        BLOCK,
        lambda: lookup,
        clock=Clock(),
        role=Role.of(kv_role),
        async_loads=True,
        mamba_groups=MAMBA,
    )


def tables(num_blocks: int) -> tuple[list[int], list[int], list[int]]:
    """Block tables of three groups, ids distinct and never the null block."""
    return tuple(list(range(1 + g * 100, 1 + g * 100 + num_blocks)) for g in range(3))  # type: ignore[return-value]


@given(st.integers(1, 5000), st.sampled_from([16, 64, 96, 528]))
def test_the_state_kept_for_reuse_is_at_the_last_block_boundary_before_the_last_token(
    num_tokens, block
):
    """vLLM's checkpoint (without EAGLE): a block boundary, before the last token, at most
    one block from it; 0 for a prompt of one block or less."""
    at = state_position(num_tokens, block)
    assert at % block == 0 and 0 <= at < num_tokens
    assert num_tokens - at <= block


def test_a_state_lives_in_the_block_just_before_its_boundary_in_each_mamba_group():
    blocks = tables(4)
    assert state_blocks(blocks, MAMBA, 3 * BLOCK, BLOCK) == (3, 203)
    assert state_blocks(blocks, MAMBA, 0, BLOCK) == ()  # no state before the first block
    assert state_blocks(blocks, MAMBA, 5 * BLOCK, BLOCK) == ()  # past the table
    freed = (blocks[0], blocks[1], [NULL_BLOCK, NULL_BLOCK, 203, 204])
    assert state_blocks(freed, MAMBA, 2 * BLOCK, BLOCK) == ()  # vLLM freed one group's
    assert state_blocks(None, MAMBA, BLOCK, BLOCK) == ()


def test_a_state_space_model_has_one_block_chunks():
    assert chunk_size_for(BLOCK, None, state_space=True) == BLOCK
    assert chunk_size_for(BLOCK, BLOCK, state_space=True) == BLOCK
    with pytest.raises(ConfigError, match="leave chunk_size out"):
        chunk_size_for(BLOCK, 2 * BLOCK, state_space=True)


def test_hits_end_on_a_chunk_before_the_last_token_and_loads_carry_the_state_blocks():
    """Every token cached (a prompt of whole blocks): a state-space prefill resumes at a
    block boundary, so the offer stops a whole block short, not one token short; the load
    names, per Mamba group, the block the state at its end goes into."""
    s = side(FakeLookup(hit=4 * BLOCK))
    r = request(num_tokens=4 * BLOCK)
    assert s.get_num_new_matched_tokens(r, 0) == (3 * BLOCK, True)
    s.update_state_after_alloc(r, tables(4), 3 * BLOCK)
    (load,) = s.build_plan({}, lambda _: None).loads
    assert load.end == 3 * BLOCK and load.state_blocks == (3, 203)


def test_a_load_without_a_block_for_its_state_is_planned_to_fail():
    s = side(FakeLookup(hit=2 * BLOCK))
    r = request(num_tokens=2 * BLOCK + 10)
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BLOCK, True)
    blocks = tables(3)
    blocks[2][1] = NULL_BLOCK
    s.update_state_after_alloc(r, blocks, 2 * BLOCK)
    (load,) = s.build_plan({}, lambda _: None).loads
    assert load.state_blocks == (NULL_BLOCK,)  # the worker refuses it: vLLM recomputes


def test_each_step_saves_the_state_it_leaves_where_vllm_keeps_one():
    """Chunked prefill: a step that ends on a block boundary saves the state there; the step
    that ends the prompt saves the state at its checkpoint (keyed by the tokens up to it);
    a step ending inside a block, and decoding, save none."""
    s = side(FakeLookup(hit=0))
    r = request(num_tokens=300)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    blocks = tables(4)
    (first,) = s.build_plan({"r1": 2 * BLOCK}, lambda _: blocks).state_saves
    assert first.blocks == (2, 202)  # the state at 192 is in the second block
    assert tokens_of(first.tokens).tolist() == r.all_token_ids[: 2 * BLOCK]
    r.num_computed_tokens = 2 * BLOCK
    assert not s.build_plan({"r1": 50}, lambda _: blocks).state_saves  # inside a block
    r.num_computed_tokens = 2 * BLOCK + 50
    (last,) = s.build_plan({"r1": 58}, lambda _: blocks).state_saves
    assert last.blocks == (3, 203)  # the checkpoint: the state at 288, in the third block
    assert tokens_of(last.tokens).tolist() == r.all_token_ids[:288]
    r.num_computed_tokens = 300
    assert not s.build_plan({"r1": 1}, lambda _: blocks).state_saves  # decoding


def test_a_state_past_the_requests_reuse_hint_is_saved_cold():
    s = side(FakeLookup(hit=0))
    r = request(num_tokens=300, kv_transfer_params={"kvtiers": {"keep_tokens": 200}})
    s.get_num_new_matched_tokens(r, 0)
    (first,) = s.build_plan({"r1": 2 * BLOCK}, lambda _: tables(4)).state_saves
    r.num_computed_tokens = 2 * BLOCK
    (last,) = s.build_plan({"r1": 300 - 2 * BLOCK}, lambda _: tables(4)).state_saves
    assert (first.cold, last.cold) == (False, True)  # at 192, within the hint; at 288, past


def test_no_state_is_saved_where_it_was_loaded_or_where_vllm_kept_none():
    s = side(FakeLookup(hit=2 * BLOCK))
    r = request(num_tokens=2 * BLOCK + 50)  # checkpoint 192: the state it resumes from
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BLOCK, True)
    s.update_state_after_alloc(r, tables(3), 2 * BLOCK)
    r.num_computed_tokens = 2 * BLOCK
    assert not s.build_plan({"r1": 50}, lambda _: tables(3)).state_saves
    other = request("r2", num_tokens=300)
    s.get_num_new_matched_tokens(other, 0)
    freed = tables(4)
    freed[0][2] = NULL_BLOCK
    plan = s.build_plan({"r2": 300}, lambda _: freed)
    assert not plan.state_saves
    assert s.take_counts()["state_saves_missed"] == 1


def test_a_producer_announces_the_tokens_a_consumer_can_resume_from():
    """Prefill/decode disaggregation: the KV of a prompt of whole blocks is stored up to
    its end, but its state only at its checkpoint, a block earlier; the producer announces
    the checkpoint, so a consumer does not wait for a prefix it could never resume from."""
    s = side(FakeLookup(hit=0), kv_role="kv_producer")
    r = request(num_tokens=3 * BLOCK)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    plan = s.build_plan({"r1": 3 * BLOCK}, lambda _: tables(3))
    assert plan.saves[0].start == 0 and len(tokens_of(plan.saves[0].tokens)) == 3 * BLOCK
    assert plan.state_saves[0].blocks == (2, 202)  # the state at 192
    r.num_computed_tokens = 3 * BLOCK
    _, params = s.request_finished(r, tables(3))
    assert announced_tokens(params) == 2 * BLOCK
