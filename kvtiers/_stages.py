"""Reusable host buffers that chunks pass through between tiers and callers."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt

from kvtiers.tiers.base import Buffer

__all__ = ["StagePool"]

_MAX_STAGE_ROWS = 32  # chunks in one stage buffer at most


class StagePool:
    """Reusable host buffers for chunks on their way between a tier and a caller.

    Fresh buffers cost a page fault per 4 KiB on first touch (about as much as the copy
    itself); reusing a few keeps that cost to the first use. Buffers are taken and given
    back on the event loop only, so the pool needs no lock.

    Args:
        chunk_bytes: bytes of one chunk (one row).
        max_bytes: the size of one buffer; it holds at least one chunk.
        keep: buffers kept for reuse; more are allocated when needed, then dropped.
        allocate: allocates the kept buffers (pinned memory, for copies to a GPU); plain
            NumPy memory by default, and always for a one-off buffer past `rows`.
    """

    def __init__(
        self,
        chunk_bytes: int,
        max_bytes: int = 64 * 2**20,
        keep: int = 2,
        allocate: Callable[[int], Buffer] | None = None,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.rows = max(1, min(_MAX_STAGE_ROWS, max_bytes // chunk_bytes))
        """Chunks one buffer holds."""
        self._keep = keep
        self._allocate = allocate
        self._free: list[npt.NDArray[np.uint8]] = []

    @contextlib.contextmanager
    def take(self, count: int) -> Iterator[npt.NDArray[np.uint8]]:
        """Yield a `(count, chunk_bytes)` buffer.

        Up to `rows` chunks it is one of the kept buffers; a larger one is fresh, and
        dropped after use.
        """
        if count > self.rows:
            yield np.empty((count, self.chunk_bytes), dtype=np.uint8)
            return
        buf = self._free.pop() if self._free else None
        if buf is None:
            shape = (self.rows, self.chunk_bytes)
            alloc = self._allocate
            buf = (
                np.empty(shape, np.uint8)
                if alloc is None
                else alloc(math.prod(shape)).reshape(shape)
            )
        try:
            yield buf[:count]
        finally:
            if len(self._free) < self._keep:
                self._free.append(buf)
