"""The load test's workload: concurrent tasks doing lookup/load/store on shared prefixes.

Run as `python -m tests.reliability._load CONFIG_JSON SECONDS SEED` for the second process;
it prints its tallies as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import xxhash

from kvtiers import TieredCache
from tests.conftest import make_kv, same_bytes, small_layout

LAY = small_layout()
CS = LAY.chunk_size
NUM_TASKS = 64
NUM_SYSTEM = 8  # system prompts of two chunks each, shared by many requests
NUM_USERS = 160  # distinct user turns, each one to three chunks


def _chunk_kv(prefix: tuple[int, ...]) -> torch.Tensor:
    return make_kv(LAY, CS, seed=xxhash.xxh64_intdigest(repr(prefix).encode()) % 2**31)


def workload() -> list[tuple[list[int], torch.Tensor]]:
    """Return the prompts and their KV; the KV of a chunk is a function of its prefix."""
    rng = random.Random(0)
    prompts = []
    for user in range(NUM_USERS):
        system = user % NUM_SYSTEM
        tokens = [system * 10_000 + t for t in range(2 * CS)]
        tokens += [10**6 + user * 1000 + t for t in range(rng.randint(1, 3) * CS)]
        chunks = [_chunk_kv(tuple(tokens[: (i + 1) * CS])) for i in range(len(tokens) // CS)]
        prompts.append((tokens, torch.cat(chunks, dim=2)))
    return prompts


@dataclass
class Tally:
    lookups: int = 0
    loads: int = 0
    stores: int = 0
    errors: int = 0
    wrong_bytes: int = 0
    rss_bytes: list[int] = field(default_factory=list)
    """RSS sampled once a second."""
    error_text: list[str] = field(default_factory=list)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


async def run(cache: TieredCache, seconds: float, seed: int) -> Tally:
    """Drive `cache` with `NUM_TASKS` tasks for `seconds`; return what they did."""
    prompts = workload()
    tally = Tally()
    stop = time.monotonic() + seconds

    async def task(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < stop:
            tokens, kv = rng.choice(prompts)
            try:
                n = await cache.lookup(tokens)
                tally.lookups += 1
                out = await cache.load(tokens[:n])
                tally.loads += 1
                m = out.shape[2]
                tally.wrong_bytes += not same_bytes(out, kv[:, :, :m])
                if m < len(tokens):
                    await cache.store(tokens, kv)
                    tally.stores += 1
            except Exception as exc:
                tally.errors += 1
                tally.error_text.append(repr(exc)[:200])

    async def sample() -> None:
        while time.monotonic() < stop:
            tally.rss_bytes.append(rss_bytes())
            await asyncio.sleep(1.0)

    await asyncio.gather(sample(), *(task(i) for i in range(NUM_TASKS)))
    await cache.flush()
    return tally


async def _child(cfg: dict[str, Any], seconds: float, seed: int) -> None:
    async with TieredCache.from_config(cfg) as cache:
        tally = await run(cache, seconds, seed)
        pins = cache.pin_count()
    print(json.dumps({**asdict(tally), "pins": pins}), flush=True)


if __name__ == "__main__":
    asyncio.run(_child(json.loads(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])))
