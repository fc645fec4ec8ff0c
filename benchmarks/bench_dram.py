"""Bandwidth of `TieredCache.load` and `store` on one DRAM tier vs one `torch` copy.

The layout is Llama-3-8B's (32 layers, 8 KV heads, head size 128, bfloat16) at the default
chunk of 256 tokens: 128 KiB of KV per token, 32 MiB per chunk, so 1 GiB is 32 chunks
(8,192 tokens). `load` fills a preallocated destination (`out=`); the baseline is one
`dst.copy_(src)` of the same bytes into the same destination. `store` runs at steady state:
every repetition stores a new prompt into a full tier, so it evicts the previous one; its
baseline is one `copy_` of the KV into a preallocated buffer. kvtiers copies on its
`copy_threads` (default: the usable cores, at most 4), torch on its own threads; one row
runs both on one thread (`copy_threads = 1`, `torch.set_num_threads(1)`).

Run alone: `python -m benchmarks.bench_dram [--quick]`.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import torch

from benchmarks._common import GIB, MIB, Result, Target, main
from benchmarks._timing import amedian_pair
from kvtiers import TieredCache
from kvtiers._host_copies import default_copy_threads

VOCAB = 128_256
LAYOUT = {
    "model": "llama-3-8b",
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_size": 128,
    "dtype": "bfloat16",
    "chunk_size": 256,
}
BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
CHUNK = 256


def make_kv(num_tokens: int) -> torch.Tensor:
    """Return KV for `num_tokens` tokens: a random chunk repeated, each copy marked apart.

    Compare such tensors through `.view(torch.int16)`: random bits include NaNs.
    """
    kv = torch.empty((32, 2, num_tokens, 8, 128), dtype=torch.bfloat16)
    bits = kv.view(torch.int16)
    base = torch.randint(-(2**15), 2**15, (32, 2, CHUNK, 8, 128), dtype=torch.int16)
    for i in range(num_tokens // CHUNK):
        bits.narrow(2, i * CHUNK, CHUNK).copy_(base)
        bits[:, :, i * CHUNK, 0, 0] = i
    return kv


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return whether two bfloat16 tensors hold the same bits."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


async def _bench(total_bytes: int, repeats: int) -> list[Result]:
    num_tokens = total_bytes // BYTES_PER_TOKEN
    shape = (32, 2, num_tokens, 8, 128)
    rng = np.random.default_rng(0)
    kv = make_kv(num_tokens)
    dst = torch.zeros(shape, dtype=torch.bfloat16)
    sink = torch.zeros(shape, dtype=torch.bfloat16)
    config = {"layout": LAYOUT, "tiers": [{"kind": "dram", "capacity": total_bytes}]}
    prompts = (rng.integers(0, VOCAB, num_tokens, dtype=np.int64) for _ in itertools.count())
    last: list[np.ndarray] = []

    async with TieredCache.from_config(config) as cache:

        async def store() -> None:
            tokens = next(prompts)
            stored = await cache.store(tokens, kv)
            assert stored == num_tokens, stored
            last[:] = [tokens]

        t_store, t_store_copy = await amedian_pair(store, lambda: sink.copy_(kv), repeats)
        tokens = last[0]

        async def load() -> None:
            out = await cache.load(tokens, out=dst)
            assert out.shape[2] == num_tokens

        await load()
        assert same_bits(dst, kv), "load returned other bytes than were stored"
        t_load, t_copy = await amedian_pair(load, lambda: dst.copy_(kv), repeats)

    # NOTE: both on one thread shows whether a gap is in the copies' parallelism or in
    # kvtiers' own work (a multi-threaded copy_ of a strided destination waits for its
    # slowest thread).
    single = {**config, "copy_threads": 1}
    async with TieredCache.from_config(single) as cache:
        assert await cache.store(tokens, kv) == num_tokens

        async def load1() -> None:
            await cache.load(tokens, out=dst)

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t_load1, t_copy1 = await amedian_pair(load1, lambda: dst.copy_(kv), repeats)
        finally:
            torch.set_num_threads(threads)

    size = f"{total_bytes / GIB:g} GiB" if total_bytes >= GIB else f"{total_bytes // MIB} MiB"
    chunks = total_bytes // (BYTES_PER_TOKEN * CHUNK)
    copiers = default_copy_threads()
    setting = f"{chunks} chunks of 32 MiB, {copiers} copy threads, {threads} torch threads"
    return [
        Result.of_rates(
            f"DRAM load {size} into out= vs torch copy_",
            total_bytes / t_load / GIB,
            total_bytes / t_copy / GIB,
            unit="GiB/s",
            target=Target("ratio", ">=", 0.8),
            notes=f"{setting}; {t_load * 1e3:.0f} ms vs {t_copy * 1e3:.0f} ms",
        ),
        Result.of_rates(
            f"DRAM load {size}, 1 thread each vs torch copy_",
            total_bytes / t_load1 / GIB,
            total_bytes / t_copy1 / GIB,
            unit="GiB/s",
            notes=f"copy_threads = 1, torch.set_num_threads(1); {t_load1 * 1e3:.0f} ms vs "
            f"{t_copy1 * 1e3:.0f} ms",
        ),
        Result.of_rates(
            f"DRAM store {size} (evicting) vs torch copy_",
            total_bytes / t_store / GIB,
            total_bytes / t_store_copy / GIB,
            unit="GiB/s",
            notes=f"{t_store * 1e3:.0f} ms vs {t_store_copy * 1e3:.0f} ms; each store evicts "
            "the previous prompt's chunks",
        ),
    ]


def run(quick: bool) -> list[Result]:
    """Time load and store of 1 GiB (256 MiB with `quick`) against `copy_`."""
    total = 256 * MIB if quick else GIB
    return asyncio.run(_bench(total, 3 if quick else 9))


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
