"""Host-memory copies of a load or a store, spread over a few threads.

NumPy lets go of the interpreter lock while it copies, so copies of separate pieces run in
parallel: on the two-core development VM one thread copied 32 chunks of 32 MiB at about
6 GiB/s and two threads at about 12, as fast as one multi-threaded torch `copy_` of the
same bytes (docs/benchmarks.md).

A batch is cut into pieces of about `_PIECE_BYTES`; the calling thread and the pool's
threads take pieces until none is left, and the call returns once every piece taken is
copied. So no copy outlives the call (the caller hands pinned blocks back right after),
and a pool thread that wakes up late (an idle vCPU takes a millisecond to wake on a VM)
costs nothing: the calling thread has copied its pieces meanwhile, and nobody waits for a
thread that took none.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

import numpy as np

__all__ = ["MIN_PARALLEL_BYTES", "HostCopier", "default_copy_threads"]

_PIECE_BYTES = 2 * 2**20  # a piece of a batch: small, so the last one taken ends soon
MIN_PARALLEL_BYTES = 8 * 2**20
"""Batches smaller than this are copied by the calling thread alone."""
_MAX_AUTO_THREADS = 4  # a few threads reach the memory's bandwidth

Pair = tuple[np.ndarray, np.ndarray]
"""A destination and a source of the same shape."""


def default_copy_threads() -> int:
    """Return the copy threads of `copy_threads = 0`: the usable cores, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_AUTO_THREADS))


class HostCopier:
    """Copy batches of host arrays, on up to `threads` threads when a batch is large.

    An async context manager: leaving it shuts the pool down. Threads are started on the
    first large batch only.

    Args:
        threads: threads that copy one batch, the calling thread included (1: it alone).
        min_bytes: batches smaller than this are copied by the calling thread alone.
        piece_bytes: the size of the pieces a batch is cut into, about.
    """

    def __init__(
        self,
        threads: int,
        *,
        min_bytes: int = MIN_PARALLEL_BYTES,
        piece_bytes: int = _PIECE_BYTES,
    ) -> None:
        self.threads = threads
        self._min_bytes = min_bytes
        self._piece_bytes = piece_bytes
        self._pool = ThreadPoolExecutor(threads - 1, "kvtiers-copy") if threads > 1 else None

    async def __aenter__(self) -> HostCopier:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Shut the pool down (idempotent); later batches are copied by the caller alone."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)  # NOTE: idle by now: every batch waited for its pieces

    def copy(self, pairs: Sequence[Pair]) -> None:
        """Copy each source into its destination; return once every byte is copied.

        Raises:
            ValueError: a destination and its source differ in shape (nothing is copied).
        """
        for dst, src in pairs:
            if dst.shape != src.shape:
                raise ValueError(f"cannot copy an array of shape {src.shape} into {dst.shape}")
        pool = self._pool
        total = sum(dst.nbytes for dst, _ in pairs)
        if pool is None or total < self._min_bytes:
            for dst, src in pairs:
                np.copyto(dst, src)
            return
        batch = _Batch(_pieces(pairs, self._piece_bytes))
        helpers = min(self.threads - 1, len(batch.pieces) - 1)
        for _ in range(helpers):
            pool.submit(batch.work)
        batch.work()
        batch.wait()


class _Batch:
    """The pieces of one batch, taken one at a time by whichever thread is free."""

    def __init__(self, pieces: list[Pair]) -> None:
        self.pieces = pieces
        self._next = 0  # the next piece to take
        self._busy = 0  # pieces taken and not yet copied
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def work(self) -> None:
        """Copy pieces until none is left (or one failed)."""
        cond = self._cond
        while True:
            with cond:
                if self._next >= len(self.pieces) or self._error is not None:
                    return
                dst, src = self.pieces[self._next]
                self._next += 1
                self._busy += 1
            try:
                np.copyto(dst, src)
            except BaseException as exc:
                with cond:
                    self._error = self._error or exc
            finally:
                with cond:
                    self._busy -= 1
                    if not self._busy:
                        cond.notify_all()

    def wait(self) -> None:
        """Return once every piece taken is copied; raise the first failure, if any.

        Called after this thread's `work` returned, so no piece is taken from then on.
        """
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)
        if self._error is not None:
            raise self._error


def _pieces(pairs: Sequence[Pair], piece_bytes: int) -> list[Pair]:
    """Cut each pair (of one shape) along its first axis into parts of about `piece_bytes`."""
    out: list[Pair] = []
    for dst, src in pairs:
        rows = dst.shape[0] if dst.ndim else 1
        parts = min(rows, math.ceil(dst.nbytes / piece_bytes))
        if parts <= 1:
            out.append((dst, src))
            continue
        step = math.ceil(rows / parts)
        out.extend((dst[lo : lo + step], src[lo : lo + step]) for lo in range(0, rows, step))
    return out
