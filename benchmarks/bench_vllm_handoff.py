"""Prefill/decode hand-off through a pool: two live vLLM engines, a proxy between them.

Two engine processes run side by side, as a disaggregated deployment's instances on one
node: a prefill engine (`kv_role = "kv_producer"`) and a decode engine (`kv_consumer`),
each with its own DRAM tier over one shared `file://` pool. This process is the proxy: for
each prompt it sends the prefill engine the prompt with `max_tokens = 1`, and as soon as
the answer is back, sends the decode engine the same prompt, with the answer's
`kv_transfer_params` (the announced mode) or without (a proxy that passes nothing on). The
producer's save reaches the pool in the background, so the decode request races it; with
an announcement the decode engine waits for what was announced, without one it takes what
its lookup finds at that moment. Prompts share nothing (each is as long as a prompt of
`bench_vllm_ttft`, shared prefix and tail together), so every hand-off carries a whole
prompt; requests one at a time, `SETTLE_S` between prompts. Rows, medians over the prompts:

- decode TTFT after the hand-off, announced / not announced, against the same prompts
  prefilled in full by a decode engine without kvtiers (its TTFT is the baseline);
- the prefill engine's TTFT with kvtiers storing, against that same baseline;
- tokens the decode engine loaded, and requests that waited for a hand-off (announced) or
  found less than the whole prompt (not announced: the race lost).

The model is the random-weight Llama of `bench_vllm_ttft` (`SIZES` there); the engines run
under `.venv-vllm` (built by `python -m pytest tests/integrations`). Not part of `run_all`.

Run: `python -m benchmarks.bench_vllm_handoff [--quick]`.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import Result, main
from benchmarks._vllm_engine import BLOCK
from benchmarks.bench_vllm_ttft import ROOT, SIZES, VLLM_PYTHON, build_model

_MARK = "HANDOFF "
SETTLE_S = 1.0


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- one engine process (runs under .venv-vllm) -----------------------------------------


def _connector(role: str, pool: Path) -> dict[str, Any] | None:
    if role == "none":
        return None
    config = {
        "tiers": [
            {"kind": "dram", "capacity": "1GiB"},
            {"kind": "remote", "url": f"file://{pool}", "capacity": "4GiB"},
        ]
    }
    return {
        "kv_connector": "KVTiersConnector",
        "kv_role": role,
        "kv_connector_module_path": "kvtiers.integrations.vllm",
        "kv_connector_extra_config": {"config": config},
    }


def _record(llm: Any, counts: dict[str, float]) -> None:
    """Sum what both connectors hand vLLM as stats (scheduler and worker)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for connector in (get_kv_transfer_group(), scheduler.connector):
        original = connector.get_kv_connector_stats

        def recording(original: Any = original) -> Any:
            stats = original()
            if stats is not None:
                for key, value in stats.data.items():
                    counts[key] = counts.get(key, 0) + value
            return stats

        connector.get_kv_connector_stats = recording


def engine_process(model: str, role: str, pool: Path) -> None:
    """Serve requests read from stdin (JSON lines) until EOF; answer on stdout."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=4608,
        max_num_batched_tokens=4608,
        enable_prefix_caching=False,
        kv_transfer_config=_connector(role, pool),
    )
    counts: dict[str, float] = {}
    if role != "none":
        _record(llm, counts)
    print(_MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        if ask.get("kv_transfer_params") is not None:
            params.extra_args = {"kv_transfer_params": ask["kv_transfer_params"]}
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": ask["prompt"]}], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        answer = {
            "seconds": seconds,
            "cached": out.num_cached_tokens or 0,
            "kv_transfer_params": out.kv_transfer_params,
            "counts": dict(counts),
        }
        print(_MARK + json.dumps(answer), flush=True)
    llm.llm_engine.engine_core.shutdown()


# -- the proxy (this process) -------------------------------------------------------------


class _Engine:
    """An engine process, asked one request at a time."""

    def __init__(self, model: Path, role: str, pool: Path, env: dict[str, str]) -> None:
        cmd = [str(VLLM_PYTHON), "-m", "benchmarks.bench_vllm_handoff", "--engine",
               str(model), role, str(pool)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.role = role
        self.waits = 0.0  # hand-off waits counted so far
        self.wait_ms = 0.0  # and the milliseconds they waited

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                reply: dict[str, Any] = json.loads(line[len(_MARK) :])
                return reply
        raise RuntimeError(f"the {self.role} engine ended (exit {self.proc.wait()})")

    def ask(self, prompt: list[int], params: Any = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "kv_transfer_params": params}) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def _prompts(length: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(count)]


def _handoffs(
    prefill: _Engine, decode: _Engine, prompts: list[list[int]], *, announce: bool
) -> list[dict[str, Any]]:
    """Hand each prompt from the prefill engine to the decode engine, as a proxy does."""
    rows = []
    for prompt in prompts:
        time.sleep(SETTLE_S)
        first = prefill.ask(prompt)
        second = decode.ask(prompt, first["kv_transfer_params"] if announce else None)
        waits = second["counts"].get("handoff_waits", 0)
        row = {"prefill": first, "decode": second, "waited": waits > decode.waits}
        row["wait_ms"] = decode.wait_ms  # the decode engine's waits summed before this request
        rows.append(row)
        decode.waits, decode.wait_ms = waits, second["counts"].get("handoff_wait_ms", 0)
        _log(f"prefill {first['seconds'] * 1e3:.0f} ms, decode {second['seconds'] * 1e3:.0f} ms "
             f"({second['cached']} cached, announced {announce})")  # fmt: skip
    return rows


def run(quick: bool) -> list[Result]:
    """Build the model, run the engines and the proxy, and report the medians."""
    layers, hidden, shared, distinct, count = SIZES["quick" if quick else "full"]
    with tempfile.TemporaryDirectory(prefix="kvtiers-handoff-") as tmp:
        work = Path(tmp)
        model, env = build_model(work, layers, hidden)
        pool = work / "pool"
        _log("starting the prefill and decode engines")
        prefill = _Engine(model, "kv_producer", pool, env)
        decode = _Engine(model, "kv_consumer", pool, env)
        prefill.answer(), decode.answer()
        length = shared + distinct
        warm = _prompts(length, 1, seed=9)
        _handoffs(prefill, decode, warm, announce=True)  # untimed: first-request costs
        announced = _handoffs(prefill, decode, _prompts(length, count, 1), announce=True)
        silent = _handoffs(prefill, decode, _prompts(length, count, 2), announce=False)
        prefill.close(), decode.close()
        _log("a decode engine without kvtiers (full prefill)")
        plain = _Engine(model, "none", pool, env)
        plain.answer()
        plain.ask(warm[0])
        full = []
        for prompt in _prompts(length, count, 1):
            time.sleep(SETTLE_S)
            full.append(plain.ask(prompt)["seconds"])
        plain.close()
    return _report(announced, silent, full, f"{layers} layers x {hidden}, prompts of "
                   f"{length} tokens sharing none, {count} of them")  # fmt: skip


def _report(
    announced: list[dict[str, Any]], silent: list[dict[str, Any]], full: list[float], size: str
) -> list[Result]:
    base = statistics.median(full)

    def median(rows: list[dict[str, Any]], side: str) -> float:
        return statistics.median(r[side]["seconds"] for r in rows)

    def loaded(rows: list[dict[str, Any]]) -> str:
        cached = [r["decode"]["cached"] for r in rows]
        waited = sum(r["waited"] for r in rows)
        wait_ms = rows[-1]["decode"]["counts"].get("handoff_wait_ms", 0) - rows[0]["wait_ms"]
        return (f"cached tokens {cached}; requests that waited for the hand-off: {waited}"
                + (f", {wait_ms / waited:.0f} ms each on average" if waited else ""))  # fmt: skip

    results = [
        Result.of_times("decode TTFT, no kvtiers (full prefill)", base, None, notes=size),
        Result.of_times("decode TTFT after hand-off, announced", median(announced, "decode"),
                        base, notes=loaded(announced)),  # fmt: skip
        Result.of_times("decode TTFT after hand-off, not announced", median(silent, "decode"),
                        base, notes=loaded(silent)),  # fmt: skip
        Result.of_times("prefill TTFT, kv_producer storing", median(announced, "prefill"), base,
                        notes="the prefill engine's own time, saves in the background"),
    ]  # fmt: skip
    print(_MARK + json.dumps({"announced": announced, "silent": silent, "full": full}))
    return results


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--engine":
        engine_process(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    else:
        main(run, __doc__.splitlines()[0])
