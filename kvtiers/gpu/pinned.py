"""Pinned (page-locked) host memory for tier buffers, when CUDA is present."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["cuda_available", "pinned_allocator"]


def cuda_available() -> bool:
    """Return whether a CUDA device can be used."""
    return bool(torch.cuda.is_available())


def pinned_allocator() -> Callable[[int], npt.NDArray[np.uint8]] | None:
    """Return an allocator of pinned host buffers, or `None` without CUDA.

    Pinned memory lets host-to-device copies run asynchronously at full bandwidth. The
    returned NumPy array keeps its torch tensor (and so the pinned pages) alive.
    """
    if not cuda_available():
        return None

    def allocate(num_bytes: int) -> npt.NDArray[np.uint8]:
        tensor = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        return tensor.numpy()

    return allocate
