"""The `multimodal` scenario of vllm_scenarios.py: prompts with images (a tiny BLIP-2).

BLIP-2 puts an image's placeholder tokens (the same ids for every image) at the start of
the prompt, so prompts with other images and the same text have the same token ids; their
KV differs from the first token on. A baseline engine without kvtiers answers each
(image, text) pair. Engine A (kvtiers over LMDB, vLLM's prefix cache off) serves a cat
with text 1, then a dog with text 1 (the same token ids: it must not get the cat's KV),
then the cat with text 2 (which shares the cat and the start of text 1's text). A fresh
engine B gets every prompt's whole chunks from LMDB and answers exactly as the baseline.

The `embeds` scenario (the tiny Llama): prompts given as embeddings (`prompt_embeds`, the
model's own embeddings of token prompts, so the answers equal the token prompts'). Engine A
serves them one after another (the later ones share the first four chunks), then other
embeddings of the same length (the rows scaled: vLLM holds zeros for the token ids of
both, so only the embeddings tell them apart), which must get nothing; a fresh engine B
gets every whole chunk from LMDB. Every answer equals an engine without kvtiers.

Then prompts mixing token ids and embeddings (`prompt_is_token_ids`): the token prompts with
rows `MIXED` given as their embeddings instead. Engine A first serves one token prompt, so
the first mixed prompt gets exactly the chunks before the embeddings from it; the others
share every chunk of the prefix; the same prompt with the embedded rows scaled gets the
same chunks as the first and nothing from the embeddings' chunk on. Engine B gets every
whole chunk of every mixed prompt from LMDB.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from build_tiny_llama import WORDS
from vllm_scenarios import Engine, make_prompts, tier_hits, tiers


def image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def texts() -> tuple[str, str]:
    rng = random.Random(9)
    shared = " ".join(rng.choice(WORDS) for _ in range(300))
    return shared + " red green blue", shared + " one two three small large fast"


def scenario_multimodal(model: str, work: Path) -> dict[str, Any]:
    text1, text2 = texts()
    cat, dog = image(1), image(2)
    prompts = [
        {"prompt": text1, "multi_modal_data": {"image": cat}},
        {"prompt": text1, "multi_modal_data": {"image": dog}},
        {"prompt": text2, "multi_modal_data": {"image": cat}},
    ]
    result: dict[str, Any] = {}
    base = Engine(model, None, prefix_caching=False)
    result["baseline"] = base.generate(prompts)
    base.close()

    a = Engine(model, tiers(work), prefix_caching=False)
    result["engine_a"] = [a.generate([p])[0] for p in prompts]  # one after another
    result["engine_a_stats"] = dict(a.reported)
    a.close()

    b = Engine(model, tiers(work), prefix_caching=False)
    result["engine_b"] = b.generate(prompts)
    result["engine_b_tier_hits"] = tier_hits(b.connector)
    result["engine_b_stats"] = dict(b.reported)
    b.close()
    return result


def scenario_embeds(model: str, work: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    table = load_file(str(Path(model) / "model.safetensors"))["model.embed_tokens.weight"]
    token_prompts = make_prompts(seed=7)
    prompts = [{"prompt_embeds": table[p]} for p in token_prompts]
    others = [{"prompt_embeds": table[p] * 1.5} for p in token_prompts[:1]]
    mixed = [mixed_prompt(p, table) for p in token_prompts]
    mixed_others = [mixed_prompt(token_prompts[0], table, scale=1.5)]
    result: dict[str, Any] = {}
    base = Engine(model, None, prefix_caching=False, enable_prompt_embeds=True)
    result["baseline"] = base.generate(token_prompts)
    # NOTE: engine A answers one prompt at a time; a batch of another shape can flip a
    # near tie in bf16 on some CPUs (AMX), kvtiers or not, so A has a baseline of its own.
    result["baseline_alone"] = [base.generate([p])[0] for p in token_prompts]
    result["baseline_embeds"] = base.generate(prompts)
    result["baseline_others"] = base.generate(others)
    result["baseline_mixed"] = base.generate(mixed)
    result["baseline_mixed_others"] = base.generate(mixed_others)
    base.close()

    a = Engine(model, tiers(work), prefix_caching=False, enable_prompt_embeds=True)
    result["engine_a"] = [a.generate([p])[0] for p in prompts]
    result["engine_a_others"] = a.generate(others)
    result["engine_a_text"] = a.generate(token_prompts[2:])
    result["engine_a_mixed"] = [a.generate([p])[0] for p in mixed]
    result["engine_a_mixed_others"] = a.generate(mixed_others)
    a.close()

    b = Engine(model, tiers(work), prefix_caching=False, enable_prompt_embeds=True)
    result["engine_b"] = b.generate(prompts)
    result["engine_b_mixed"] = b.generate(mixed)
    result["engine_b_tier_hits"] = tier_hits(b.connector)
    b.close()
    return result


MIXED = slice(170, 210)
"""The rows of the mixed prompts given as embeddings (the end of chunk 2, the start of 3)."""


def mixed_prompt(ids: list[int], table: Any, scale: float = 1.0) -> dict[str, Any]:
    """`ids` with rows `MIXED` given as embeddings (the model's own, times `scale`)."""
    import torch

    embeds = torch.zeros(len(ids), table.shape[1], dtype=table.dtype)
    embeds[MIXED] = table[ids[MIXED]] * scale
    mask = [not (MIXED.start <= i < MIXED.stop) for i in range(len(ids))]
    return {"prompt_embeds": embeds, "prompt_token_ids": ids, "prompt_is_token_ids": mask}


__all__ = ["scenario_embeds", "scenario_multimodal"]
