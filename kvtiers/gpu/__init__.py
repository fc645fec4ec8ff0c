"""The GPU side: pinned host buffers (and, later, CUDA-stream copy engines and the HBM tier)."""

from __future__ import annotations

from kvtiers.gpu.pinned import cuda_available, pinned_allocator

__all__ = ["cuda_available", "pinned_allocator"]
