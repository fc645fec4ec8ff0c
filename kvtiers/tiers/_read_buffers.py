"""Reusable buffers for whole-object reads, so a read does not fault in fresh memory.

Reading an 8 MiB object into a new `bytes` costs as much again as the read itself on a
local disk: the kernel maps and zeroes 2,048 fresh pages. The remote tier reads objects
of a local or mounted filesystem into buffers taken from here and gives each back once
its payload is verified and copied out. A buffer that is not given back (a read that
timed out and may still be writing into it, a read nobody waited for) is simply left to
the garbage collector; the pool makes another when it runs dry.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import numpy.typing as npt

__all__ = ["ReadBuffers"]


class ReadBuffers:
    """A pool of uint8 buffers of one size, safe to take from any thread.

    Args:
        size: bytes of each buffer.
        keep: buffers kept for reuse at most.
    """

    def __init__(self, size: int, keep: int) -> None:
        self.size, self.keep = size, keep
        self._free: deque[npt.NDArray[np.uint8]] = deque()  # NOTE: append/pop are atomic

    def take(self) -> npt.NDArray[np.uint8]:
        """Return a free buffer, or a new one."""
        try:
            return self._free.pop()
        except IndexError:
            return np.empty(self.size, dtype=np.uint8)

    def give(self, buf: npt.NDArray[np.uint8]) -> None:
        """Take back a buffer nothing reads or writes any more."""
        if len(self._free) < self.keep:
            self._free.append(buf)
