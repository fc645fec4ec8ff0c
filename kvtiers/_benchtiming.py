"""Time a batch of chunks through a bench session's cache (`kvtiers bench`).

One batch write (`put_chunks`), single-chunk reads (their median, after one warm-up read,
gives the latency) and reads of the whole batch in one call (`get_chunks`), each timed
after the device's copies are done. With `--cold` the session drops the tier's files from
the page cache before each timed read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtiers._benchcache import BenchCache
from kvtiers._endpoints import Chunk
from kvtiers._tensors import torch_dtype
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout

__all__ = ["Timings", "measure"]

_LATENCY_READS = 9  # single-chunk reads after one warm-up; the median is kept
_READ_ROUNDS = 3  # batch reads; the median is kept


@dataclass(frozen=True, slots=True)
class Timings:
    """What one batch took, in seconds."""

    write_seconds: float
    """The batch write."""
    chunk_read_seconds: float
    """One single-chunk read (the median)."""
    read_seconds: float
    """One read of the whole batch (the median)."""


async def measure(session: BenchCache, keys: list[ChunkKey], device: str) -> Timings | str:
    """Time the batch write, single-chunk reads and batch reads; or say what went wrong.

    Before each timed read the session drops the tier's files from the page cache (with
    `--cold`): once for single reads of chunks not yet read since, again for each batch.
    """
    chunks = _chunks(session.cache.layout, len(keys), device)
    sync = _synchronizer(device)
    start = time.perf_counter()
    held = await session.cache.put_chunks(keys, chunks)
    sync()
    write_seconds = time.perf_counter() - start
    if not all(held):
        return f"the tier took {sum(held)} of {len(keys)} chunks"
    singles: list[float] = []
    read: set[int] = set()
    for j in range(_LATENCY_READS + 1):
        i = j % len(keys)
        if not read or i in read:
            if failed := await session.drop():
                return failed
            read.clear()
        read.add(i)
        start = time.perf_counter()
        found = await session.cache.get_chunks([keys[i]], [chunks[i]])
        sync()
        singles.append(time.perf_counter() - start)
        if not found[0]:
            return f"chunk {i} did not read back"
    rounds = []
    for _ in range(_READ_ROUNDS):
        if failed := await session.drop():
            return failed
        start = time.perf_counter()
        found = await session.cache.get_chunks(keys, chunks)
        sync()
        rounds.append(time.perf_counter() - start)
        if not all(found):
            return f"a batch read found {sum(found)} of {len(keys)} chunks"
    # NOTE: the first single read warms up (thread pools, connections); it is not kept.
    return Timings(write_seconds, statistics.median(singles[1:]), statistics.median(rounds))


def _chunks(layout: KVLayout, count: int, device: str) -> list[Chunk]:
    """Return `count` chunks of random bytes on `device`, every page touched.

    They are the batch's sources, then its destinations; touched, so no first-touch page
    fault is timed.
    """
    if device == "host":
        rng = np.random.default_rng()
        host = np.empty((count, layout.chunk_bytes), dtype=np.uint8)
        host[:] = rng.integers(0, 256, layout.chunk_bytes, dtype=np.uint8)
        return list(host)
    raw = torch.randint(0, 256, (count, layout.chunk_bytes), dtype=torch.uint8, device=device)
    typed = raw.view(torch_dtype(layout)).view(count, *layout.chunk_shape())
    return list(typed)


def _synchronizer(device: str) -> Callable[[], None]:
    """Return what waits for the device's copies (a CUDA copy returns before it is done)."""
    if not device.startswith("cuda"):
        return lambda: None
    return lambda: torch.cuda.synchronize(device)
