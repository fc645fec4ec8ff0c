"""The engine side of the vLLM benchmarks: engines, connector configs, timed requests.

These run in the engine process, under the vLLM virtualenv (`.venv-vllm`), one request at a
time; vLLM is imported inside the functions, so the parent process imports this module
without it. `bench_vllm_ttft` says what each row measures.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK = 32
SETTLE_S = 1.0  # pause before each timed request


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_engine(
    model: str, connector: dict[str, Any] | None, *, prefix_caching: bool = False, **llm_args: Any
) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=4608,  # 4,096-token prompts + 1 (VLLM_ALLOW_LONG_MAX_MODEL_LEN)
        max_num_batched_tokens=4608,
        enable_prefix_caching=prefix_caching,
        kv_transfer_config=connector,
        **llm_args,
    )


def kvtiers_connector(work: Path, chunk_size: int | None, *, dram: bool = True) -> dict[str, Any]:
    lmdb = {"kind": "lmdb", "path": str(work / "lmdb"), "capacity": "4GiB"}
    config = {"tiers": [{"kind": "dram", "capacity": "1GiB"}, lmdb] if dram else [lmdb]}
    return {
        "kv_connector": "KVTiersConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "kvtiers.integrations.vllm",
        "kv_connector_extra_config": {"config": config}
        | ({} if chunk_size is None else {"chunk_size": chunk_size}),
    }


def example_connector(work: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(work / "example")},
    }


def close_engine(llm: Any) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def ttft(llm: Any, prompt: list[int], *, cold: bool = False) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # Requests are isolated: background work left by the previous one (a connector's saves,
    # promotions, dirty pages) settles first, so it does not land in this request's time.
    os.sync()
    time.sleep(SETTLE_S)
    if cold:
        drop_caches()
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens or 0


def ttfts(
    llm: Any, prompts: list[list[int]], *, cold: bool = False
) -> tuple[list[float], list[int]]:
    pairs = [ttft(llm, p, cold=cold) for p in prompts]
    return [t for t, _ in pairs], [c for _, c in pairs]


Row = tuple[list[float], list[int]]
"""A row's timings: seconds per request, and the tokens each found cached."""


def recorder(out: dict[str, Any]) -> Callable[[str, Row], None]:
    """Return `put(row, timings)`: keep a row's timings in `out` (and its cached tokens under
    `cached_<row>`), and log them."""

    def put(row: str, res: Row) -> None:
        out[row], out[f"cached_{row}"] = res
        log(f"{row}: {[round(t * 1e3) for t in res[0]]} ms, cached {res[1]}")

    return put


def uncached(model: str, warmup: list[int], *prompt_sets: list[list[int]]) -> list[Row]:
    """Time each set of prompts on one engine without any cache, after an untimed warm-up."""
    log("no cache")
    llm = make_engine(model, None)
    ttft(llm, warmup)
    rows = [ttfts(llm, prompts) for prompts in prompt_sets]
    close_engine(llm)
    return rows


def warm_floor(
    model: str, warmup: list[int], prompts: list[list[int]]
) -> tuple[list[float], list[int]]:
    """Time `prompts` on vLLM's own prefix cache, warm (each prompt's second request)."""
    log("floor: vLLM prefix cache")
    llm = make_engine(model, None, prefix_caching=True)
    ttft(llm, warmup)
    ttfts(llm, prompts)
    res = ttfts(llm, prompts)
    close_engine(llm)
    return res


def fresh_each(
    model: str, connector: dict[str, Any], warmup: list[int], prompts: list[list[int]], *,
    cold: bool, **llm_args: Any,
) -> tuple[list[float], list[int]]:  # fmt: skip
    """One fresh engine per request: nothing of the previous request is in its memory.

    Each engine first answers `warmup` (stored too, so the load path is warm) untimed."""
    times, cached = [], []
    for prompt in prompts:
        llm = make_engine(model, connector, **llm_args)
        ttft(llm, warmup)
        t, c = ttft(llm, prompt, cold=cold)
        close_engine(llm)
        times.append(t)
        cached.append(c)
    return times, cached
