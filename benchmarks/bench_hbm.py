"""Moves between an HBM tier and host memory vs one plain `copy_` of the same bytes.

The layout is the larger TTFT model's (6 layers, 8 KV heads, head size 64, bfloat16) at
256-token chunks: 3 MiB per chunk, 48 MiB per 4,096-token prompt. The cache is an HBM tier
of one prompt over a DRAM tier (write-back, pinned host memory when CUDA is present). On a
machine without CUDA the HBM tier runs on `device = "cpu"`, its test seam: the rows then
show the copies' count and cost on the host, not a GPU's.

- `promote`: `prefetch` of a prompt held in DRAM, alternating two prompts, so every call
  promotes 16 chunks from DRAM into HBM blocks (each evicts the other prompt, which DRAM
  holds already); baseline: one `copy_` of 48 MiB from host memory (pinned on CUDA) into
  device memory.
- `load`: `load` of a prompt held in HBM into a host tensor (`out=`); baseline: one `copy_`
  of 48 MiB from device into host memory.
- `store`: `store` of a new prompt from a host tensor; each evicts the previous prompt from
  HBM, which is demoted into DRAM (48 MiB in, 48 MiB out), at steady state (DRAM full, its
  pages touched); baseline: the same two `copy_`s.

Targets (CUDA only): each at >= 0.8 of its baseline. Repetitions are interleaved and
medians reported. Run alone: `python -m benchmarks.bench_hbm [--quick]`.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import torch

from benchmarks._common import Result, Target, main
from benchmarks._timing import amedian_pair
from kvtiers import TieredCache

VOCAB = 32_000
LAYOUT = {
    "model": "bench-hbm",
    "num_layers": 6,
    "num_kv_heads": 8,
    "head_size": 64,
    "dtype": "bfloat16",
    "chunk_size": 256,
}
CHUNK_BYTES = 6 * 2 * 256 * 8 * 64 * 2
NUM_TOKENS = 4096
PROMPT_BYTES = CHUNK_BYTES * NUM_TOKENS // 256
DRAM_PROMPTS = 4


def _kv(seed: int, pin: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (6, 2, NUM_TOKENS, 8, 64)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
    kv = bits.view(torch.bfloat16)
    return kv.pin_memory() if pin else kv


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _bench(device: torch.device, repeats: int) -> list[Result]:
    cuda = device.type == "cuda"
    config = {
        "layout": LAYOUT,
        "tiers": [
            {"kind": "hbm", "capacity": PROMPT_BYTES, "device": str(device)},
            {"kind": "dram", "capacity": DRAM_PROMPTS * PROMPT_BYTES, "write_policy": "write_back"},
        ],
    }
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, NUM_TOKENS, dtype=np.int64) for _ in range(2)]
    kvs = [_kv(seed, cuda) for seed in range(2)]
    host = torch.empty_like(kvs[0])
    on_device = torch.empty(PROMPT_BYTES, dtype=torch.uint8, device=device)
    flat_host = kvs[0].view(-1).view(torch.uint8)
    out = torch.empty_like(kvs[0])

    def h2d() -> None:
        on_device.copy_(flat_host, non_blocking=cuda)
        _sync(device)

    def d2h() -> None:
        host.view(-1).view(torch.uint8).copy_(on_device, non_blocking=cuda)
        _sync(device)

    def both() -> None:
        h2d()
        d2h()

    async with TieredCache.from_config(config) as cache:
        for tokens, kv in zip(prompts, kvs, strict=True):
            assert await cache.store(tokens, kv) == NUM_TOKENS
        turn = itertools.cycle([0, 1])

        async def promote() -> None:
            assert await cache.prefetch(prompts[next(turn)]) == NUM_TOKENS
            _sync(device)

        t_promote, t_h2d = await amedian_pair(promote, h2d, repeats)
        resident = prompts[next(turn)]
        await cache.prefetch(resident)

        async def load() -> None:
            got = await cache.load(resident, out=out)
            assert got.shape[2] == NUM_TOKENS

        t_load, t_d2h = await amedian_pair(load, d2h, repeats)
        new = (rng.integers(0, VOCAB, NUM_TOKENS, dtype=np.int64) for _ in itertools.count())

        async def store() -> None:
            assert await cache.store(next(new), kvs[0]) == NUM_TOKENS
            _sync(device)

        # NOTE: steady state: DRAM full, so each demotion reuses blocks (a first fill also
        # faults in DRAM's fresh pages).
        for _ in range(DRAM_PROMPTS):
            await store()
        t_store, t_both = await amedian_pair(store, both, repeats)
        stats = {t.name: t for t in cache.stats().tiers}

    where = "GPU" if cuda else "CPU seam"
    target = Target("ratio", ">=", 0.8) if cuda else None
    base = "pinned " if cuda else ""

    def row(name: str, ours: float, theirs: float, baseline: str, note: str) -> Result:
        return Result.of_times(
            f"HBM ({where}) {name}, 48 MiB vs {baseline}",
            ours,
            theirs,
            target=target,
            notes=f"{ours * 1e3:.1f} ms vs {theirs * 1e3:.1f} ms; {note}",
        )

    return [
        row("promote from DRAM", t_promote, t_h2d, f"{base}host-to-device copy_", "prefetch"),
        row("load into host out=", t_load, t_d2h, f"device-to-{base}host copy_", "load"),
        row(
            "store, demoting the previous prompt",
            t_store,
            t_both,
            "both copy_s",
            f"{stats['dram'].demotions} demotions in all",
        ),
    ]


def run(quick: bool) -> list[Result]:
    """Time promotions, loads and stores through an HBM tier against plain copies."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return asyncio.run(_bench(device, 5 if quick else 15))


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
