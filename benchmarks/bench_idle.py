"""Requests after an idle pause: an LMDB load and a lookup, back to back and after a pause.

The engine benchmarks (`bench_vllm_ttft`) pause before each request (`SETTLE_S`), as a
lightly loaded server idles between requests. On a VM an idle machine is slower for a while
when work resumes (idle vCPUs are halted; waking a thread, and memory traffic, cost more at
first), so a request timed after a pause costs more than the same request back to back.
This benchmark shows how much, outside any engine, so the engine's figures can be read.

The cache is opened on a `LoopThread` and called from the main thread, as the engine
adapters call it. A request is `lookup` of a 4,096-token prompt, then `load` of it into a
reused tensor (layer-wise, as the vLLM worker loads), from one LMDB tier with the page cache
warm. The layout is the larger model of `bench_vllm_ttft` (6 layers, 8 KV heads, head size
64, bf16: 48 MiB per prompt), with 256- and 32-token chunks. Baselines, in the same
conditions: a `copy_` of the same 48 MiB between two reused tensors (for the load), and an
empty coroutine's round trip to the loop (for the lookup). Each pair is timed back to back
and after a pause, alternating. One more row per chunk size times `locate` (the lookup the
vLLM scheduler makes, which also names each chunk's tier) against `lookup`, back to back.
Last, a load of the same prompt from a DRAM tier (256-token chunks), copied out on the
default `copy_threads` against a cache copying on its loop thread alone (`copy_threads =
1`), back to back and after a pause, alternating: whether the copy threads pay off when
they must first wake up.

Run alone: `python -m benchmarks.bench_idle [--quick]`.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._common import Result, main
from kvtiers import TieredCache
from kvtiers._host_copies import default_copy_threads
from kvtiers.integrations._runtime import LoopThread

LAYOUT: dict[str, Any] = {
    "model": "bench-idle",
    "num_layers": 6,
    "num_kv_heads": 8,
    "head_size": 64,
    "dtype": "bfloat16",
}
NUM_TOKENS = 4096


async def _nothing() -> None:
    return None


def _pair(
    fn: Callable[[], object], base: Callable[[], object], pause_s: float, repeats: int
) -> tuple[float, float]:
    """Return the median seconds of `fn` and of `base`, each timed after `pause_s` idle."""
    a: list[float] = []
    b: list[float] = []
    fn()
    base()
    for _ in range(repeats):
        for f, acc in ((fn, a), (base, b)):
            time.sleep(pause_s)
            start = time.perf_counter()
            f()
            acc.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def _chunk_rows(chunk: int, pauses: tuple[float, ...], repeats: int) -> list[Result]:
    loop = LoopThread("bench-idle")
    try:
        with tempfile.TemporaryDirectory() as d:
            config = {
                "layout": {**LAYOUT, "chunk_size": chunk},
                "tiers": [{"kind": "lmdb", "path": f"{d}/lmdb", "capacity": "1GiB"}],
            }
            cache = loop.run(TieredCache.from_config(config).__aenter__())
            try:
                return _measure(loop, cache, chunk, pauses, repeats)
            finally:
                loop.run(cache.close())
    finally:
        loop.stop()


def _measure(
    loop: LoopThread, cache: TieredCache, chunk: int, pauses: tuple[float, ...], repeats: int
) -> list[Result]:
    tokens = list(range(NUM_TOKENS))
    kv = torch.randn(cache.layout.kv_shape(NUM_TOKENS)).to(torch.bfloat16)
    loop.run(cache.store(tokens, kv))
    loop.run(cache.flush())
    out = torch.empty_like(kv)
    src, dst = kv.clone(), torch.empty_like(kv)
    mib = kv.numel() * kv.element_size() / 2**20

    def on_layers(num_layers: int, num_tokens: int) -> None:
        pass

    def load() -> None:
        got = loop.run(cache.load(tokens, out=out, on_layers=on_layers))
        assert got.shape[2] == NUM_TOKENS, "the load came up short"

    def lookup() -> None:
        assert loop.run(cache.lookup(tokens)) == NUM_TOKENS, "the lookup came up short"

    def locate() -> None:
        found = loop.run(cache.locate(tokens))
        assert found.num_tokens == NUM_TOKENS, "the lookup came up short"

    results = []
    for pause in pauses:
        when = f"after {pause:g} s idle" if pause else "back to back"
        t_load, t_copy = _pair(load, lambda: dst.copy_(src), pause, repeats)
        t_look, t_trip = _pair(lookup, lambda: loop.run(_nothing()), pause, repeats)
        results.append(
            Result.of_times(
                f"LMDB load, {mib:.0f} MiB, chunk {chunk}, {when}",
                t_load,
                t_copy,
                notes=f"baseline: copy_ of {mib:.0f} MiB, same pauses",
            )
        )
        results.append(
            Result.of_times(
                f"lookup, {NUM_TOKENS} tokens, chunk {chunk}, {when}",
                t_look,
                t_trip,
                notes="baseline: an empty round trip to the cache's loop",
            )
        )
    t_locate, t_lookup = _pair(locate, lookup, 0.0, repeats)
    results.append(
        Result.of_times(
            f"locate, {NUM_TOKENS} tokens, chunk {chunk}, back to back",
            t_locate,
            t_lookup,
            notes="baseline: lookup of the same prompt",
        )
    )
    return results


def _dram_rows(pauses: tuple[float, ...], repeats: int) -> list[Result]:
    loop = LoopThread("bench-idle-dram")
    caches: list[TieredCache] = []
    try:
        for threads in (0, 1):
            config = {
                "layout": {**LAYOUT, "chunk_size": 256},
                "tiers": [{"kind": "dram", "capacity": "128MiB"}],
                "copy_threads": threads,
            }
            caches.append(loop.run(TieredCache.from_config(config).__aenter__()))
        tokens = list(range(NUM_TOKENS))
        kv = torch.randn(caches[0].layout.kv_shape(NUM_TOKENS)).to(torch.bfloat16)
        out = torch.empty_like(kv)
        mib = kv.numel() * kv.element_size() / 2**20
        for cache in caches:
            loop.run(cache.store(tokens, kv))

        def loader(cache: TieredCache) -> Callable[[], None]:
            def load() -> None:
                got = loop.run(cache.load(tokens, out=out))
                assert got.shape[2] == NUM_TOKENS, "the load came up short"

            return load

        threads = default_copy_threads()
        results = []
        for pause in pauses:
            when = f"after {pause:g} s idle" if pause else "back to back"
            t_many, t_one = _pair(loader(caches[0]), loader(caches[1]), pause, repeats)
            results.append(
                Result.of_times(
                    f"DRAM load, {mib:.0f} MiB, {threads} copy threads vs 1, {when}",
                    t_many,
                    t_one,
                    notes="baseline: the same load with copy_threads = 1, same pauses",
                )
            )
        return results
    finally:
        for cache in caches:
            loop.run(cache.close())
        loop.stop()


def run(quick: bool) -> list[Result]:
    """Run the benchmark; `quick` shortens the pause and the repetitions."""
    pauses = (0.0, 0.3) if quick else (0.0, 1.0)
    repeats = 5 if quick else 9
    results = []
    for chunk in (256, 32):
        results.extend(_chunk_rows(chunk, pauses, repeats))
    results.extend(_dram_rows(pauses, repeats))
    return results


if __name__ == "__main__":
    main(run, __doc__)
