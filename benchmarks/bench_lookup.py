"""Longest-prefix lookup of a 131,072-token prompt in an index of 1,000,000 chunks.

Times the core path of `TieredCache.lookup`: `ChunkHasher.keys(tokens)` then
`PrefixIndex.match(keys)`, against the floor of the same work: an inline xxh3_128 chain over
the prompt's bytes (no input checks) and a plain `dict` membership walk over the same keys.
The index holds many chains (some branching off others, like prompts sharing a system
prompt); the probe prompt's 512 chunks are all present, so the walk goes the whole way.

Run alone: `python -m benchmarks.bench_lookup [--quick]`.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import xxhash

from benchmarks._common import Result, Target, main
from benchmarks._timing import percentile
from kvtiers.core.index import PrefixIndex
from kvtiers.core.keys import ChunkHasher, ChunkKey
from kvtiers.core.layout import KVLayout

NUM_TOKENS = 131_072
CHUNK = 256
VOCAB = 128_256


def build_index(
    num_chunks: int, probe: list[ChunkKey], rng: np.random.Generator
) -> tuple[PrefixIndex, dict[ChunkKey, int]]:
    """Return an index of `num_chunks` keys, `probe` among them, and a dict of the same keys.

    Chains are 64 to 1,024 chunks long; a third branch off a random point of an earlier
    chain. Filler keys are random 16-byte strings: the index cares only about their links.
    """
    index = PrefixIndex(2)
    plain: dict[ChunkKey, int] = {}
    chains = [probe]
    for i in range(len(probe)):
        index.add(probe, i, 0)
    total = len(probe)
    while total < num_chunks:
        length = min(int(rng.integers(64, 1025)), num_chunks - total)
        raw = rng.bytes(16 * length)
        fresh = [ChunkKey(raw[j : j + 16]) for j in range(0, len(raw), 16)]
        base = chains[int(rng.integers(len(chains)))]
        branch = int(rng.integers(1, len(base))) if rng.random() < 1 / 3 else 0
        chain = base[:branch] + fresh
        for i in range(branch, len(chain)):
            index.add(chain, i, 0)
        chains.append(chain)
        total += length
    for key in index.keys_in(0):
        plain[key] = 1
    return index, plain


def floor_keys(arr: np.ndarray, root: bytes) -> list[bytes]:
    """Chain xxh3_128 over the chunks of a checked int64 array: the hashing floor."""
    view = memoryview(arr).cast("B")
    step = CHUNK * 8
    digest = xxhash.xxh3_128_digest
    prev, out = root, []
    for i in range(len(arr) // CHUNK):
        prev = digest(prev + view[i * step : (i + 1) * step])
        out.append(prev)
    return out


def dict_walk(plain: dict[ChunkKey, int], keys: list[bytes]) -> int:
    """Count the leading keys present in `plain`: the matching floor."""
    n = 0
    for key in keys:
        if key not in plain:
            break
        n += 1
    return n


def run(quick: bool) -> list[Result]:
    """Time hash + match against hash + dict walk, and match alone against the walk."""
    num_chunks = 100_000 if quick else 1_000_000
    runs = 50 if quick else 200
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, NUM_TOKENS, dtype=np.int64)
    hasher = ChunkHasher(KVLayout("bench", 32, 8, 128, chunk_size=CHUNK).fingerprint, CHUNK)
    probe = hasher.keys(tokens)
    start = time.perf_counter()
    index, plain = build_index(num_chunks, probe, rng)
    build_s = time.perf_counter() - start
    root = hasher.root()
    assert index.match(probe).num_chunks == len(probe) == dict_walk(plain, probe)
    assert floor_keys(tokens, root) == probe

    kv_times, floor_times, match_times, walk_times = [], [], [], []
    for i in range(runs + 5):  # five warm-up rounds
        t0 = time.perf_counter()
        index.match(hasher.keys(tokens))
        t1 = time.perf_counter()
        dict_walk(plain, floor_keys(tokens, root))
        t2 = time.perf_counter()
        index.match(probe)
        t3 = time.perf_counter()
        dict_walk(plain, probe)
        t4 = time.perf_counter()
        if i >= 5:
            kv_times.append(t1 - t0)
            floor_times.append(t2 - t1)
            match_times.append(t3 - t2)
            walk_times.append(t4 - t3)

    setting = f"{len(index):,} chunks indexed ({build_s:.1f} s to build), {runs} runs"
    p50 = statistics.median
    return [
        Result.of_times(
            "lookup 128K tok in 1M chunks, p50 (hash+match)"
            if not quick
            else f"lookup 128K tok in {num_chunks // 1000}K chunks, p50 (hash+match)",
            p50(kv_times),
            p50(floor_times),
            target=Target("value", "<", 0.5),
            notes=f"{setting}; baseline: inline xxh3_128 chain + dict walk (the floor)",
        ),
        Result.of_times(
            "lookup 128K tok, p99 (hash+match)",
            percentile(kv_times, 99),
            percentile(floor_times, 99),
        ),
        Result.of_times(
            "match 512 keys, p50 (PrefixIndex vs dict walk)",
            p50(match_times),
            p50(walk_times),
            unit="us",
            notes=f"p99 {percentile(match_times, 99) * 1e6:.0f} us vs "
            f"{percentile(walk_times, 99) * 1e6:.0f} us",
        ),
    ]


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
