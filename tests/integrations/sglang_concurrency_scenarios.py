"""SGLang storage-backend scenarios with many threads at once (SGLang's virtualenv).

HiCache calls its storage backend from its prefetch and backup threads and the scheduler
thread at once; an exception in one of them ends it for good. Each scenario here builds
real host pools (`sglang_scenarios.make_host`), runs threads on overlapping page hashes,
and prints one JSON object: what the threads saw (hits checked byte for byte), what
escaped (tracebacks) and what stayed behind (threads, registry entries).

    python sglang_concurrency_scenarios.py overlap WORKDIR KIND LAYOUT TIERS [...]
    python sglang_concurrency_scenarios.py close WORKDIR
    python sglang_concurrency_scenarios.py faults WORKDIR KIND LAYOUT remote|lmdb
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sglang_scenarios as sc
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolName, PoolTransfer

from kvtiers.integrations._runtime import CACHES

sc.TOKENS = 4096  # 256 pages: 16 sources and a private destination range per thread
N = 16  # pages under test: key i is always the page at host page i
THREADS = 4
GUARD = 240.0  # seconds: a hang guard only, never a timing check


def tiers_of(workdir: Path, kind: str, name: str) -> dict[str, Any]:
    """Return a config: `lmdb`, `dram-lmdb` or `remote` (DRAM over a `file://` pool).

    The DRAM tier holds 4 pages, so the pages below it are read and promoted all the time.
    """
    dram = {"kind": "dram", "capacity": "128KiB" if kind == "mha" else "24KiB"}
    lmdb = {"kind": "lmdb", "path": str(workdir / "lmdb"), "capacity": "64MiB"}
    pool = {"kind": "remote", "url": f"file://{workdir / 'pool'}", "capacity": "64MiB"}
    tiers = {"lmdb": [lmdb], "dram-lmdb": [dram, lmdb], "remote": [dram, pool]}[name]
    return {"tiers": [tiers[0], *(dict(t, write_policy="write_through") for t in tiers[1:])]}


class Calls:
    """Random calls on keys `0..N-1` from several threads; hits compared with `want`."""

    def __init__(self, backend: Any, host: Any) -> None:
        self.backend, self.host = backend, host
        self.keys = sc.keys_for(N)
        self.want = sc.page_bytes(host, sc.slots(host, 0, N), N)
        self.lock = threading.Lock()
        self.seen = {"hits": 0, "wrong": 0, "set_true": 0, "calls": 0, "bad_exists": 0}
        self.errors: list[str] = []
        self.stop = threading.Event()

    def one(self, rnd: random.Random, thread: int, ops: str) -> None:
        b, host, keys = self.backend, self.host, self.keys
        i = rnd.randrange(N)
        j = rnd.randrange(i + 1, N + 1)
        op = rnd.choice(ops)
        extra = HiCacheStorageExtraInfo(prefix_keys=keys[:i]) if i else None
        got: list[bool] = []
        if op == "s":  # the backup thread, v1
            got = b.batch_set_v1(keys[i:j], sc.slots(host, i, j - i), extra)
        elif op == "S":  # v2
            src = sc.slots(host, i, j - i)
            t = PoolTransfer(name=PoolName.KV, keys=keys[i:j], host_indices=src)
            got = b.batch_set_v2([t], extra)[PoolName.KV]
        elif op in "gG":  # the prefetch thread into this thread's own slots
            dst = sc.slots(host, N + N * thread + i, j - i)
            if op == "g":
                flags = b.batch_get_v1(keys[i:j], dst, extra)
            else:
                t = PoolTransfer(name=PoolName.KV, keys=keys[i:j], host_indices=dst)
                flags = b.batch_get_v2([t], extra)[PoolName.KV]
            self._check(flags, sc.page_bytes(host, dst, j - i), i)
        elif op == "e":  # the scheduler thread
            hit = b.batch_exists(keys[i:j], extra)
            with self.lock:
                self.seen["bad_exists"] += not 0 <= hit <= j - i
        elif op == "c":
            b.clear()
        with self.lock:
            self.seen["set_true"] += sum(got)
            self.seen["calls"] += 1

    def _check(self, flags: list[bool], got: list[bytes], first: int) -> None:
        with self.lock:
            for k, ok in enumerate(flags):
                if ok:
                    self.seen["hits"] += 1
                    self.seen["wrong"] += got[k] != self.want[first + k]

    def run(self, thread: int, ops: str, count: int | None) -> None:
        rnd = random.Random(thread)
        try:
            done = 0
            while not self.stop.is_set() and (count is None or done < count):
                self.one(rnd, thread, ops)
                done += 1
        except BaseException:  # what would have ended one of SGLang's threads
            self.errors.append(traceback.format_exc())

    def threads(self, ops: str, count: int | None = None) -> list[threading.Thread]:
        ts = [
            threading.Thread(target=self.run, args=(t, ops, count), name=f"caller-{t}")
            for t in range(THREADS)
        ]
        for t in ts:
            t.start()
        return ts


def joined(threads: list[threading.Thread]) -> int:
    """Join `threads` (a hang guard); return how many are still running."""
    for t in threads:
        t.join(GUARD)
    return sum(t.is_alive() for t in threads)


def overlap(workdir: Path, kind: str, layout: str, tiers: str) -> dict[str, Any]:
    """Sets, gets, exists (v1 and v2) and clears on overlapping pages from every thread.

    A thread takes SGLang's metrics all the while, as the scheduler does.
    """
    host = sc.make_host(kind, layout)
    sc.fill_random(host, 1)
    backend = sc.make_backend(host, tiers_of(workdir, kind, tiers), kind=kind)
    calls = Calls(backend, host)
    metrics = {"prefetch": 0, "backup": 0, "entries": [0, 0]}

    def take() -> None:
        s = backend.get_stats()
        metrics["prefetch"] += sum(s.prefetch_pgs)
        metrics["backup"] += sum(s.backup_pgs)
        metrics["entries"][0] += len(s.prefetch_pgs) + len(s.backup_pgs)
        metrics["entries"][1] += len(s.prefetch_bandwidth) + len(s.backup_bandwidth)

    taker = threading.Thread(target=lambda: [take() for _ in iter(calls.stop.is_set, True)])
    taker.start()
    alive = joined(calls.threads("sSgGgGec", 150))
    calls.stop.set()
    alive += joined([taker])
    take()
    stats = backend.kvtiers_stats()
    backend.close()
    return {
        **calls.seen,
        "errors": calls.errors[:2],
        "alive": alive,
        "failures": dict(backend.failures),
        "metrics": metrics,
        "loaded_tokens": stats.loaded_tokens,
        "page": sc.PAGE,
    }


def _names() -> set[int]:
    return {t.ident or 0 for t in threading.enumerate()}


def _settle(before: set[int]) -> list[str]:
    """Return the threads started since `before` that are still alive, after a wait."""
    deadline = time.monotonic() + GUARD
    while time.monotonic() < deadline:
        left = [t for t in threading.enumerate() if (t.ident or 0) not in before]
        if not left:
            return []
        left[0].join(1.0)
    return sorted(t.name for t in threading.enumerate() if (t.ident or 0) not in before)


def close(workdir: Path) -> dict[str, Any]:
    """Close a backend (from two threads at once) while threads call it; drop one unclosed.

    A second backend on the same config shares the cache: it must keep working after the
    first one is closed twice.
    """
    host = sc.make_host("mha", "layer_first")
    sc.fill_random(host, 2)
    tiers = tiers_of(workdir, "mha", "dram-lmdb")
    before = _names()
    out: dict[str, Any] = {"errors": [], "alive": 0, "other_ok": [], "other_exact": []}
    for round_ in range(6):
        other = sc.make_backend(host, tiers, kind="mha")
        backend = sc.make_backend(host, tiers, kind="mha")
        calls = Calls(backend, host)
        backend.batch_set_v1(calls.keys, sc.slots(host, 0, N))
        callers = calls.threads("sSgGe")
        time.sleep(random.Random(round_).uniform(0.0, 0.2))  # somewhere in the calls
        closers = [threading.Thread(target=backend.close) for _ in range(2)]
        for t in closers:
            t.start()
        out["alive"] += joined(closers)
        time.sleep(0.05)  # the callers go on calling a closed backend
        calls.stop.set()
        out["alive"] += joined(callers)
        out["errors"] += calls.errors[:2]
        out["wrong"] = out.get("wrong", 0) + calls.seen["wrong"]
        dst = sc.slots(host, 200, N)
        out["other_ok"].append(all(other.batch_set_v1(calls.keys, sc.slots(host, 0, N))))
        out["other_ok"][-1] &= all(other.batch_get_v1(calls.keys, dst))
        out["other_exact"].append(sc.page_bytes(host, dst, N) == calls.want)
        other.close()
    out["entries_after_close"] = len(CACHES._entries)
    out["leaked_after_close"] = _settle(before)
    # SGLang closes a backend on detach "best effort"; one only dropped is collected
    dropped = sc.make_backend(host, tiers, kind="mha")
    dropped.register_mem_host_pool_v2(sc.make_mamba_host(), PoolName.MAMBA)
    dropped.batch_set_v1(sc.keys_for(2), sc.slots(host, 0, 2))
    del dropped
    gc.collect()
    out["leaked_after_gc"] = _settle(before)
    out["entries_after_gc"] = len(CACHES._entries)
    # and the LMDB paths open again in this process
    again = sc.make_backend(host, tiers, kind="mha")
    out["reopened_exists"] = again.batch_exists(sc.keys_for(2))
    again.close()
    return out


def _break_remote(workdir: Path) -> None:
    pool = workdir / "pool"
    os.rename(pool, workdir / "gone")  # the share vanishes, a file stands in its place
    pool.write_text("not a folder")
    time.sleep(1.0)
    pool.unlink()
    time.sleep(0.5)
    shutil.rmtree(pool, ignore_errors=True)  # the writers made it again: gone again
    time.sleep(0.5)


def _corrupt_lmdb(workdir: Path, backend: Any, keys: list[str]) -> int:
    """Overwrite bytes inside every stored payload in `data.mdb` under the readers."""
    cache, loop = backend.cache, backend._entry.loop
    payloads = []
    for key in keys:
        chunk = torch.empty(cache.layout.chunk_shape(), dtype=backend.mem_pool_host.dtype)
        loop.run(cache.get_chunks(cache.chunk_keys([key]), [chunk]))
        payloads.append(chunk.view(torch.uint8).numpy().tobytes()[:1024])
    data = workdir / "lmdb" / "data.mdb"
    raw, hits = data.read_bytes(), 0
    with data.open("r+b") as f:
        for payload in payloads:
            at = raw.find(payload)
            while at >= 0:
                f.seek(at + 100)
                f.write(b"\x5a" * 64)
                hits += 1
                at = raw.find(payload, at + 1)
    return hits


def faults(workdir: Path, kind: str, layout: str, tier: str) -> dict[str, Any]:
    """A tier fails under the threads: its `file://` pool goes, or LMDB values rot."""
    host = sc.make_host(kind, layout)
    sc.fill_random(host, 3)
    backend = sc.make_backend(
        host, tiers_of(workdir, kind, "remote" if tier == "remote" else "dram-lmdb"), kind=kind
    )
    calls = Calls(backend, host)
    backend.batch_set_v1(calls.keys, sc.slots(host, 0, N))
    backend._entry.loop.run(backend.cache.flush())
    callers = calls.threads("sggGe")
    time.sleep(0.5)
    corrupted, alive = [], 0
    if tier == "remote":
        _break_remote(workdir)
    else:
        for _ in range(3):
            # NOTE: the values rot between reads, with the callers paused: bytes written
            # into data.mdb by hand during a read could change between the read's checksum
            # and its copy, which LMDB's own writers never do (a reader's pages are kept).
            calls.stop.set()
            alive += joined(callers)
            calls.stop.clear()
            corrupted.append(_corrupt_lmdb(workdir, backend, calls.keys))
            callers = calls.threads("sggGe")
            time.sleep(0.3)
    calls.stop.set()
    alive += joined(callers)
    stats = backend.kvtiers_stats()
    backend.close()
    return {
        **calls.seen,
        "errors": calls.errors[:2],
        "alive": alive,
        "corrupted": corrupted,
        "corrupt_found": sum(t.corrupt for t in stats.tiers),
        "miss_reasons": stats.miss_reasons,
    }


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {"close": close, "faults": faults}


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    sys.setswitchinterval(1e-5)  # switch threads often: more interleavings per call
    name, workdir, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    if name == "overlap":  # triples of KIND LAYOUT TIERS, one process for all
        result = {}
        for kind, layout, tiers in zip(args[::3], args[1::3], args[2::3], strict=True):
            sub = workdir / f"{kind}-{layout}-{tiers}"
            sub.mkdir(parents=True, exist_ok=True)
            result[sub.name] = overlap(sub, kind, layout, tiers)
    elif name in SCENARIOS:
        result = SCENARIOS[name](workdir, *args)
    else:
        raise SystemExit(f"unknown scenario {name!r}")
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
