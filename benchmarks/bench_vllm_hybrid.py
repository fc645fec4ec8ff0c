"""Time to first token of a hybrid model in a real vLLM engine, hybrid KV-cache manager on.

A random-weight Llama whose even layers attend to a 512-token window
(`tests/integrations/build_tiny_llama.py --sliding 512`; two KV-cache groups in vLLM).
Every prompt is one shared prefix plus a distinct tail, answered with one greedy token, one
request at a time; all rows from one run (one process, engines built one after another with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`), medians over the prompts:

- no cache, and the floor (vLLM's own prefix cache warm), both under the hybrid manager;
- kvtiers under the hybrid manager (its loads are asynchronous: the request waits a step
  for its chunks): from LMDB (a fresh engine per request, page cache warm) and from DRAM
  (a restarted engine's second pass; three engines), and new prompts sharing only the
  prefix;
- the same with `disable_hybrid_kv_cache_manager` (kvtiers loads layer by layer in the
  forward pass; vLLM keeps every window token's KV), from one shared pool: the hybrid
  engines stored it, so the rows also show that the two share chunks. The two modes take
  turns engine by engine.

The pair of rows that matters is kvtiers with the manager on against off: what the
asynchronous load costs. Needs `.venv-vllm` (built by `python -m pytest tests/integrations`).

Run: `python -m benchmarks.bench_vllm_hybrid [--quick]`.
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
    ttfts,
    uncached,
    warm_floor,
)
from benchmarks.bench_vllm_ttft import (
    SIZES,
    case_rows,
    engine_data,
    engine_main,
    medians,
)

WINDOW = 512
_MARK = "HYBRID_RESULT "
_MODES: dict[str, dict[str, Any]] = {
    "hybrid": {},
    "flat": {"disable_hybrid_kv_cache_manager": True},
}
_ROUNDS = 3  # engines per mode for the DRAM and new-prompt rows


def engine_side(model: str, work: Path, shared: int, distinct: int, count: int) -> dict[str, Any]:
    """Run every row in this (vLLM) process; return the timings."""
    import random

    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    head = tokens(shared)
    prompts = [head + tokens(distinct) for _ in range(count)]
    # New tails, same prefix: one set per kvtiers mode and round, since each engine stores
    # what it serves.
    fresh = {
        (tag, r): [head + tokens(distinct) for _ in range(count // _ROUNDS)]
        for tag in _MODES
        for r in range(_ROUNDS)
    }
    warmup = tokens(shared + distinct)
    out: dict[str, Any] = {}
    put = recorder(out)
    new = [p for r in range(_ROUNDS) for p in fresh["hybrid", r]]
    none, none_new = uncached(model, warmup, prompts, new)
    put("none", none)
    put("none_new", none_new)

    put("floor", warm_floor(model, warmup, prompts))

    kv = kvtiers_connector(work / "kv", None)
    log("kvtiers: fill (hybrid manager on)")
    llm = make_engine(model, kv)
    ttfts(llm, [warmup, *prompts])
    close_engine(llm)
    # The two modes take turns, engine by engine, so that the machine's slow spells
    # (single requests here swing 2-5x) fall on both.
    for row in ("lmdb", "dram", "new"):
        for tag in _MODES:
            out[f"{tag}_{row}"], out[f"cached_{tag}_{row}"] = [], []

    def add(row: str, tag: str, res: tuple[list[float], list[int]]) -> None:
        out[f"{tag}_{row}"] += res[0]
        out[f"cached_{tag}_{row}"] += res[1]
        log(f"{tag}_{row}: {[round(t * 1e3) for t in res[0]]} ms, cached {res[1]}")

    for prompt in prompts:
        for tag, args in _MODES.items():
            add("lmdb", tag, fresh_each(model, kv, warmup, [prompt], cold=False, **args))
    for r in range(_ROUNDS):
        for tag, args in _MODES.items():
            llm = make_engine(model, kv, **args)
            ttfts(llm, prompts)  # loads from LMDB, promotes into DRAM
            add("dram", tag, ttfts(llm, prompts))
            add("new", tag, ttfts(llm, fresh[tag, r]))
            close_engine(llm)
    return out


def run(quick: bool) -> list[Result]:
    """Build the model, run the engine side under `.venv-vllm`, and report the medians."""
    layers, hidden, shared, distinct, _ = SIZES["quick" if quick else "full"]
    # More prompts than bench_vllm_ttft: single requests here swing 2-5x on this 2-core
    # machine, so the medians need more of them.
    count = _ROUNDS if quick else 3 * _ROUNDS
    dims = (layers, hidden, shared, distinct, count)
    data = engine_data("benchmarks.bench_vllm_hybrid", _MARK, dims, "--sliding", str(WINDOW))
    med = medians(data)
    base, new_base, row = med["none"], med["none_new"], case_rows(data, med)
    size = (f"{layers} layers x {hidden}, window {WINDOW} on even layers, {shared} shared + "
            f"{distinct} distinct tokens, {count} prompts")  # fmt: skip

    results = [
        Result.of_times("TTFT, no cache (hybrid manager on)", base, None, notes=size),
        row("TTFT, vLLM prefix cache warm (floor)", "floor", base),
        row("TTFT, kvtiers LMDB, hybrid manager on", "hybrid_lmdb", base),
        row("TTFT, kvtiers LMDB, hybrid manager off", "flat_lmdb", base),
        row("TTFT, kvtiers DRAM, hybrid manager on", "hybrid_dram", base),
        row("TTFT, kvtiers DRAM, hybrid manager off", "flat_dram", base),
        Result.of_times(
            "TTFT, new prompts, no cache", new_base, None, notes="shared prefix + unseen tail"
        ),  # fmt: skip
        row("TTFT, new prompts, kvtiers DRAM, hybrid manager on", "hybrid_new", new_base),
        row("TTFT, new prompts, kvtiers DRAM, hybrid manager off", "flat_new", new_base),
        Result(
            "TTFT, kvtiers DRAM, manager on vs off (async load cost)",
            med["hybrid_dram"] * 1e3,
            med["flat_dram"] * 1e3,
            "ms",
            med["flat_dram"] / med["hybrid_dram"],
            "-",
            None,
            "ratio: off / on",
        ),  # fmt: skip
    ]
    print(_MARK + json.dumps({"medians_ms": {k: v * 1e3 for k, v in med.items()}, **data}))
    return results


if __name__ == "__main__":
    engine_main(_MARK, engine_side, run, __doc__, (str, Path, int, int, int))
