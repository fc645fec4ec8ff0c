"""Time to first token in a real vLLM engine: kvtiers, vLLM's prefix cache, ExampleConnector.

Every prompt is one shared prefix (the same for all) plus a distinct tail (sizes in `SIZES`),
answered with one greedy token, one request at a time, so the measured
time is the time to first token. All rows come from one run (one process, engines built one
after another with `VLLM_ENABLE_V1_MULTIPROCESSING=0`), medians over the prompts:

- no cache: an engine without connector and with vLLM's prefix cache off (full prefill).
- floor: vLLM's own prefix cache warm (same engine, each prompt's second request).
- kvtiers, LMDB warm / cold: an earlier engine stored every prompt; a restarted engine with
  that LMDB as its only tier (so every request reads it) answers them, with the page cache
  warm, or dropped (`echo 3 > /proc/sys/vm/drop_caches`, needs root) right before each.
- kvtiers, DRAM: one restarted engine, second pass (the loads promoted the chunks).
- every kvtiers row twice: with the default `chunk_size` (256 tokens) and with `chunk_size` =
  the block size (32). Only whole chunks are cached; the prompts here are whole chunks of
  either size, so kvtiers loads all but the last token, which vLLM computes (vLLM's prefix
  cache and ExampleConnector recompute the last block).
- ExampleConnector warm / cold: vLLM's built-in connector (one safetensors file per layer and
  prompt, in a temp dir), filled by an earlier engine, measured in a fresh engine.
- new prompts: the shared prefix with tails no engine has seen: no cache, kvtiers (the DRAM
  engine) and ExampleConnector (which keys whole prompts, so reuses nothing).

vLLM's prefix cache is off in every engine but the floor's, so other hits come only from the
connector. Before each request the script syncs and pauses `SETTLE_S` (in `_vllm_engine`),
so background work of the previous request (kvtiers' saves and promotions) does not overlap
it; on a VM work right after a pause runs slower (`bench_idle` measures by how much). Goals:
kvtiers' time above the floor at most half of ExampleConnector's (warm and cold); on new prompts
sharing the prefix, kvtiers' TTFT at most a quarter of no cache.

The model is a random-weight Llama built offline (`tests/integrations/build_tiny_llama.py`),
sizes in `SIZES`; vLLM runs in-process on the CPU backend. The engine side runs under the vLLM
virtualenv (`.venv-vllm`, built by `python -m pytest tests/integrations`); the parent only
prints the report. Not part of `run_all`: it needs that environment and root for the cold
rows (without root they are skipped).

Run: `python -m benchmarks.bench_vllm_ttft [--quick]`; `KVTIERS_TTFT_SIZE=large` runs the
larger model of `SIZES["large"]` instead of the default one.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import Result, main
from benchmarks._vllm_engine import (
    BLOCK,
    close_engine,
    example_connector,
    kvtiers_connector,
    log,
    make_engine,
    recorder,
    ttft,
    ttfts,
    uncached,
    warm_floor,
)

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BUILDER = ROOT / "tests" / "integrations" / "build_tiny_llama.py"
_MARK = "TTFT_RESULT "
# (layers, hidden, shared tokens, distinct tokens, prompts)
SIZES = {
    "full": (2, 256, 3584, 512, 5),
    "quick": (2, 256, 896, 128, 3),
    # 16 heads, 8 KV heads, head_dim 64, bf16: 12 KiB of KV per token, a prefill of ~1 s;
    # a run takes minutes only where the CPU multiplies bf16 fast (AMX).
    "large": (6, 1024, 3584, 512, 5),
}
SIZE_ENV = "KVTIERS_TTFT_SIZE"
"""Names the size of a full run (default `full`): `KVTIERS_TTFT_SIZE=large`."""


def engine_side(model: str, work: Path, shared: int, distinct: int, count: int) -> dict[str, Any]:
    """Run every row in this (vLLM) process; return the timings."""
    import random

    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    head = tokens(shared)
    prompts = [head + tokens(distinct) for _ in range(count)]
    fresh = [head + tokens(distinct) for _ in range(count)]  # new tails, same prefix
    warmup = tokens(shared + distinct)
    can_drop = os.geteuid() == 0
    out: dict[str, Any] = {"can_drop": can_drop}
    put = recorder(out)
    none, none_new = uncached(model, warmup, prompts, fresh)
    put("none", none)
    put("none_new", none_new)

    put("floor", warm_floor(model, warmup, prompts))

    for tag, chunk in (("kv", None), ("kv32", BLOCK)):
        kv = kvtiers_connector(work / tag, chunk)
        log(f"kvtiers (chunk_size {chunk or 'default'}): fill")
        llm = make_engine(model, kv)
        ttfts(llm, [warmup, *prompts])
        close_engine(llm)
        # The LMDB rows: the same LMDB alone, so every request reads it (one engine, as
        # ExampleConnector's rows; `warmup` warms the load path).
        llm = make_engine(model, kvtiers_connector(work / tag, chunk, dram=False))
        ttft(llm, warmup)
        put(f"{tag}_lmdb_warm", ttfts(llm, prompts))
        if can_drop:
            put(f"{tag}_lmdb_cold", ttfts(llm, prompts, cold=True))
        close_engine(llm)
        llm = make_engine(model, kv)
        ttfts(llm, prompts)  # loads from LMDB, promotes into DRAM
        put(f"{tag}_dram", ttfts(llm, prompts))
        put(f"{tag}_new", ttfts(llm, fresh))
        close_engine(llm)

    ex = example_connector(work)
    log("ExampleConnector: fill")
    llm = make_engine(model, ex)
    ttfts(llm, [warmup, *prompts])
    close_engine(llm)
    llm = make_engine(model, ex)
    ttft(llm, warmup)
    put("ex_warm", ttfts(llm, prompts))
    if can_drop:
        put("ex_cold", ttfts(llm, prompts, cold=True))
    put("ex_new", ttfts(llm, fresh))
    close_engine(llm)
    return out


def _row(name: str, value: float, base: float, floor: float, notes: str, target: str = "-",
         passed: bool | None = None) -> Result:  # fmt: skip
    return Result(name, value * 1e3, base * 1e3, "ms", base / value, target, passed,
                  f"{notes}; above floor {(value - floor) * 1e3:,.0f} ms")  # fmt: skip


def build_model(work: Path, layers: int, hidden: int, *flags: str) -> tuple[Path, dict[str, str]]:
    """Build the random-weight model in `work` under `.venv-vllm`; return it and the engines' env.

    Raises:
        RuntimeError: `.venv-vllm` is missing.
    """
    if not VLLM_PYTHON.exists():
        raise RuntimeError(
            f"{VLLM_PYTHON} is missing; `python -m pytest tests/integrations` builds it"
        )
    model = work / "model"
    subprocess.run(
        [str(VLLM_PYTHON), str(BUILDER), str(model), "--layers", str(layers),
         "--hidden", str(hidden), *flags],
        check=True, capture_output=True,
    )  # fmt: skip
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    return model, env


def run_engine_side(
    module: str, mark: str, env: dict[str, str], args: Sequence[object]
) -> dict[str, Any]:
    """Run `module`'s engine side under `.venv-vllm`; return what it printed after `mark`.

    Raises:
        RuntimeError: the engine side failed or printed no result.
    """
    cmd = [str(VLLM_PYTHON), "-m", module, "--engine", *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mark)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine side failed:\n{proc.stdout[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(mark) :])
    return result


def engine_data(
    module: str, mark: str, dims: tuple[int, int, int, int, int], *flags: str
) -> dict[str, Any]:
    """Build a tiny model in a temporary folder; return `module`'s engine side's result.

    Args:
        module: the benchmark module whose engine side runs (`run_engine_side`).
        mark: the prefix of its result line.
        dims: layers, hidden size, shared tokens, distinct tokens and prompts.
        flags: `build_tiny_llama.py` flags (the model's kind).
    """
    layers, hidden, shared, distinct, count = dims
    with tempfile.TemporaryDirectory(prefix="kvtiers-bench-") as tmp:
        work = Path(tmp)
        model, env = build_model(work, layers, hidden, *flags)
        return run_engine_side(module, mark, env, (model, work, shared, distinct, count))


def case_rows(data: dict[str, Any], med: dict[str, float]) -> Callable[..., Result]:
    """Return a row maker: case `key`'s median TTFT against `against`, its cached tokens."""

    def row(name: str, key: str, against: float, notes: str = "") -> Result:
        cached = f"{min(data[f'cached_{key}'])} tokens cached (min)"
        return _row(
            name, med[key], against, med["floor"], "; ".join(n for n in (cached, notes) if n)
        )

    return row


def medians(data: dict[str, Any]) -> dict[str, float]:
    """Return the median of every timed row of an engine side's result."""
    return {
        k: statistics.median(v)
        for k, v in data.items()
        if isinstance(v, list) and not k.startswith("cached_")
    }


def engine_main(
    mark: str,
    side: Callable[..., dict[str, Any]],
    run: Callable[[bool], list[Result]],
    doc: str,
    kinds: Sequence[Callable[[str], Any]],
) -> None:
    """Be the engine side (`--engine ARGS`, converted by `kinds`) or the benchmark."""
    if len(sys.argv) == 2 + len(kinds) and sys.argv[1] == "--engine":
        args = [kind(arg) for kind, arg in zip(kinds, sys.argv[2:], strict=True)]
        print(mark + json.dumps(side(*args)), flush=True)
    else:
        main(run, doc.splitlines()[0])


def size_of(quick: bool) -> tuple[int, int, int, int, int]:
    """Return the run's `SIZES` entry: `quick`, else the one `SIZE_ENV` names (`full`).

    Raises:
        SystemExit: `SIZE_ENV` names no size.
    """
    name = os.environ.get(SIZE_ENV, "full")
    if name not in SIZES:
        raise SystemExit(f"{SIZE_ENV}: expected one of {', '.join(SIZES)}, got {name!r}")
    return SIZES["quick" if quick else name]


def run(quick: bool) -> list[Result]:
    """Build the model, run the engine side under `.venv-vllm`, and report the medians."""
    layers, hidden, shared, distinct, count = dims = size_of(quick)
    data = engine_data("benchmarks.bench_vllm_ttft", _MARK, dims)
    med = medians(data)
    base, floor = med["none"], med["floor"]
    size = (f"{layers} layers x {hidden}, {shared} shared + {distinct} distinct tokens, "
            f"{count} prompts")  # fmt: skip

    def cached(row: str) -> str:
        return f"{min(data[f'cached_{row}'])} tokens cached (min)"

    def above(row: str) -> float:
        return med[row] - floor

    results = [
        Result.of_times("TTFT, no cache (full prefill)", base, None, notes=size),
        _row("TTFT, vLLM prefix cache warm (floor)", floor, base, floor, cached("floor")),
    ]
    new_base = med["none_new"]
    for tag, label in (("kv", "kvtiers"), ("kv32", "kvtiers chunk_size 32")):
        results.append(_row(f"TTFT, {label} DRAM", med[f"{tag}_dram"], base, floor,
                            cached(f"{tag}_dram")))  # fmt: skip
        for temp in ("warm", "cold"):
            if f"{tag}_lmdb_{temp}" not in med:
                continue
            ok = above(f"{tag}_lmdb_{temp}") <= 0.5 * above(f"ex_{temp}")
            goal = f"above floor <= 0.5 x ExampleConnector's ({above(f'ex_{temp}') * 1e3:,.0f} ms)"
            results.append(_row(f"TTFT, {label} LMDB, page cache {temp}",
                                med[f"{tag}_lmdb_{temp}"], base, floor,
                                cached(f"{tag}_lmdb_{temp}"), goal, ok))  # fmt: skip
        row = f"{tag}_new"
        results.append(Result(
            f"TTFT, new prompts, {label} DRAM", med[row] * 1e3, new_base * 1e3, "ms",
            new_base / med[row], "value <= 0.25 x no cache", med[row] <= 0.25 * new_base,
            cached(row),
        ))  # fmt: skip
    for temp in ("warm", "cold"):
        if f"ex_{temp}" in med:
            results.append(_row(f"TTFT, ExampleConnector, page cache {temp}", med[f"ex_{temp}"],
                                base, floor, cached(f"ex_{temp}")))  # fmt: skip
    results.append(Result.of_times("TTFT, new prompts, no cache", new_base, None,
                                   notes="shared prefix + unseen tail"))  # fmt: skip
    results.append(Result.of_times("TTFT, new prompts, ExampleConnector", med["ex_new"], new_base,
                                   notes=cached("ex_new")))  # fmt: skip
    print(_MARK + json.dumps({"medians_ms": {k: v * 1e3 for k, v in med.items()}, **data}))
    return results


if __name__ == "__main__":
    engine_main(_MARK, engine_side, run, __doc__, (str, Path, int, int, int))
