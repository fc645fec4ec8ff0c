"""Prompts with items on vLLM's own classes (run with the vLLM virtualenv's python).

The last line printed is a JSON object that test_vllm_prompt_qa.py asserts on:

    python vllm_prompt_real.py requests
    python vllm_prompt_real.py identifiers MODEL_DIR --cache-gb GB

- `requests`: a `vllm.v1.request.Request` with `MultiModalFeatureSpec`s and
  `PlaceholderRange`s (one with an `is_embed` mask), a `LoRARequest`, a cache salt and
  vLLM's block hasher, through `keyable`, `key_tokens` and the scheduler side.
- `identifiers`: a tiny BLIP-2 engine (prefix caching off, processor cache of GB GiB)
  serves one image twice; prints the identifiers vLLM gave the two requests' items and
  whether kvtiers keys them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
from typing import Any


def requests() -> dict[str, Any]:
    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvtiers import LookupResult
    from kvtiers.integrations._vllm_plan import ConnectorSettings, tokens_of
    from kvtiers.integrations._vllm_prompt import key_tokens, keyable
    from kvtiers.integrations._vllm_scheduler import SchedulerSide

    block, chunk = 16, 32
    init_none_hash(sha256)

    def feature(offset: Any, length: Any, is_embed: Any = None) -> MultiModalFeatureSpec:
        place = PlaceholderRange(offset=offset, length=length, is_embed=is_embed)
        return MultiModalFeatureSpec(
            data=None, modality="image", identifier="cat", mm_position=place, mm_hash="cat"
        )

    def make(*features: MultiModalFeatureSpec) -> Request:
        tokens = list(range(100, 200))
        tokens[20:60] = [7] * 40
        return Request(
            "r",
            tokens,
            SamplingParams(max_tokens=4),
            None,
            mm_features=list(features),
            lora_request=LoRARequest("sql", 3, "/nowhere"),
            cache_salt="tenant",
            block_hasher=get_request_block_hasher(block, sha256),
        )

    r = make(feature(20, 40))
    ids = key_tokens(r, 100)
    masked = make(feature(20, 40, torch.tensor([True] * 30 + [False] * 10)))

    class Lookup:
        def __init__(self) -> None:
            self.asked: list[Any] = []

        def __call__(self, tokens: Any, salt: Any) -> concurrent.futures.Future[LookupResult]:
            self.asked.append(salt)
            future: concurrent.futures.Future[LookupResult] = concurrent.futures.Future()
            future.set_result(LookupResult(64, ("dram",)))
            return future

    lookup = Lookup()
    side = SchedulerSide(ConnectorSettings(lookup_wait_ms=0), block, chunk, lambda: lookup)
    side._kv_events = True  # vLLM's KV events on: the plan names its blocks
    side.on_new_request(r)
    matched = side.get_num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, (list(range(7)),), 64)
    r.num_computed_tokens = 64
    plan = side.build_plan({"r": 36}, lambda _: (list(range(7)),))
    (load,), (save,) = plan.loads, plan.saves
    own = np.asarray(r.all_token_ids[:96], dtype="<i8").tobytes()
    return {
        "keyable": keyable(r),
        "numpy_offset_keyable": keyable(make(feature(np.int64(20), np.int64(40)))),
        "placeholders_derived": bool((ids[20:60] >= 2**62).all()),
        "text_as_is": ids[:20].tolist() + ids[60:].tolist()
        == list(r.all_token_ids[:20]) + list(r.all_token_ids[60:]),
        "mask_keyed_alike": bool(np.array_equal(key_tokens(masked, 100), ids)),
        "matched": list(matched),
        "load_tokens": len(tokens_of(load.tokens)),
        "save_tokens": len(tokens_of(save.tokens)),
        "save_keyed": tokens_of(save.tokens).tolist() == ids[:96].tolist(),
        "origin_own_ids": save.origin is not None and save.origin.token_ids == own,
        "origin_hashes": len(save.origin.block_hashes) if save.origin else 0,
        "salt": lookup.asked[0],
    }


def identifiers(model: str, cache_gb: float) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtiers.integrations._vllm_prompt import items_hashed, keyable

    seen: list[Any] = []
    add_request = Scheduler.add_request

    def record(self: Any, request: Any) -> Any:
        seen.append(request)
        return add_request(self, request)

    Scheduler.add_request = record  # type: ignore[method-assign]
    llm = LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        block_size=32,
        max_model_len=1024,
        enable_prefix_caching=False,
        mm_processor_cache_gb=cache_gb,
        seed=0,
    )
    pixels = np.random.default_rng(1).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    prompt = {"prompt": "a small cat", "multi_modal_data": {"image": Image.fromarray(pixels)}}
    for _ in range(2):  # the same image, one request after the other
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    features = [f for r in seen for f in r.mm_features]
    return {
        "items_hashed": items_hashed(llm.llm_engine.vllm_config),
        "identifiers": [f.identifier for f in features],
        "keyable": [keyable(r) for r in seen],
        "offsets_are_int": all(
            type(f.mm_position.offset) is int and type(f.mm_position.length) is int
            for f in features
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["requests", "identifiers"])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--cache-gb", type=float, default=4.0)
    args = parser.parse_args()
    real = requests() if args.mode == "requests" else identifiers(args.model, args.cache_gb)
    print(json.dumps(real), flush=True)


if __name__ == "__main__":
    main()
