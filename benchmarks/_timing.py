"""Timing helpers of the benchmarks: wall times, interleaved medians, percentiles.

Every benchmark times kvtiers and its baseline in the same process, interleaving their
repetitions so that noise on a shared machine hits both alike, and reports medians.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence

__all__ = [
    "amedian_pair",
    "amedians_interleaved",
    "atimings",
    "median_of",
    "median_pair",
    "percentile",
    "timings",
]


def timings(fn: Callable[[], object], repeats: int, *, warmup: int = 1) -> list[float]:
    """Return the wall time in seconds of each of `repeats` calls of `fn`, after `warmup`."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def median_of(fn: Callable[[], object], repeats: int, *, warmup: int = 1) -> float:
    """Return the median wall time in seconds of `repeats` calls of `fn`."""
    return statistics.median(timings(fn, repeats, warmup=warmup))


def median_pair(
    fn: Callable[[], object],
    baseline: Callable[[], object],
    repeats: int,
    *,
    min_sample_s: float = 0.01,
) -> tuple[float, float]:
    """Return the median seconds per call of `fn` and of `baseline`, their samples interleaved.

    Interleaving makes a burst of noise from other processes hit both sides alike. A sample
    is a run of back-to-back calls lasting at least `min_sample_s`, so that a fast `fn` is
    not timed right after a slow, allocation-heavy `baseline` has flushed the CPU caches.
    """
    number_a, number_b = _calibrate(fn, min_sample_s), _calibrate(baseline, min_sample_s)
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        for f, number, acc in ((fn, number_a, a), (baseline, number_b, b)):
            start = time.perf_counter()
            for _ in range(number):
                f()
            acc.append((time.perf_counter() - start) / number)
    return statistics.median(a), statistics.median(b)


def _calibrate(fn: Callable[[], object], min_sample_s: float) -> int:
    """Call `fn` once (a warm-up) and return how many calls last `min_sample_s`."""
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    return max(1, min(10_000, math.ceil(min_sample_s / max(once, 1e-9))))


async def atimings(
    fn: Callable[[], Awaitable[object]], repeats: int, *, warmup: int = 1
) -> list[float]:
    """Return the wall time in seconds of each of `repeats` awaits of `fn()`."""
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - start)
    return out


async def amedian_pair(
    fn: Callable[[], Awaitable[object]],
    baseline: Callable[[], object],
    repeats: int,
    *,
    warmup: int = 1,
) -> tuple[float, float]:
    """Like `median_pair` for an async `fn` and a plain `baseline`."""
    for _ in range(warmup):
        await fn()
        baseline()
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        a.append(time.perf_counter() - start)
        start = time.perf_counter()
        baseline()
        b.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


async def amedians_interleaved(
    fns: Sequence[Callable[[], Awaitable[object]]], repeats: int
) -> list[float]:
    """Return the median seconds of each of `fns`, their repetitions interleaved.

    Each of `fns` is awaited once first, as a warm-up (connections, pools).
    """
    for fn in fns:
        await fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, samples, strict=True):
            start = time.perf_counter()
            await fn()
            acc.append(time.perf_counter() - start)
    return [statistics.median(acc) for acc in samples]


def percentile(samples: Sequence[float], q: float) -> float:
    """Return the `q`-th percentile (0-100) of `samples`, linearly interpolated."""
    xs = sorted(samples)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
