"""Loads of 1 GiB from an LMDB-only cache vs parallel `pread`s of a flat file, warm and cold.

The cache has one tier, `lmdb`, so `TieredCache.load` reads every chunk through the LMDB
tier's `get` (nothing is promoted). The layout is bench_dram's (Llama-3-8B, 32 MiB chunks).
The baseline holds the same payloads back to back in one flat file on the same disk and
reads them with `read_threads` workers of a `ThreadPoolExecutor`, each reading its share of
the chunks with `os.preadv` straight into NumPy buffers, as the LMDB tier splits a batch.

Warm: the page cache holds both files. Cold: the page cache is dropped before every
repetition, by `/proc/sys/vm/drop_caches` where writable, else by
`posix_fadvise(POSIX_FADV_DONTNEED)` on the closed files; `mincore` checks that it worked.

Run alone: `python -m benchmarks.bench_lmdb [--quick]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from benchmarks._common import GIB, MIB, Result, Target, main
from benchmarks._timing import amedian_pair
from benchmarks.bench_dram import BYTES_PER_TOKEN, LAYOUT, VOCAB, make_kv, same_bits
from kvtiers import TieredCache

CHUNK_TOKENS = LAYOUT["chunk_size"]
CHUNK_BYTES = BYTES_PER_TOKEN * CHUNK_TOKENS


class FlatFile:
    """The baseline: chunk payloads back to back in one file, read by a thread pool.

    Args:
        path: the file.
        num_chunks: chunks it holds.
        threads: reads in flight.
        chunk_bytes: bytes of one chunk.
        direct: read with `O_DIRECT` (past the page cache).
    """

    def __init__(
        self,
        path: Path,
        num_chunks: int,
        threads: int,
        chunk_bytes: int = CHUNK_BYTES,
        direct: bool = False,
    ) -> None:
        self.path = path
        self.num_chunks = num_chunks
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.direct = direct
        self._map: mmap.mmap | None = None
        if direct:  # O_DIRECT needs page-aligned buffers: anonymous memory is
            self._map = mmap.mmap(-1, num_chunks * chunk_bytes)
            self.buf = np.frombuffer(self._map, dtype=np.uint8).reshape(num_chunks, chunk_bytes)
            self.buf.fill(1)  # touched: no faults
        else:
            self.buf = np.ones((num_chunks, chunk_bytes), dtype=np.uint8)
        self.pool = ThreadPoolExecutor(threads, "flat-pread")

    def read_all(self) -> None:
        """Read every chunk into `buf`, the chunks split in `threads` contiguous shares."""
        fd = os.open(self.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            step = -(-self.num_chunks // self.threads)
            parts = [
                (lo, min(lo + step, self.num_chunks)) for lo in range(0, self.num_chunks, step)
            ]
            for _ in self.pool.map(lambda p: self._read(fd, *p), parts):
                pass
        finally:
            os.close(fd)

    def _read(self, fd: int, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            view = memoryview(self.buf[i])
            done = 0
            while done < self.chunk_bytes:
                n = os.preadv(fd, [view[done:]], i * self.chunk_bytes + done)
                if n <= 0:
                    raise OSError(f"short read of chunk {i} in {self.path}")
                done += n

    def close(self) -> None:
        self.pool.shutdown()
        del self.buf
        if self._map is not None:
            self._map.close()


# -- page cache --------------------------------------------------------------------------


def drop_page_cache(paths: list[Path]) -> str:
    """Evict `paths` from the page cache; return the method that worked.

    The files must not be mapped by this process (close the cache first): the kernel
    keeps mapped pages whatever `posix_fadvise` says.
    """
    os.sync()  # only clean pages can be dropped
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"


def resident_fraction(paths: list[Path]) -> float:
    """Return the fraction of the pages of `paths` in the page cache (via `mincore`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if not size:
            continue
        pages = -(-size // mmap.PAGESIZE)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                resident += sum(b & 1 for b in bytes(vec))
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


# -- benchmark ---------------------------------------------------------------------------


def _config(path: Path, capacity: int, read_threads: int) -> dict[str, object]:
    tier = {"kind": "lmdb", "capacity": capacity, "path": str(path), "read_threads": read_threads}
    return {"layout": LAYOUT, "tiers": [tier]}


async def _populate(
    root: Path, capacity: int, tokens: np.ndarray, kv: torch.Tensor
) -> tuple[Path, Path]:
    """Store the KV through an lmdb-only cache and write the same payloads to a flat file."""
    lmdb_dir, flat = root / "lmdb", root / "flat.bin"
    async with TieredCache.from_config(_config(lmdb_dir, capacity, 4)) as cache:
        stored = await cache.store(tokens, kv)
        assert stored == len(tokens), stored
    with open(flat, "wb") as f:
        for i in range(len(tokens) // CHUNK_TOKENS):
            payload = kv.narrow(2, i * CHUNK_TOKENS, CHUNK_TOKENS).contiguous()
            f.write(payload.view(torch.uint8).numpy().tobytes())
    os.sync()
    return lmdb_dir, flat


async def _warm(
    cfg: dict[str, object],
    flat: FlatFile,
    tokens: np.ndarray,
    dst: torch.Tensor,
    kv: torch.Tensor,
    repeats: int,
) -> tuple[float, float]:
    async with TieredCache.from_config(cfg) as cache:

        async def load() -> None:
            out = await cache.load(tokens, out=dst)
            assert out.shape[2] == dst.shape[2], "an LMDB chunk was missing"

        await load()
        assert same_bits(dst, kv), "load returned other bytes than were stored"
        times = await amedian_pair(load, flat.read_all, repeats)
    last = kv.narrow(2, kv.shape[2] - CHUNK_TOKENS, CHUNK_TOKENS).contiguous()
    assert np.array_equal(flat.buf[-1], last.view(torch.uint8).numpy().reshape(-1))
    return times


async def _cold(
    cfg: dict[str, object],
    flat: FlatFile,
    tokens: np.ndarray,
    dst: torch.Tensor,
    files: list[Path],
    repeats: int,
) -> tuple[float, float, str, float]:
    kv_t, flat_t, left = [], [], []
    method = ""
    for _ in range(repeats):
        method = drop_page_cache(files)
        left.append(resident_fraction(files))
        async with TieredCache.from_config(cfg) as cache:
            start = time.perf_counter()
            out = await cache.load(tokens, out=dst)
            kv_t.append(time.perf_counter() - start)
            assert out.shape[2] == dst.shape[2], "an LMDB chunk was missing"
        drop_page_cache(files)
        left.append(resident_fraction(files))
        flat_t.append(_timed(flat.read_all))
    return statistics.median(kv_t), statistics.median(flat_t), method, max(left)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


async def _bench(total: int, warm_repeats: int, cold_repeats: int) -> list[Result]:
    num_tokens = total // BYTES_PER_TOKEN
    num_chunks = num_tokens // CHUNK_TOKENS
    tokens = np.random.default_rng(0).integers(0, VOCAB, num_tokens, dtype=np.int64)
    kv = make_kv(num_tokens)
    dst = torch.ones_like(kv)
    root = Path(tempfile.mkdtemp(prefix="kvtiers-bench-", dir="/tmp"))
    size = f"{total / GIB:g} GiB" if total >= GIB else f"{total // MIB} MiB"
    results: list[Result] = []
    try:
        lmdb_dir, flat_path = await _populate(root, 2 * total, tokens, kv)
        files = [flat_path, *sorted(p for p in lmdb_dir.iterdir() if p.is_file())]
        for threads in (4, 1):
            cfg = _config(lmdb_dir, 2 * total, threads)
            flat = FlatFile(flat_path, num_chunks, threads)
            try:
                t_kv, t_flat = await _warm(cfg, flat, tokens, dst, kv, warm_repeats)
                results.append(
                    Result.of_rates(
                        f"LMDB warm load {size}, read_threads={threads} vs flat pread",
                        total / t_kv / GIB,
                        total / t_flat / GIB,
                        unit="GiB/s",
                        target=Target("ratio", ">=", 0.7) if threads == 4 else None,
                        notes=f"{num_chunks} chunks of 32 MiB, page cache hot; "
                        f"{t_kv * 1e3:.0f} ms vs {t_flat * 1e3:.0f} ms"
                        if threads == 4
                        else f"{t_kv * 1e3:.0f} ms vs {t_flat * 1e3:.0f} ms",
                    )
                )
            finally:
                flat.close()
        for threads in (1, 4):
            cfg = _config(lmdb_dir, 2 * total, threads)
            flat = FlatFile(flat_path, num_chunks, threads)
            try:
                t_kv, t_flat, method, left = await _cold(
                    cfg, flat, tokens, dst, files, cold_repeats
                )
            finally:
                flat.close()
            results.append(
                Result.of_rates(
                    f"LMDB cold load {size}, read_threads={threads} vs flat pread",
                    total / t_kv / GIB,
                    total / t_flat / GIB,
                    unit="GiB/s",
                    notes=f"page cache dropped by {method} before each of {cold_repeats} "
                    f"runs ({left:.1%} of the pages left resident); "
                    f"{t_kv * 1e3:.0f} ms vs {t_flat * 1e3:.0f} ms",
                )
            )
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(root)
    return results


def run(quick: bool) -> list[Result]:
    """Time warm and cold loads of 1 GiB (128 MiB with `quick`) against a flat file."""
    if quick:
        return asyncio.run(_bench(128 * MIB, 3, 1))
    return asyncio.run(_bench(GIB, 7, 3))


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
