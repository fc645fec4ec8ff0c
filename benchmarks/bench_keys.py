"""Chunk keys of a 131,072-token prompt: `ChunkHasher.keys` vs vLLM-style block hashing.

Baselines, measured in the same run:

- vLLM-style: vLLM v1's `hash_block_tokens` with `sha256` (pickle, then SHA-256), chained over
  16-token blocks of a Python list, as vLLM holds token ids in lists;
- the limit: one `xxh3_128` pass over the prompt's int64 bytes (no chaining, no checks).

Run alone: `python -m benchmarks.bench_keys [--quick]`.
"""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import xxhash

from benchmarks._common import Result, Target, main
from benchmarks._timing import median_of, median_pair
from kvtiers.core.keys import ChunkHasher, as_token_array
from kvtiers.core.layout import KVLayout

NUM_TOKENS = 131_072
VOCAB = 128_256  # Llama 3
VLLM_BLOCK = 16


def vllm_style_keys(token_ids: list[int], block_size: int = VLLM_BLOCK) -> list[bytes]:
    """Chain SHA-256 over pickled `(parent_hash, block_tokens)`, one hash per full block."""
    parent = hashlib.sha256(b"vllm-style none hash").digest()
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        data = pickle.dumps((parent, block), protocol=pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


def raw_pass(arr: np.ndarray) -> bytes:
    """One xxh3_128 over the prompt's bytes: the floor of any hashing of them."""
    return xxhash.xxh3_128_digest(memoryview(arr).cast("B"))


def run(quick: bool) -> list[Result]:
    """Time the keys of one prompt at chunk 256 and 16, array and list input."""
    repeats = 5 if quick else 21
    rng = np.random.default_rng(0)
    arr = rng.integers(0, VOCAB, NUM_TOKENS, dtype=np.int64)
    lst = arr.tolist()
    assert len(vllm_style_keys(lst)) == NUM_TOKENS // VLLM_BLOCK
    # NOTE: what a list costs before any hashing: the checked conversion to int64.
    t_conv = median_of(lambda: as_token_array(lst), repeats)
    results = []
    for chunk, goal in ((256, 50.0), (16, 5.0)):
        layout = KVLayout("bench", 32, 8, 128, chunk_size=chunk)
        hasher = ChunkHasher(layout.fingerprint, chunk)
        assert len(hasher.keys(arr)) == NUM_TOKENS // chunk
        for label, tokens in (("ndarray", arr), ("list", lst)):
            t_kv, t_base = median_pair(
                lambda h=hasher, t=tokens: h.keys(t), lambda: vllm_style_keys(lst), repeats
            )
            results.append(
                Result.of_times(
                    f"keys 128K tok, chunk {chunk}, {label} vs vLLM-style",
                    t_kv,
                    t_base,
                    target=Target("ratio", ">=", goal),
                    notes=f"{NUM_TOKENS // chunk} keys vs {NUM_TOKENS // VLLM_BLOCK} "
                    f"block-{VLLM_BLOCK} SHA-256 hashes over a list"
                    if label == "ndarray"
                    else f"{t_conv * 1e3:.2f} ms of it is the list's conversion to int64 "
                    f"(as_token_array), which caps the ratio at {t_base / t_conv:.1f}x",
                )
            )
        t_kv, t_raw = median_pair(lambda h=hasher: h.keys(arr), lambda: raw_pass(arr), repeats)
        results.append(
            Result.of_times(
                f"keys 128K tok, chunk {chunk}, ndarray vs raw xxh3_128",
                t_kv,
                t_raw,
                notes=f"the limit: kvtiers takes {t_kv / t_raw:.2f}x one xxh3_128 pass over "
                f"the {arr.nbytes // 2**20} MiB",
            )
        )
    return results


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
