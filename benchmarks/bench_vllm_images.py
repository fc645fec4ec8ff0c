"""Time to first token for prompts with images in a real vLLM engine, three ways.

Every prompt is an image (BLIP-2: its placeholder tokens at the start) and a long text,
answered with one greedy token, one request at a time. All rows come from one run (one
process, engines built one after another with `VLLM_ENABLE_V1_MULTIPROCESSING=0`), medians
over the prompts:

- no cache: no connector, vLLM's prefix cache off (the vision encoder and a full prefill).
- floor: vLLM's own prefix cache warm (the same engine, each prompt's second request).
- kvtiers from LMDB: an earlier engine stored every prompt (DRAM over LMDB); a restarted
  engine answers each prompt once (the page cache warm), then kvtiers from DRAM: the same
  engine again (the loads promoted the chunks).
- other images: the same texts with images no engine has seen, on that engine. Their token
  ids equal the stored prompts' (the placeholders are one id for every image), so a cache
  keyed by token ids alone would serve the wrong KV; kvtiers must compute them in full.
- ExampleConnector: vLLM's built-in connector (one file per layer and prompt, keyed by the
  prompt's tokens and image hashes), filled by an earlier engine, read by a fresh one.

Before each request the script syncs and pauses `SETTLE_S`. The model is a random-weight
BLIP-2 built offline (`tests/integrations/build_tiny_llama.py --blip2`: 56x56 images of 8
tokens, a 2-layer OPT of width 256); vLLM runs in-process on the CPU backend, under the vLLM
virtualenv (`.venv-vllm`, built by `python -m pytest tests/integrations`). Not part of
`run_all`: it needs that environment.

Run: `python -m benchmarks.bench_vllm_images [--quick]`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import Result
from benchmarks._vllm_engine import (
    SETTLE_S,
    close_engine,
    example_connector,
    kvtiers_connector,
    log,
    recorder,
)
from benchmarks.bench_vllm_ttft import (
    BUILDER,
    VLLM_PYTHON,
    engine_main,
    medians,
    run_engine_side,
)

_MARK = "IMAGES_RESULT "
BLOCK = 32
MAX_LEN = 2048  # the OPT's learned positions
# (text tokens, prompts)
SIZES = {"full": (1784, 5), "quick": (504, 3)}  # with the 8 image tokens: whole chunks


def _engine(model: str, connector: dict[str, Any] | None, *, prefix_caching: bool = False) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=MAX_LEN,
        enable_prefix_caching=prefix_caching,
        kv_transfer_config=connector,
    )


def _image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _text(tokenizer: Any, tokens: int, seed: int) -> str:
    """A text of random words of about `tokens` tokens."""
    sys.path.insert(0, str(BUILDER.parent))
    from build_tiny_llama import WORDS

    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
        words.extend(rng.choice(WORDS) for _ in range(64))
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > tokens:
        words.pop()
    return " ".join(words)


def _ttft(llm: Any, prompt: dict[str, Any]) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    os.sync()
    time.sleep(SETTLE_S)
    start = time.perf_counter()
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens or 0


def _ttfts(llm: Any, prompts: list[dict[str, Any]]) -> tuple[list[float], list[int]]:
    pairs = [_ttft(llm, p) for p in prompts]
    return [t for t, _ in pairs], [c for _, c in pairs]


def engine_side(model: str, work: Path, text_tokens: int, count: int) -> dict[str, Any]:
    """Run every row in this (vLLM) process; return the timings."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [_text(tokenizer, text_tokens, seed) for seed in range(count + 1)]
    warmup = {"prompt": texts[-1], "multi_modal_data": {"image": _image(999)}}
    prompts = [{"prompt": texts[i], "multi_modal_data": {"image": _image(i)}} for i in range(count)]
    others = [
        {"prompt": texts[i], "multi_modal_data": {"image": _image(100 + i)}} for i in range(count)
    ]
    out: dict[str, Any] = {}
    put = recorder(out)

    log("no cache")
    llm = _engine(model, None)
    _ttft(llm, warmup)
    put("none", _ttfts(llm, prompts))
    close_engine(llm)

    log("floor: vLLM prefix cache")
    llm = _engine(model, None, prefix_caching=True)
    _ttft(llm, warmup)
    _ttfts(llm, prompts)
    put("floor", _ttfts(llm, prompts))
    close_engine(llm)

    kv = kvtiers_connector(work / "kv", None)
    log("kvtiers: fill")
    llm = _engine(model, kv)
    _ttfts(llm, [warmup, *prompts])
    close_engine(llm)
    llm = _engine(model, kv)
    _ttft(llm, warmup)
    put("kv_lmdb", _ttfts(llm, prompts))
    put("kv_dram", _ttfts(llm, prompts))
    put("kv_other", _ttfts(llm, others))
    close_engine(llm)

    ex = example_connector(work)
    log("ExampleConnector: fill")
    llm = _engine(model, ex)
    _ttfts(llm, [warmup, *prompts])
    close_engine(llm)
    llm = _engine(model, ex)
    _ttft(llm, warmup)
    put("ex", _ttfts(llm, prompts))
    close_engine(llm)
    out["prompt_tokens"] = len(tokenizer.encode(texts[0])) + 8
    return out


def run(quick: bool) -> list[Result]:
    """Build the model, run the engine side under `.venv-vllm`, and report the medians."""
    text_tokens, count = SIZES["quick" if quick else "full"]
    if not VLLM_PYTHON.exists():
        raise RuntimeError(
            f"{VLLM_PYTHON} is missing; `python -m pytest tests/integrations` builds it"
        )
    with tempfile.TemporaryDirectory(prefix="kvtiers-images-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run(
            [str(VLLM_PYTHON), str(BUILDER), str(model), "--blip2"], check=True, capture_output=True
        )
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
        env.pop("VIRTUAL_ENV", None)
        args = (model, work, text_tokens, count)
        data = run_engine_side("benchmarks.bench_vllm_images", _MARK, env, args)
    med = medians(data)
    base, floor = med["none"], med["floor"]

    def row(name: str, key: str) -> Result:
        cached = f"{min(data[f'cached_{key}'])}-{max(data[f'cached_{key}'])} tokens cached"
        above = (med[key] - floor) * 1e3
        return Result.of_times(name, med[key], base, notes=f"{cached}; above floor {above:,.0f} ms")

    size = f"{data['prompt_tokens']}-token prompts (an image of 8 tokens and text), {count}"
    print(_MARK + json.dumps({"medians_ms": {k: v * 1e3 for k, v in med.items()}, **data}))
    return [
        Result.of_times("TTFT, no cache (encoder + full prefill)", base, None, notes=size),
        row("TTFT, vLLM prefix cache warm (floor)", "floor"),
        row("TTFT, kvtiers from LMDB (page cache warm)", "kv_lmdb"),
        row("TTFT, kvtiers from DRAM", "kv_dram"),
        row("TTFT, other images, same texts, kvtiers (no reuse allowed)", "kv_other"),
        row("TTFT, ExampleConnector (page cache warm)", "ex"),
    ]


if __name__ == "__main__":
    engine_main(_MARK, engine_side, run, __doc__, (str, Path, int, int))
