"""A fresh process for the pooling tests: it stores or loads one prompt through a pool tier.

The tests of the pool tiers (remote, redis, mooncake) check that what one process stores,
another one, with an empty DRAM tier of its own, loads bit-identical. `run_child` runs this
module in a new interpreter: `python -m tests._pooling CONFIG_JSON ROLE TOKENS_JSON SEED`.
The prompt's KV is `make_kv(small_layout(), len(tokens), seed)`, so both sides know it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from kvtiers import TieredCache
from tests.conftest import make_kv, same_bytes, small_layout

ROOT = Path(__file__).resolve().parents[1]


def run_child(
    cfg: dict[str, Any],
    role: Literal["store", "load"],
    tokens: Sequence[int],
    *,
    seed: int = 42,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run a fresh process that opens a cache from `cfg`; return the JSON line it printed.

    Args:
        cfg: the cache's config.
        role: `"store"` stores the prompt and flushes (`{"stored": n}`); `"load"` looks it
            up and loads it (`{"n": n, "same": bit-identical, "hits": {tier name: hits}}`).
        tokens: the prompt.
        seed: the seed of the prompt's KV.
        env: variables to set in the child beyond this process's.
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    argv = ["-m", "tests._pooling", json.dumps(cfg), role, json.dumps(list(tokens)), str(seed)]
    out = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {}), "PYTHONPATH": path},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


async def _child(cfg: dict[str, Any], role: str, tokens: list[int], seed: int) -> dict[str, Any]:
    kv = make_kv(small_layout(), len(tokens), seed=seed)
    async with TieredCache.from_config(cfg) as cache:
        if role == "store":
            stored = await cache.store(tokens, kv)
            await cache.flush()
            return {"stored": stored}
        n = await cache.lookup(tokens)
        got = await cache.load(tokens[:n])
        hits = {t.name: t.hits for t in cache.stats().tiers}
        return {"n": n, "same": same_bytes(got, kv[:, :, :n]), "hits": hits}


if __name__ == "__main__":
    cfg, role, tokens, seed = sys.argv[1:]
    print(json.dumps(asyncio.run(_child(json.loads(cfg), role, json.loads(tokens), int(seed)))))
