"""Time to first token in a real vLLM engine with and without kvtiers serving the prefix.

Each request is a long prefix of its own (`PREFIX` tokens) plus a short question, answered
with one greedy token, one request at a time, so the measured time is the time to first
token. vLLM's own prefix cache is off in every engine, so a hit can only come from kvtiers.

- baseline: an engine without connector computes every prefix.
- kvtiers, LMDB: a restarted engine (empty DRAM tier) loads each prefix from the LMDB tier
  that an earlier engine filled.
- kvtiers, DRAM: the same engine again; the prefixes were promoted into DRAM by the loads.

The model is a random-weight Llama built offline (`tests/integrations/build_tiny_llama.py`),
8 layers of 1024 (2 of 256 with `--quick`); vLLM runs in-process on the CPU backend. The
engine side runs under the vLLM virtualenv (`.venv-vllm`, built by `python -m pytest
tests/integrations`); the parent only prints the report. Not part of `run_all`: it needs
that environment and takes about 12 minutes on two cores (1 minute with `--quick`).

Run: `python -m benchmarks.bench_vllm_ttft [--quick]`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import Result, main

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BUILDER = ROOT / "tests" / "integrations" / "build_tiny_llama.py"
BLOCK = 32
_MARK = "TTFT_RESULT "


def _engine(model: str, config: dict[str, Any] | None) -> Any:
    from vllm import LLM

    transfer = None
    if config is not None:
        transfer = {
            "kv_connector": "KVTiersConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "kvtiers.integrations.vllm",
            "kv_connector_extra_config": {"config": config},
        }
    return LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=4096,
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
    )


def _close(llm: Any) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _ttfts(llm: Any, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times, cached = [], []
    for prompt in prompts:
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        cached.append(out.num_cached_tokens or 0)
    return times, cached


def engine_side(model: str, work: Path, prefix: int, count: int) -> dict[str, Any]:
    """Run the three phases in this (vLLM) process; return the timings."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(prefix + 20)] for _ in range(count)]
    config = {
        "tiers": [
            {"kind": "dram", "capacity": "1GiB"},
            {"kind": "lmdb", "path": str(work / "lmdb"), "capacity": "4GiB"},
        ]
    }
    base = _engine(model, None)
    _ttfts(base, prompts[:1])  # warm-up
    baseline, _ = _ttfts(base, prompts)
    _close(base)
    filler = _engine(model, config)
    _ttfts(filler, prompts)  # computes and stores every prefix
    _close(filler)
    restarted = _engine(model, config)
    from_lmdb, cached_lmdb = _ttfts(restarted, prompts)
    from_dram, cached_dram = _ttfts(restarted, prompts)
    _close(restarted)
    return {
        "baseline": baseline,
        "lmdb": from_lmdb,
        "dram": from_dram,
        "cached_lmdb": cached_lmdb,
        "cached_dram": cached_dram,
    }


def run(quick: bool) -> list[Result]:
    """Build the model, run the engine side under `.venv-vllm`, and report the medians."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(
            f"{VLLM_PYTHON} is missing; `python -m pytest tests/integrations` builds it"
        )
    layers, hidden, prefix, count = (2, 256, 1024, 4) if quick else (8, 1024, 2048, 6)
    with tempfile.TemporaryDirectory(prefix="kvtiers-ttft-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run(
            [str(VLLM_PYTHON), str(BUILDER), str(model), "--layers", str(layers),
             "--hidden", str(hidden)],
            check=True, capture_output=True,
        )  # fmt: skip
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
        env.pop("VIRTUAL_ENV", None)
        cmd = [str(VLLM_PYTHON), "-m", "benchmarks.bench_vllm_ttft", "--engine", str(model),
               str(work), str(prefix), str(count)]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"engine side failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        data = json.loads(lines[-1][len(_MARK) :])
    base = statistics.median(data["baseline"])
    size = f"{layers} layers x {hidden}, prefix {prefix} tokens, {count} requests"
    results = [
        Result.of_times("TTFT, no connector (full prefill)", base, None, notes=size),
    ]
    for tier in ("lmdb", "dram"):
        cached = min(data[f"cached_{tier}"])
        results.append(
            Result.of_times(
                f"TTFT, prefix from kvtiers {tier.upper()}",
                statistics.median(data[tier]),
                base,
                notes=f"{size}; at least {cached} tokens loaded per request",
            )
        )
    return results


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--engine":
        _, _, model_dir, work_dir, prefix_tokens, num = sys.argv
        out = engine_side(model_dir, Path(work_dir), int(prefix_tokens), int(num))
        print(_MARK + json.dumps(out), flush=True)
    else:
        main(run, __doc__.splitlines()[0])
