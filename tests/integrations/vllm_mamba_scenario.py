"""The `mamba-pool` scenario: a state-space hybrid's KV and recurrent state pooled by kvtiers.

Run by vllm_scenarios.py in the vLLM virtualenv. vLLM's Mamba prefix caching (align mode)
runs on the CPU stand-ins of vllm_cpu_mamba.py. A tiny Nemotron-H (a Mamba-2 layer, then an
attention layer):
- a run without connector and without prefix caching (the baseline);
- engine A, with kvtiers (DRAM over LMDB), stores the prompts' KV and each prompt's state;
- a fresh engine B resumes every prompt from kvtiers at its state (the prompt's last block
  boundary but one) and answers as the baseline;
- with the states removed from kvtiers (the KV kept), a fresh engine D is offered nothing
  (a prefill cannot resume without a state) and answers as the baseline;
- with other values stored as the states (1.0 in every 32 bits, through the public API), a
  fresh engine C answers otherwise: the engine reads the loaded state;
- engine E prefills in steps of one block (another LMDB path), so the state at each step's
  end is stored too, and a fresh engine F resumes a prompt that shares only 150 tokens
  with the others at 96, where no prompt has its checkpoint;
- prompts that share a prefix past which their checkpoints lie: vLLM ends the second one's
  step where it parts from the first, kvtiers stores that state, and a fresh engine
  resumes the third there; these engines keep the states under a `mamba_config` of their
  own.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import vllm_cpu_mamba
from vllm_scenarios import Engine, _layouts_in, bind_ranks, make_prompts, tiers

from kvtiers import TieredCache, cli
from kvtiers.integrations._side_caches import pool_config

#: The scenario's engines: vLLM's own Mamba prefix caching, kvtiers' chunk left to it.
_ALIGN: dict[str, Any] = {
    "mamba_cache_mode": "align",
    "extra": {"chunk_size": None},
    "logprobs": 20,
}


def scenario_mamba_pool(model: str, work: Path) -> dict[str, Any]:
    vllm_cpu_mamba.install()
    prompts = make_prompts(seed=5)
    partial = prompts[0][:150] + list(range(3, 103))  # shares 150 tokens with the prompts
    base = Engine(model, None, prefix_caching=False, logprobs=20)
    result: dict[str, Any] = {"baseline": base.generate(prompts), "prompts": prompts}
    result["partial_baseline"] = base.generate([partial])
    base.close()

    a = Engine(model, tiers(work), prefix_caching=True, **_ALIGN)
    result["engine_a"] = a.generate(prompts)
    a.settle()
    result["engine_a_stats"] = dict(a.reported)
    a.close()

    b = Engine(model, tiers(work), prefix_caching=True, **_ALIGN)
    result["engine_b"] = b.generate(prompts)
    b.settle()
    result["engine_b_stats"] = dict(b.reported)
    result["block"] = b.llm.llm_engine.vllm_config.cache_config.block_size
    kv_layout = b.connector.layout
    state_layout = b.connector._parts.states_entry.cache.layout
    b.close()

    # Prefill cut into steps of one block: each step's end state is stored too, so a prompt
    # sharing only 150 tokens resumes at 96, where no prompt has its checkpoint.
    e = Engine(
        model, tiers(work, "steps"), prefix_caching=True, max_num_batched_tokens=96, **_ALIGN
    )
    result["engine_e"] = e.generate(prompts)
    e.settle()
    result["engine_e_stats"] = dict(e.reported)
    e.close()
    f = Engine(model, tiers(work, "steps"), prefix_caching=True, **_ALIGN)
    result["engine_f"] = f.generate([partial])
    f.close()

    result.update(_junction(model, work))

    asyncio.run(_replace_states(work, kv_layout, state_layout, prompts, None))
    d = Engine(model, tiers(work), prefix_caching=True, **_ALIGN)
    result["engine_d"] = d.generate(prompts)
    d.close()

    asyncio.run(_replace_states(work, kv_layout, state_layout, prompts, result["block"]))
    c = Engine(model, tiers(work), prefix_caching=True, **_ALIGN)
    result["engine_c"] = c.generate(prompts)
    c.settle()
    result["engine_c_stats"] = dict(c.reported)
    c.close()
    return result


def _junction(model: str, work: Path) -> dict[str, Any]:
    """Prompts sharing 250 tokens, whose checkpoints lie past them: the second one's prefill
    ends a step where it parts from the first (vLLM keeps the state there), and kvtiers
    stores it like any step end, so a fresh engine resumes the third there. The states go
    to the LMDB path `mamba_config` names, not beside the KV's."""
    own = {**_ALIGN, "extra": {"chunk_size": None, "mamba_config": tiers(work, "junction-st")}}
    rng = random.Random(7)
    head = [rng.randrange(3, 500) for _ in range(250)]
    prompts = [head + [rng.randrange(3, 500) for _ in range(200)] for _ in range(3)]
    base = Engine(model, None, prefix_caching=False)
    result: dict[str, Any] = {"junction_baseline": base.generate(prompts[2:])}
    base.close()
    g = Engine(model, tiers(work, "junction"), prefix_caching=True, **own)
    result["junction_first"] = g.generate(prompts[:1]) + g.generate(prompts[1:2])
    g.close()
    h = Engine(model, tiers(work, "junction"), prefix_caching=True, **own)
    result["junction_third"] = h.generate(prompts[2:])
    h.close()
    result["junction_states"] = [ns["layout"] for ns in _layouts_in(work / "junction-st")]
    result["junction_beside"] = (work / "junction-mamba").exists()
    return result


def scenario_mamba_pool_mp(model: str, work: Path, tensor_parallel: int = 1) -> dict[str, Any]:
    """As `scenario_mamba_pool`'s engines A and B, in vLLM's default multiprocess mode: the
    scheduler's lookups reach the worker's states over the lookup channel (with
    `tensor_parallel` 2, each rank's states, the answer the minimum over ranks).

    The stand-ins go into every engine process through a `sitecustomize` module (run by
    each Python process that finds it on its path).
    """
    hook = work / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOOK)
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook), here])
    vllm_cpu_mamba.install()
    if tensor_parallel > 1:
        bind_ranks(tensor_parallel)
    prompts = make_prompts(seed=5)
    base = Engine(model, None, prefix_caching=False, tensor_parallel=tensor_parallel)
    result: dict[str, Any] = {"baseline": base.generate(prompts), "prompts": prompts}
    base.close()
    for name in ("engine_a", "engine_b"):
        engine = Engine(
            model, tiers(work), prefix_caching=True, tensor_parallel=tensor_parallel, **_ALIGN_MP
        )
        result[name] = engine.generate(prompts)
        result["block"] = engine.llm.llm_engine.vllm_config.cache_config.block_size
        engine.close()
    result["state_layouts"] = [ns["layout"] for ns in _layouts_in(work / "lmdb-mamba")]
    return result


_ALIGN_MP = {k: v for k, v in _ALIGN.items() if k != "logprobs"}

_HOOK = """
import vllm_cpu_mamba

vllm_cpu_mamba.install()
"""


async def _replace_states(
    work: Path, kv_layout: Any, layout: Any, prompts: list[list[int]], block: int | None
) -> None:
    """Remove every state from kvtiers; with `block`, store ones as each prompt's state."""
    purge = ["purge", str(work / "lmdb-mamba"), "--fingerprint", layout.fingerprint.hex()]
    assert cli.main(purge) == 0
    if block is None:
        return
    config = pool_config(tiers(work), None, "mamba")
    async with (
        TieredCache(config, layout=layout) as states,
        TieredCache.from_config(tiers(work), layout=kv_layout) as kv,
    ):
        for prompt in prompts:
            at = (len(prompt) - 1) // block * block
            key = states.chunk_keys([kv.keys(prompt[:at])[-1]])[0]
            ones = np.ones(layout.chunk_bytes // 4, dtype=np.float32).view(np.uint8)
            assert (await states.put_chunks([key], [ones]))[0]
