"""The `pressure` scenario of vllm_scenarios.py: a full KV cache, preemptions and aborts.

A serving engine under load runs out of KV blocks: vLLM then preempts running requests
(frees their blocks, recomputes them later, asking the connector again) and clients abort
requests at any point, also while kvtiers is loading their KV. Twelve prompts in three
groups (each group shares four chunks), answered with 48 tokens each (float32), on an
engine whose KV cache holds 36 blocks of 32 tokens per KV-cache group (about three
requests at once; Llama 4's chunked groups, 18 each: about two):

- a baseline engine without kvtiers and with a roomy cache answers every prompt;
- engine A (tight cache, DRAM over LMDB) answers them all at once: it stores the prompts
  while preempting;
- engine B (tight cache, a fresh DRAM over the same LMDB) gets the requests one by one
  through vLLM's engine API and steps them; two requests are aborted: the first one whose
  KV is still on its way when it is aborted (with vLLM's hybrid KV-cache manager the load
  is asynchronous, so the request waits for it) or, failing that, one in its first step,
  and one in the middle of its decode;
- engine C (roomy cache, a fresh DRAM over the same LMDB) answers every prompt from the
  pool.

The tests run it on the tiny Llama (loads within the forward pass) and on the tiny hybrid
models (a sliding window; Llama 4's chunked local attention), whose engines keep vLLM's
hybrid KV-cache manager on (asynchronous loads).
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

from vllm_scenarios import PREFIX_TOKENS, Engine, tier_hits, tiers

TIGHT_BLOCKS = 36  # vLLM needs max_model_len (1024) / block size (32) = 32 at least
CHUNKED_BLOCKS = 18  # for max_model_len 512: 16 at least
OUTPUT_TOKENS = 48  # two block boundaries crossed while decoding


def pressure_prompts() -> list[list[int]]:
    """Return 12 prompts: three groups of four sharing four chunks, tails of 20-90 tokens."""
    rng = random.Random(7)
    prompts = []
    for _ in range(3):
        prefix = [rng.randrange(3, 500) for _ in range(PREFIX_TOKENS)]
        for i in range(4):
            prompts.append(prefix + [rng.randrange(3, 500) for _ in range(20 + 23 * i)])
    return prompts


def record_preemptions(engine: Engine) -> list[list[int]]:
    """Record the engine's preemptions: the prompt of each preempted request.

    vLLM's scheduler runs in this process; its request ids are its own, so a preempted
    request is named by its prompt.
    """
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    seen: list[list[int]] = []
    original = scheduler._preempt_request

    def preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(list(request.prompt_token_ids))
        return original(request, *args, **kwargs)

    scheduler._preempt_request = preempt
    return seen


def preempted(prompts: list[list[int]], seen: list[list[int]]) -> list[int]:
    """Return the indices of the preempted prompts, in order."""
    index = {tuple(p): i for i, p in enumerate(prompts)}
    return sorted({index[tuple(prompt)] for prompt in seen})


def tight_cache(model: str) -> dict[str, int]:
    """Return the engine settings of a tight cache: what one longest request needs.

    vLLM's hybrid KV-cache manager splits the pool between its groups: each kind of layer
    in groups of as many layers as the rarest kind has (the sliding model: one full
    attention and one window group; Llama 4's three chunked layers and one full: four).
    vLLM's start-up check counts every group at the longest request's length, while a
    chunked group holds one attention chunk at most, so Llama 4's longest request is cut to
    512 tokens (16 blocks a group) for the cache to be tight.
    """
    config = json.loads((Path(model) / "config.json").read_text())
    kinds = collections.Counter(config.get("layer_types") or ["full_attention"])
    size = min(kinds.values())
    groups = sum(-(-count // size) for count in kinds.values())
    if "chunked_attention" in kinds:
        return {"num_gpu_blocks_override": CHUNKED_BLOCKS * groups, "max_model_len": 512}
    return {"num_gpu_blocks_override": TIGHT_BLOCKS * groups}


def drive_with_aborts(engine: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    """Add the prompts as requests, step them to the end, and abort two on the way."""
    from vllm.v1.request import RequestStatus

    llm_engine = engine.llm.llm_engine
    scheduler = llm_engine.engine_core.engine_core.scheduler
    ids = [f"p{i}" for i in range(len(prompts))]
    by_prompt = {tuple(p): req_id for p, req_id in zip(prompts, ids, strict=True)}
    for req_id, prompt in zip(ids, prompts, strict=True):
        llm_engine.add_request(req_id, {"prompt_token_ids": prompt}, engine.params)
    finished: dict[str, dict[str, Any]] = {}
    aborted: dict[str, str] = {}
    steps = 0
    while llm_engine.has_unfinished_requests():
        for output in llm_engine.step():
            if output.finished and output.request_id not in aborted:
                finished[output.request_id] = {
                    "tokens": list(output.outputs[0].token_ids),
                    "cached": output.num_cached_tokens,
                }
        steps += 1
        # NOTE: the scheduler keys requests by ids of its own; a prompt names its request.
        live = {by_prompt[tuple(req.prompt_token_ids)]: req for req in scheduler.requests.values()}
        if not aborted:
            loading = [
                r
                for r, req in live.items()
                if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r not in finished
            ]
            first = loading[:1] or [r for r, req in live.items() if req.num_computed_tokens]
            if first:
                status = live[first[0]].status.name
                llm_engine.abort_request([first[0]])
                aborted[first[0]] = status
        elif len(aborted) == 1:
            decoding = [
                r
                for r, req in live.items()
                if r not in aborted and r not in finished and req.num_output_tokens >= 8
            ]
            if decoding:
                status = live[decoding[0]].status.name
                llm_engine.abort_request([decoding[0]])
                aborted[decoding[0]] = f"{status}, {live[decoding[0]].num_output_tokens} out"
    return {"finished": finished, "aborted": aborted, "steps": steps}


def scenario_pressure(model: str, work: Path) -> dict[str, Any]:
    prompts = pressure_prompts()
    result: dict[str, Any] = {"prompts": prompts}
    # NOTE: float32, so that a batch of another shape (kvtiers loads and preemptions
    # change what runs together) gives the same greedy tokens: in bfloat16 these 48-token
    # answers flip a near-tie now and then, kvtiers or not.
    args: dict[str, Any] = {
        "prefix_caching": False,
        "max_tokens": OUTPUT_TOKENS,
        "dtype": "float32",
    }
    tight = {**args, **tight_cache(model)}
    base = Engine(model, None, **args)
    result["baseline"] = base.generate(prompts)
    base.close()

    a = Engine(model, tiers(work), **tight)
    seen_a = record_preemptions(a)
    result["engine_a"] = a.generate(prompts)
    result["engine_a_preempted"] = preempted(prompts, seen_a)
    a.connector.flush(60)
    a.close()

    b = Engine(model, tiers(work), **tight)
    seen_b = record_preemptions(b)
    result["engine_b"] = drive_with_aborts(b, prompts)
    result["engine_b_preempted"] = preempted(prompts, seen_b)
    result["engine_b_tier_hits"] = tier_hits(b.connector)
    result["engine_b_stats"] = dict(b.reported)
    b.connector.flush(60)
    b.close()

    c = Engine(model, tiers(work), **args)
    result["engine_c"] = c.generate(prompts)
    result["engine_c_tier_hits"] = tier_hits(c.connector)
    c.close()
    return result
