"""Replay a synthetic multi-turn chat through a cache (`kvtiers demo`).

Several conversations share a system prompt; each request is the whole conversation so far
plus a new user turn, and the conversations take turns in a seeded random order, so the
small DRAM tier evicts and the LMDB tier below it serves what DRAM lost. Each request does
what an engine does: `lookup`, `load` the cached prefix, "prefill" the rest, `store`.

The stand-in KV of a token is a cheap function of the token and everything before it (as a
model's KV is), so every loaded chunk is checked against what its prefix must produce.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from tqdm import tqdm

from kvtiers._demo_report import format_report
from kvtiers._tensors import torch_dtype
from kvtiers.cache import TieredCache
from kvtiers.core.config import CacheConfig
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import CacheStats

__all__ = [
    "ChatRequest",
    "ChatWorkload",
    "DemoReport",
    "Mismatch",
    "ReplayTotals",
    "chat_requests",
    "default_demo_config",
    "fill_pseudo_kv",
    "format_report",
    "pseudo_kv",
    "run_demo",
]

_VOCAB = 32_000

# splitmix64 constants: a cheap, well-mixed bijection on 64-bit words.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def default_demo_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the demo's embedded config: a small DRAM tier over an LMDB tier.

    A chunk is 2 MiB (256 tokens of 8 KiB), so the 256 MiB DRAM tier holds 128 chunks and
    the chat workload spills into the 2 GiB LMDB tier, written through in the background.

    Args:
        directory: where the LMDB tier keeps its environment (`lmdb/` inside it).
    """
    return {
        "layout": {
            "model": "kvtiers-demo",
            "num_layers": 8,
            "num_kv_heads": 4,
            "head_size": 64,
            "dtype": "float16",
            "chunk_size": 256,
        },
        "tiers": [
            {"kind": "dram", "name": "dram", "capacity": "256MiB", "eviction": "lru"},
            {
                "kind": "lmdb",
                "name": "lmdb",
                "path": str(Path(directory) / "lmdb"),
                "capacity": "2GiB",
                "write_policy": "write_through",
                "read_threads": 4,
            },
        ],
    }


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """The shape of the synthetic chat; lengths are in chunks of the layout."""

    conversations: int = 20
    """Conversations, all opening with the same system prompt."""
    turns: int = 10
    """Requests per conversation."""
    seed: int = 0
    """Seed of the token ids, turn lengths and the order of the conversations."""
    system_chunks: int = 4
    """Length of the shared system prompt."""
    min_turn_chunks: float = 0.5
    """Shortest user turn or reply."""
    max_turn_chunks: float = 2.0
    """Longest user turn or reply."""

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
        if not 0 < self.min_turn_chunks <= self.max_turn_chunks:
            raise ValueError("min_turn_chunks, max_turn_chunks: expected 0 < min <= max")

    @property
    def num_requests(self) -> int:
        """Requests in the whole replay."""
        return self.conversations * self.turns


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One request: a conversation's history plus its new user turn."""

    index: int
    """Position in the replay."""
    conversation: int
    turn: int
    tokens: npt.NDArray[np.int64]
    """The whole prompt."""


def chat_requests(workload: ChatWorkload, chunk_size: int) -> Iterator[ChatRequest]:
    """Yield the requests of `workload`, conversations in seeded random order.

    After each request the conversation's history grows by the request's new turn and a
    reply, so its next request extends the prompt that was stored.
    """
    rng = np.random.default_rng(workload.seed)
    system = rng.integers(0, _VOCAB, workload.system_chunks * chunk_size, dtype=np.int64)
    histories = [system] * workload.conversations
    turns_done = [0] * workload.conversations
    active = list(range(workload.conversations))
    for index in range(workload.num_requests):
        conv = active[int(rng.integers(len(active)))]
        user = _turn_tokens(rng, workload, chunk_size)
        tokens = np.concatenate([histories[conv], user])
        yield ChatRequest(index, conv, turns_done[conv], tokens)
        histories[conv] = np.concatenate([tokens, _turn_tokens(rng, workload, chunk_size)])
        turns_done[conv] += 1
        if turns_done[conv] == workload.turns:
            active.remove(conv)


def _turn_tokens(
    rng: np.random.Generator, workload: ChatWorkload, chunk_size: int
) -> npt.NDArray[np.int64]:
    low = max(1, round(workload.min_turn_chunks * chunk_size))
    high = max(low, round(workload.max_turn_chunks * chunk_size))
    return rng.integers(0, _VOCAB, int(rng.integers(low, high + 1)), dtype=np.int64)


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _prefix_seeds(tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """Return a 64-bit seed per token, a hash of it and all tokens before."""
    positions = np.arange(len(tokens), dtype=np.uint64)
    words = _mix(tokens.astype(np.uint64) * _GOLDEN + positions)
    # NOTE: uint64 arithmetic wraps silently in NumPy arrays, which is what a hash wants.
    return _mix(np.cumsum(words, dtype=np.uint64))


def fill_pseudo_kv(tokens: npt.NDArray[np.int64], dst: torch.Tensor) -> None:
    """Write the stand-in KV of the last `dst.shape[2]` `tokens` into `dst`.

    Args:
        tokens: the whole prompt up to and including the tokens to fill.
        dst: KV shaped as `KVLayout.kv_shape(n)`, any token stride (the tail of a
            prompt's KV buffer, for instance).
    """
    num = dst.shape[2]
    # NOTE: built in integer words, so any dtype works and no value is a NaN that a
    # comparison would reject; one XOR per word keeps it cheap.
    words = _words(dst)
    seeds = _prefix_seeds(tokens)[len(tokens) - num :].view(np.int64)
    # NOTE: narrowing int64 to a smaller word wraps, which keeps the low bits of the seed.
    seed = torch.from_numpy(seeds).to(words.dtype).view((1, 1, num) + (1,) * (dst.dim() - 3))
    basis_shape = (*words.shape[:2], 1, *words.shape[3:])
    basis = torch.arange(int(np.prod(basis_shape)), dtype=torch.int64).to(words.dtype)
    torch.bitwise_xor(basis.view(basis_shape), seed, out=words)


def _words(kv: torch.Tensor) -> torch.Tensor:
    """Return `kv` viewed as the widest integer words that tile its last axis."""
    row = kv.view(torch.uint8)
    width = next(w for w in (8, 4, 2, 1) if row.shape[-1] % w == 0)
    return row.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width])


def pseudo_kv(layout: KVLayout, tokens: npt.NDArray[np.int64]) -> torch.Tensor:
    """Return the stand-in KV of `tokens`, shaped as `load` returns it."""
    kv = torch.empty(layout.kv_shape(len(tokens)), dtype=torch_dtype(layout))
    fill_pseudo_kv(tokens, kv)
    return kv


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A loaded chunk whose KV differs from what its prefix produces."""

    request: int
    conversation: int
    turn: int
    chunk_idx: int


@dataclass(slots=True)
class ReplayTotals:
    """Running totals of a replay, in tokens unless named otherwise (mutable)."""

    requests: int = 0
    prompt_tokens: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0
    short_loads: int = 0
    """Loads that returned fewer tokens than `lookup` promised (evicted in between)."""
    checked_chunks: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DemoReport:
    """The outcome of one replay."""

    workload: ChatWorkload
    config: CacheConfig
    layout: KVLayout
    stats: CacheStats
    """The cache's counters at the end of the replay (before the final drain)."""
    totals: ReplayTotals
    wall_seconds: float

    @property
    def ok(self) -> bool:
        """Return whether every loaded chunk held the right KV."""
        return not self.totals.mismatches


async def run_demo(
    config: CacheConfig, workload: ChatWorkload, *, progress: bool = False
) -> DemoReport:
    """Replay `workload` through a cache built from `config`, checking loads.

    Args:
        config: the cache config; it must include the layout.
        workload: the chat to replay.
        progress: whether to show a progress bar on stderr.

    Raises:
        ConfigError: the config is invalid or has no layout.
    """
    start = time.perf_counter()
    totals = ReplayTotals()
    async with TieredCache.from_config(config) as cache:
        buffer = _KVBuffer(cache.layout)
        with tqdm(
            total=workload.num_requests, disable=not progress, unit="req", desc="kvtiers demo"
        ) as bar:
            for request in chat_requests(workload, cache.layout.chunk_size):
                await _serve(cache, request, buffer, totals)
                served = totals.loaded_tokens / totals.prompt_tokens
                bar.set_postfix_str(f"served from cache {served:.0%}", refresh=False)
                bar.update(1)
            stats = cache.stats()
    wall_seconds = time.perf_counter() - start
    return DemoReport(workload, cache.config, cache.layout, stats, totals, wall_seconds)


class _KVBuffer:
    """One KV buffer reused across requests, as an engine reuses its KV memory."""

    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout
        self._kv = torch.empty(layout.kv_shape(0), dtype=torch_dtype(layout))

    def take(self, num_tokens: int) -> torch.Tensor:
        """Return room for `num_tokens` tokens, growing the buffer when needed."""
        if self._kv.shape[2] < num_tokens:
            size = max(num_tokens, self._kv.shape[2] * 3 // 2)
            self._kv = torch.empty(self._layout.kv_shape(size), dtype=self._kv.dtype)
        return self._kv.narrow(2, 0, num_tokens)


async def _serve(
    cache: TieredCache, request: ChatRequest, buffer: _KVBuffer, totals: ReplayTotals
) -> None:
    """Serve one request as an engine would: lookup, load, prefill, store."""
    layout, tokens = cache.layout, request.tokens
    hit = await cache.lookup(tokens)
    kv = buffer.take(len(tokens))
    # NOTE: poison what load should overwrite, so a chunk it skips cannot pass the check
    # with the KV an earlier request left in the buffer.
    kv.narrow(2, 0, hit).view(torch.uint8).fill_(0xA5)
    got = (await cache.load(tokens[:hit], out=kv)).shape[2]
    totals.mismatches.extend(_check(layout, request, kv, got))
    fill_pseudo_kv(tokens, kv.narrow(2, got, len(tokens) - got))
    await cache.store(tokens, kv)
    totals.requests += 1
    totals.prompt_tokens += len(tokens)
    totals.loaded_tokens += got
    totals.recomputed_tokens += len(tokens) - got
    totals.short_loads += got < hit
    totals.checked_chunks += got // layout.chunk_size


def _check(
    layout: KVLayout, request: ChatRequest, kv: torch.Tensor, num_tokens: int
) -> list[Mismatch]:
    """Return the loaded chunks of `kv` that differ from their stand-in KV."""
    if num_tokens == 0:
        return []
    # NOTE: NumPy compares integer words several times faster than torch.equal.
    got = _words(kv.narrow(2, 0, num_tokens)).numpy()
    want = _words(pseudo_kv(layout, request.tokens[:num_tokens])).numpy()
    if np.array_equal(got, want):
        return []
    size = layout.chunk_size
    return [
        Mismatch(request.index, request.conversation, request.turn, c)
        for c in range(num_tokens // size)
        if not np.array_equal(
            got[:, :, c * size : (c + 1) * size], want[:, :, c * size : (c + 1) * size]
        )
    ]
