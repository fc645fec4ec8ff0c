"""Reuse a multi-turn chat's KV in an engine of your own, through `TieredCache`.

A tiny causal transformer in plain torch (random weights, CPU) answers a chat of several
turns, each turn's prompt being the whole conversation so far. Without a cache every turn
prefills its whole prompt; with kvtiers each turn looks up the longest cached prefix,
loads its KV, prefills only the rest, and stores the KV of the prompt and its answer for
the next turn. Both runs must produce the same answers token for token.

Run it from the repository root (a few seconds):

    python docs/examples/custom_engine.py

The cache here is a DRAM tier over an LMDB tier in a temporary folder; point
`TieredCache.from_config` at a config file to use your own tiers.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from dataclasses import dataclass

import torch

from kvtiers import TieredCache


@dataclass(frozen=True)
class ModelShape:
    """The tiny model; its KV per token is `2 * num_layers * num_heads * head_size` floats."""

    vocab: int = 512
    num_layers: int = 4
    num_heads: int = 4
    head_size: int = 32

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_size


class TinyLM(torch.nn.Module):
    """A pre-norm causal transformer whose forward pass takes and returns KV.

    KV is one tensor `(num_layers, 2, tokens, num_heads, head_size)`: the layout
    `TieredCache.load` returns and `TieredCache.store` takes.
    """

    def __init__(self, shape: ModelShape, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shape = shape
        h = shape.hidden
        self.embed = torch.nn.Embedding(shape.vocab, h)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(h, 3 * h) for _ in range(shape.num_layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(shape.num_layers))
        self.mlp = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)
            )
            for _ in range(shape.num_layers)
        )
        self.norm = torch.nn.LayerNorm(h)
        self.head = torch.nn.Linear(h, shape.vocab)

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, tokens: torch.Tensor, past: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the last position's logits and the KV of `past` plus `tokens`."""
        s = self.shape
        x = self.embed(tokens)  # (new, hidden)
        num_past = 0 if past is None else past.shape[2]
        new = tokens.shape[0]
        kv = torch.empty(s.num_layers, 2, num_past + new, s.num_heads, s.head_size)
        if past is not None:
            kv[:, :, :num_past] = past
        # position i of the new tokens sees every past token and new tokens up to i
        mask = torch.ones(new, num_past + new, dtype=torch.bool).tril(diagonal=num_past)
        for i in range(s.num_layers):
            q, k, v = self.qkv[i](torch.nn.functional.layer_norm(x, x.shape[-1:])).chunk(3, -1)
            kv[i, 0, num_past:] = k.view(new, s.num_heads, s.head_size)
            kv[i, 1, num_past:] = v.view(new, s.num_heads, s.head_size)
            keys, values = kv[i, 0].transpose(0, 1), kv[i, 1].transpose(0, 1)
            scores = q.view(new, s.num_heads, s.head_size).transpose(0, 1) @ keys.transpose(1, 2)
            scores = scores / math.sqrt(s.head_size)
            attn = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values
            x = x + self.out[i](attn.transpose(0, 1).reshape(new, s.hidden))
            x = x + self.mlp[i](torch.nn.functional.layer_norm(x, x.shape[-1:]))
        return self.head(self.norm(x[-1])), kv


def answer(
    model: TinyLM, kv: torch.Tensor, logits: torch.Tensor, length: int
) -> tuple[list[int], torch.Tensor]:
    """Decode `length` tokens greedily; return them and the KV that includes them."""
    out = []
    for _ in range(length):
        token = int(logits.argmax())
        out.append(token)
        logits, kv = model(torch.tensor([token]), kv)
    return out, kv


async def serve_turn(
    cache: TieredCache | None, model: TinyLM, prompt: list[int], reply_tokens: int
) -> tuple[list[int], int]:
    """Answer one prompt; return the answer and how many prompt tokens were prefilled."""
    past = None
    cached = 0
    if cache is not None:
        cached = await cache.lookup(prompt)
        if cached == len(prompt):  # the model must compute at least the last token
            cached -= cache.layout.chunk_size
        if cached > 0:
            past = await cache.load(prompt[:cached])
    logits, kv = model(torch.tensor(prompt[cached:]), past)
    reply, kv = answer(model, kv, logits, reply_tokens)
    if cache is not None:  # the reply's KV too: the next turn's prompt starts with it
        await cache.store(prompt + reply, kv)  # full chunks only; a partial tail is not kept
    return reply, len(prompt) - cached


async def chat(cache: TieredCache | None, model: TinyLM, turns: list[list[int]]) -> dict:
    """Run a chat whose turn `i` adds `turns[i]` to the conversation; return what it did."""
    conversation: list[int] = []
    answers, prefilled = [], []
    for message in turns:
        conversation += message
        reply, computed = await serve_turn(cache, model, conversation, reply_tokens=16)
        answers.append(reply)
        prefilled.append(computed)
        conversation += reply
    return {"answers": answers, "prefilled": prefilled}


def chat_config(shape: ModelShape, folder: str) -> dict:
    """A DRAM tier over an LMDB tier, for the tiny model's layout."""
    return {
        "layout": {
            "model": "tiny-example",
            "num_layers": shape.num_layers,
            "num_kv_heads": shape.num_heads,
            "head_size": shape.head_size,
            "dtype": "float32",
            "chunk_size": 64,
        },
        "tiers": [
            {"kind": "dram", "capacity": "64MiB"},
            {"kind": "lmdb", "path": f"{folder}/lmdb", "capacity": "256MiB"},
        ],
    }


async def main() -> int:
    shape = ModelShape()
    model = TinyLM(shape).eval()
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, shape.vocab, (300,), generator=gen).tolist()  # shared prompt
    turns = [system] + [
        torch.randint(0, shape.vocab, (40,), generator=gen).tolist() for _ in range(4)
    ]
    baseline = await chat(None, model, turns)
    with tempfile.TemporaryDirectory() as folder:
        async with TieredCache.from_config(chat_config(shape, folder)) as cache:
            cached = await chat(cache, model, turns)
            hit_tokens = cache.stats().hit_tokens
    same = cached["answers"] == baseline["answers"]
    print(f"prompt tokens prefilled per turn, no cache: {baseline['prefilled']}")
    print(f"prompt tokens prefilled per turn, kvtiers:  {cached['prefilled']}")
    print(f"tokens found in the cache: {hit_tokens}")
    print("answers identical" if same else "answers DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
