"""kvtiers' LMDB tier beside LMCache 0.5.6's `LocalDiskBackend`: store, warm and cold loads.

Both sides store and load the same chunks (the same bytes, one random chunk repeated with
each copy marked apart) in one process, in subfolders of one folder on the same disk,
their rounds interleaved (the side that goes first rotates). Two chunk sizes at 256 tokens, bf16:
256 KiB (4 layers, 1 KV head, head size 64) and 32 MiB (Llama-3-8B: 32 layers, 8 KV
heads, 128). Both run at the storage layer, from chunks already in host memory:

- kvtiers: `TieredCache` with one `lmdb` tier (`read_threads = 4`), driven by the
  key-level `put_chunks` / `get_chunks` with uint8 NumPy chunks; a batch is written through
  staging buffers of up to 32 chunks or 64 MiB, one LMDB write transaction each (each value =
  header + payload, checksummed); reads go straight into the destinations, split over the
  four threads.
- LMCache: its `LocalCPUBackend` (`local_cpu=False`, so only an allocator) and
  `LocalDiskBackend` with its defaults (4 disk threads, buffered I/O), built without a GPU
  (`dst_device="cpu"`, its event loop in a thread); chunks are `MemoryObj`s in `KV_2LTD`
  keyed by `CacheEngineKey`. A put (`batched_submit_put_task`) writes one `.pt` file per
  chunk on the disk threads; a get (`batched_get_blocking`) allocates staging objects and
  reads the files on four threads. The same runs with `use_odirect` on give the
  informative O_DIRECT rows (its writes then bypass the page cache, so its `store` already
  includes writing the data).

Per round and side: `store` = the batch until every chunk is visible (kvtiers:
`put_chunks` returned, its transactions committed; LMCache: every chunk's completion
callback ran, its file written and its key listed); neither side fsyncs, so `store+sync` adds
one `os.sync()`. `warm` = one batch load with the page cache hot (after an untimed one).
`cold` = the same after the page cache is dropped (`/proc/sys/vm/drop_caches` where
writable, else `posix_fadvise(DONTNEED)` on the side's files; kvtiers' cache is closed
first, since mapped pages cannot be dropped, and opened again untimed). Every load is
checked byte for byte. Medians over the rounds, each with fresh keys (cleared after it),
after one untimed round per side.

Goals (the remote-tier issue): at 256 KiB, store rate >= 3x LMCache's; cold load bandwidth
>= 1.5x LMCache's (both sizes).

Needs LMCache's own virtualenv (`.venv-lmcache`; `python -m benchmarks.bench_lmcache
--setup` builds it: a few minutes, 1.9 GB); the measuring runs there, as a subprocess, and
this process prints the report. Without it, `run` skips with the reason on stderr.

Run: `python -m benchmarks.bench_lmcache [--quick]`; with `KVTIERS_BENCH_WRITEMAP=1` in the
environment, kvtiers' lmdb tier takes `writemap = true`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

from benchmarks import lmcache_env
from benchmarks._common import MIB, Result, Target, main

CHUNK_TOKENS = 256
# label -> (layers, KV heads, head size); bf16, 256 tokens a chunk
SHAPES = {"256KiB": (4, 1, 64), "32MiB": (32, 8, 128)}
SIDES = ("kvtiers", "lmcache", "lmcache_odirect")
OPS = ("store", "sync", "warm", "cold")
# quick -> (bytes per chunk size, rounds)
SIZES = {False: (512 * MIB, 5), True: (128 * MIB, 1)}
STORE_GOAL = {"256KiB": 3.0}
COLD_GOAL = 1.5
_MARK = "LMCACHE_BENCH "


def _skip_reason() -> str | None:
    if lmcache_env.is_ready():
        return None
    return (
        f"{lmcache_env.VENV.name} is missing or stale; "
        "`python -m benchmarks.bench_lmcache --setup` builds it"
    )


def _measure(quick: bool) -> dict[str, Any]:
    """Run the peer process under `.venv-lmcache`; return its timings."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    cmd = [str(lmcache_env.PYTHON), "-m", "benchmarks._lmcache_peer", "--quick" if quick else ""]
    proc = subprocess.run(
        [c for c in cmd if c],
        cwd=lmcache_env.ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        timeout=1800,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the peer process failed:\n{proc.stdout[-4000:]}")
    data: dict[str, Any] = json.loads(lines[-1][len(_MARK) :])
    return data


def _median(times: dict[str, list[float]], op: str) -> float:
    if op == "store+sync":
        return statistics.median(a + b for a, b in zip(times["store"], times["sync"], strict=True))
    return statistics.median(times[op])


def _rows(label: str, run: dict[str, Any], base: str) -> list[Result]:
    """The rows of one chunk size: kvtiers against LMCache side `base`."""
    total, num_chunks = run["total_bytes"], run["num_chunks"]
    ours, theirs = run["times"]["kvtiers"], run["times"][base]
    size = f"{total // MIB} MiB"
    vs = "LMCache" if base == "lmcache" else "LMCache O_DIRECT"
    main_rows = base == "lmcache"
    out = []
    for op in ("store", "store+sync"):
        t_ours, t_base = _median(ours, op), _median(theirs, op)
        goal = STORE_GOAL.get(label) if main_rows else None
        out.append(
            Result.of_rates(
                f"{op} {num_chunks} x {label} ({size}) vs {vs}",
                num_chunks / t_ours,
                num_chunks / t_base,
                unit="chunks/s",
                target=Target("ratio", ">=", goal) if goal else None,
                notes=f"{total / t_ours / 1e9:.2f} vs {total / t_base / 1e9:.2f} GB/s",
            )
        )
    for op in ("warm", "cold"):
        t_ours, t_base = _median(ours, op), _median(theirs, op)
        goal = COLD_GOAL if op == "cold" and main_rows else None
        notes = f"{t_ours * 1e3:.0f} vs {t_base * 1e3:.0f} ms"
        if op == "cold":
            notes += f"; page cache dropped by {run['drop_method']}, "
            notes += f"{run['resident_max']:.1%} of pages left resident at most"
        out.append(
            Result.of_rates(
                f"{op} load {num_chunks} x {label} ({size}) vs {vs}",
                total / t_ours / 1e9,
                total / t_base / 1e9,
                unit="GB/s",
                target=Target("ratio", ">=", goal) if goal else None,
                notes=notes,
            )
        )
    return out


def run(quick: bool) -> list[Result]:
    """Measure both chunk sizes under `.venv-lmcache`; skip (no rows) without it."""
    reason = _skip_reason()
    if reason is not None:
        print(f"bench_lmcache: skipped: {reason}", file=sys.stderr, flush=True)
        return []
    data = _measure(quick)
    print(
        "peer: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items()),
        file=sys.stderr,
        flush=True,
    )
    results = []
    for base in ("lmcache", "lmcache_odirect"):
        for label in SHAPES:
            results += _rows(label, data["runs"][label], base)
    return results


if __name__ == "__main__":
    if sys.argv[1:] == ["--setup"]:
        print(lmcache_env.ensure())
    else:
        main(run, __doc__.splitlines()[0])
