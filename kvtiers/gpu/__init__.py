"""The GPU side: pinned buffers, the paged-KV copy engine, the HBM tier.

Everything here runs on CPU tensors too (streams and events become no-ops), so the logic
is tested without a GPU.
"""

from __future__ import annotations

from kvtiers.gpu.copy_engine import CopyEngine, EngineState, LayerFeed
from kvtiers.gpu.handle import CopyHandle, CopyStats
from kvtiers.gpu.hbm import HBMTier
from kvtiers.gpu.paged import PagedKind, PagedKV, payload_tensor
from kvtiers.gpu.pinned import cuda_available, pinned_allocator

__all__ = [
    "CopyEngine",
    "CopyHandle",
    "CopyStats",
    "EngineState",
    "HBMTier",
    "LayerFeed",
    "PagedKV",
    "PagedKind",
    "cuda_available",
    "payload_tensor",
    "pinned_allocator",
]
