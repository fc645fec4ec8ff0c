"""The `turns` scenario of vllm_scenarios.py: a chat's next turn reuses the last answer.

With `store_generated`, a finished request's full chunks of prompt *and* answer are saved
in the step after it finishes, while vLLM holds its blocks (the connector reports the save
done through `get_finished`). The next turn of a chat is the last prompt, its answer and
new text, so it loads past the first prompt:

- engine A (DRAM over LMDB, `store_generated`) answers three prompts of 200-220 tokens
  with 72 tokens each: 271-291 tokens computed, four whole chunks of 64, where the prompts
  alone hold three; then one short prompt, whose first step runs the saves of the three;
- a baseline engine without kvtiers answers the next turns (prompt, answer, 20 new tokens);
- engine B (a fresh DRAM over the same LMDB) answers them from the pool.

The `hints` scenario: requests carry a reuse hint in `kv_transfer_params`
(`{"kvtiers": {"keep_tokens": N}}`: a conversation that ended keeps nothing, a document
question its document), and the chunks past it are stored cold in the DRAM tier.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from vllm_scenarios import CHUNK, Engine, tier_hits, tiers

ANSWER_TOKENS = 72


def _storing_answers(model: str, work: Path, lmdb_name: str) -> Engine:
    """An engine over DRAM and LMDB `lmdb_name` that stores answers (`store_generated`)."""
    return Engine(
        model,
        tiers(work, lmdb_name),
        prefix_caching=False,
        extra={"store_generated": True},
        max_tokens=ANSWER_TOKENS,
    )


def scenario_turns(model: str, work: Path) -> dict[str, Any]:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(200 + 10 * i)] for i in range(3)]
    result: dict[str, Any] = {"prompts": prompts}
    a = _storing_answers(model, work, "lmdb-turns")
    result["first"] = a.generate(prompts)
    # NOTE: `LLM.generate` stops stepping the engine once no request is unfinished, so the
    # finished requests' saves, planned for the next step, run in the next call's first
    # step (a server keeps stepping while a request waits for its save).
    a.generate([[rng.randrange(3, 500) for _ in range(40)]])
    result["flushed"] = a.connector.flush(60)
    result["first_stats"] = dict(a.reported)
    a.close()
    turns = [
        p + o["tokens"] + [rng.randrange(3, 500) for _ in range(20)]
        for p, o in zip(prompts, result["first"], strict=True)
    ]
    result["turns"] = turns
    base = Engine(model, None, prefix_caching=False)
    result["baseline"] = base.generate(turns)
    base.close()
    b = Engine(model, tiers(work, "lmdb-turns"), prefix_caching=False)
    result["second"] = b.generate(turns)
    result["second_tier_hits"] = tier_hits(b.connector)
    b.close()
    result["reset"] = _reset_with_saves_planned(model, work, prompts, rng)
    return result


def _reset_with_saves_planned(
    model: str, work: Path, prompts: list[list[int]], rng: random.Random
) -> dict[str, Any]:
    """Reset while finished requests' saves are planned, and vLLM holds their blocks."""
    engine = _storing_answers(model, work, "lmdb-reset")
    before = engine.generate(prompts)  # finished; their saves wait for the next step
    from vllm import SamplingParams

    result: dict[str, Any] = {
        "before": before,
        "held": engine.llm.reset_prefix_cache(reset_connector=True),
    }
    # One step of a request with nothing to save (no whole chunk, one output token).
    short = {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(10)]}
    engine.llm.generate([short], SamplingParams(temperature=0, max_tokens=1))
    result["after_step"] = engine.llm.reset_prefix_cache(reset_connector=True)
    result["flushed"] = engine.connector.flush(60)
    result["entries"] = [tier.usage.num_entries for tier in engine.connector.stats().tiers]
    # NOTE: the same batch as before the reset. vLLM's CPU kernels (bfloat16) need not give
    # a prompt computed alone the answer it gets in a batch of three: on an AVX-512 CPU
    # without AMX, the first prompt's 62nd answer token has two candidates 0.004 apart in
    # log-probability in the batch, and tied alone, so greedy decoding picks another token.
    result["again"] = engine.generate(prompts)
    engine.close()
    return result


def scenario_hints(model: str, work: Path) -> dict[str, Any]:
    """Four prompts of five chunks: no hint, `keep_tokens` 0, `keep_tokens` of two chunks and
    a half, and a malformed entry (ignored, counted); which chunks does DRAM hold cold?"""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(5 * CHUNK + 7)] for _ in range(4)]
    params = [None, {"kvtiers": {"keep_tokens": 0}}]
    params += [{"kvtiers": {"keep_tokens": 5 * CHUNK // 2}}, {"kvtiers": {"keep": 0}}]
    base = Engine(model, None, prefix_caching=False)
    result: dict[str, Any] = {"baseline": base.generate(prompts)}
    base.close()
    engine = Engine(model, tiers(work, None), prefix_caching=False)
    result["answers"] = engine.generate(prompts, kv_transfer_params=params)
    engine.settle()
    result["stats"] = dict(engine.reported)
    cache = engine.connector._worker._entry.cache
    policy = cache._mover._slots[0].policy
    cold = set(list(policy.candidates())[: policy.num_cold])
    result["cold"] = [[key in cold for key in cache.keys(p)] for p in prompts]
    engine.close()
    return result
