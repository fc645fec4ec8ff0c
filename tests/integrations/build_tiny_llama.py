"""Build a tiny random-weight Llama and a byte-level BPE tokenizer, offline, into a folder.

Run with the vLLM virtualenv's python: `python build_tiny_llama.py OUT_DIR [--layers N
--hidden H] [--mla]` (2 layers of 256 by default; benchmarks ask for bigger ones). With
`--sliding W` even layers attend to a window of W tokens (a hybrid model); with
`--mla` the model is a dense DeepSeek-V2 instead (multi-head latent attention, the latent
of 512 + 64 that vLLM's CPU MLA kernel requires); with `--mamba`, a Nemotron-H (a Mamba-2
layer, then an attention layer: a state-space hybrid); with `--llama4 C`, a dense Llama 4
whose layers attend within chunks of C tokens, but every fourth (chunked local attention, a
hybrid model); with `--blip2`, a tiny BLIP-2 (images in the prompt) with its image
processor. Deterministic:
the same seed gives the same weights, so greedy outputs agree across processes.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
WORDS = (
    "the",
    "a",
    "cache",
    "layer",
    "token",
    "model",
    "prefix",
    "chunk",
    "tier",
    "disk",
    "memory",
    "block",
    "engine",
    "request",
    "prompt",
    "shared",
    "system",
    "answer",
    "question",
    "user",
    "reads",
    "writes",
    "loads",
    "stores",
    "quickly",
    "slowly",
    "every",
    "many",
    "few",
    "one",
    "two",
    "three",
    "red",
    "green",
    "blue",
    "small",
    "large",
    "fast",
    "quiet",
    "loud",
)


def _sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(count)]


def build(
    out: Path,
    layers: int = 2,
    hidden: int = 256,
    kind: str = "llama",
    sliding: int = 0,
    attention_chunk: int = 0,
) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(["<s>", "</s>", "<unk>"]),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(out)

    torch.manual_seed(0)
    if kind == "mla":
        model = _deepseek_v2(layers, hidden)
    elif kind == "mamba":
        model = _nemotron_h(layers, hidden)
    elif kind == "llama4":
        model = _llama4(layers, hidden, attention_chunk)
    else:
        model = _llama(layers, hidden, sliding)
    model.to(torch.bfloat16).save_pretrained(out)


def _tokenizer(special_tokens: list[str]) -> Any:
    """A byte-level BPE tokenizer of `VOCAB_SIZE` ids trained on `_sentences`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_sentences(3000, seed=1), trainer)
    return tok


def build_blip2(out: Path, query_tokens: int = 8) -> None:
    """A tiny random-weight BLIP-2 (a vision encoder, a Q-Former and a 2-layer OPT) with
    its processor: each 56x56 image becomes `query_tokens` placeholder tokens."""
    import torch
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessor,
        OPTConfig,
        PreTrainedTokenizerFast,
    )

    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(["<pad>", "</s>", "<unk>", "<image>"]),
        bos_token="</s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    text = OPTConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        ffn_dim=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        word_embed_proj_dim=256,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    vision = Blip2VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        encoder_hidden_size=64,
    )
    config = Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=query_tokens,
        image_token_index=fast.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    Blip2ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(out)
    images = BlipImageProcessor(size={"height": 56, "width": 56})
    Blip2Processor(
        image_processor=images, tokenizer=fast, num_query_tokens=query_tokens
    ).save_pretrained(out)


def _sizes(layers: int, hidden: int) -> dict[str, Any]:
    """Return the config fields the decoder models share: sizes, heads, special tokens."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 128),
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


def _llama(layers: int, hidden: int, sliding: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    # NOTE: with `sliding`, even layers attend to the last `sliding` tokens only (vLLM's
    # Llama reads `layer_types`): a hybrid model, two KV-cache groups in vLLM.
    window: dict[str, Any] = {}
    if sliding:
        kinds = ("sliding_attention", "full_attention")
        window = {"layer_types": [kinds[i % 2] for i in range(layers)], "sliding_window": sliding}
    config = LlamaConfig(**_sizes(layers, hidden), **window)
    return LlamaForCausalLM(config)


def _llama4(layers: int, hidden: int, attention_chunk: int) -> Any:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    # NOTE: Llama 4 attends within chunks of `attention_chunk` tokens on three layers of
    # four (the fourth has no RoPE and attends to every token); vLLM puts those layers in
    # a KV-cache group of their own. Dense MLPs only: no layer has experts.
    config = Llama4TextConfig(
        **_sizes(layers, hidden),
        intermediate_size_mlp=2 * hidden,
        num_local_experts=1,
        num_experts_per_tok=1,
        interleave_moe_layer_step=layers + 1,
        attention_chunk_size=attention_chunk,
        use_qk_norm=False,
        attn_temperature_tuning=False,
        pad_token_id=2,
    )
    return Llama4ForCausalLM(config)


def _deepseek_v2(layers: int, hidden: int) -> Any:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=layers,  # every layer dense: no experts
        n_routed_experts=4,  # unused: no layer has experts
        moe_intermediate_size=hidden,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
    )
    return DeepseekV2ForCausalLM(config)


def _nemotron_h(layers: int, hidden: int) -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        **_sizes(layers, hidden),
        hybrid_override_pattern=("M*" * layers)[:layers],  # Mamba-2, attention, ...
        mamba_num_heads=2 * hidden // 64,
        mamba_head_dim=64,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        expand=2,
        chunk_size=64,
        pad_token_id=2,
    )
    return NemotronHForCausalLM(config)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--mla", action="store_true")
    parser.add_argument("--mamba", action="store_true")
    parser.add_argument("--blip2", action="store_true")
    parser.add_argument("--sliding", type=int, default=0, help="a window for even layers")
    parser.add_argument("--llama4", type=int, default=0, help="Llama 4, this attention chunk")
    args = parser.parse_args()
    if args.blip2:
        build_blip2(args.out)
    else:
        kind = "mla" if args.mla else "mamba" if args.mamba else "llama"
        kind = "llama4" if args.llama4 else kind
        build(args.out, args.layers, args.hidden, kind, args.sliding, args.llama4)
