"""Host staging buffers kept between an engine's steps.

A load is read into a staging tensor before it is written into the engine's blocks. A new
host tensor of tens of MiB is fresh memory from the operating system, and its first write
faults every page in: on a 2-core VM, 48 MiB took 14.5 ms to allocate and fill against
3.2 ms for the copy alone into a buffer used before. `StagingPool` keeps the buffers of
finished loads for the next ones.

The pool serves pageable CPU memory only: pinned buffers for a GPU come from torch's caching
host allocator, which already reuses them and, unlike this pool, knows when the device's
copies out of them have finished. `StagingTensors` picks one or the other for a worker.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading

import torch

from kvtiers._tensors import torch_dtype
from kvtiers.core.layout import KVLayout

__all__ = ["StagingPool", "StagingTensors"]


def _rounded(num_bytes: int) -> int:
    """Round up to a size class: four per power of two (under a quarter more than asked)."""
    if num_bytes <= 1 << 16:
        return 1 << 16
    step = 1 << (num_bytes.bit_length() - 3)  # a quarter of the power of two below
    return -(-num_bytes // step) * step


class StagingPool:
    """Reuse host staging buffers, up to `max_bytes` of them idle.

    `take` hands out a tensor viewing an idle buffer that fits (the smallest), or a new
    one; `give` returns it once nothing reads or writes it any more. A tensor never given
    back is simply freed by Python. Thread-safe: loads end on the cache's loop thread.

    Args:
        max_bytes: the most idle bytes kept; a returned buffer beyond it is freed.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._idle: list[torch.Tensor] = []  # flat uint8 buffers, smallest first
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        """The bytes of the idle buffers kept."""
        return self._idle_bytes

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Return an uninitialised CPU tensor of `shape` and `dtype`."""
        need = math.prod(shape) * dtype.itemsize
        with self._lock:
            found = next((i for i, b in enumerate(self._idle) if b.numel() >= need), None)
            if found is not None:
                buffer = self._idle.pop(found)
                self._idle_bytes -= buffer.numel()
        if found is None:
            # NOTE: a buffer too big to keep is not rounded up: it would only waste memory.
            size = _rounded(need)
            buffer = torch.empty(size if size <= self._max_bytes else need, dtype=torch.uint8)
        return buffer[:need].view(dtype).view(shape)

    def give(self, tensor: torch.Tensor) -> None:
        """Keep the buffer under `tensor` (from `take`) for a later `take`.

        The caller guarantees that nothing reads or writes `tensor` any more.
        """
        storage = tensor.untyped_storage()
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        size = buffer.numel()
        with self._lock:
            if self._idle_bytes + size > self._max_bytes:
                return
            self._idle.append(buffer)
            self._idle.sort(key=torch.Tensor.numel)
            self._idle_bytes += size


class StagingTensors:
    """The staging tensors of a worker's loads and saves, shaped by a KV layout.

    On the CPU they come from a `StagingPool`; for a GPU they are pinned, from torch's
    caching host allocator, so copies to the device do not block the host.

    Args:
        layout: the layout of the KV they hold.
        pinned: pin them (the engine's KV is on a GPU).
        keep_bytes: the most idle bytes the CPU pool keeps.
    """

    def __init__(self, layout: KVLayout, *, pinned: bool, keep_bytes: int) -> None:
        self._layout = layout
        self._pool = None if pinned else StagingPool(keep_bytes)

    @property
    def idle_bytes(self) -> int:
        """The bytes kept for later tensors (0 when pinned)."""
        return 0 if self._pool is None else self._pool.idle_bytes

    def take(self, num_tokens: int) -> torch.Tensor:
        """Return an uninitialised tensor for the KV of `num_tokens` tokens."""
        shape, dtype = self._layout.kv_shape(num_tokens), torch_dtype(self._layout)
        if self._pool is None:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        return self._pool.take(shape, dtype)

    def release(
        self, tensor: torch.Tensor, done: concurrent.futures.Future[int] | None = None
    ) -> None:
        """Keep `tensor` (from `take`) for later ones, once nothing can use it.

        Args:
            tensor: the staging tensor.
            done: the load or save that used it, if it may have failed: a load given up
                or failed may still have a read in flight into its tensor, a failed save
                a write out of it, so their tensors are left to Python.
        """
        if self._pool is None:
            return
        if done is None or (done.done() and not done.cancelled() and done.exception() is None):
            self._pool.give(tensor)
