"""The cost model shared by `kvtiers replay` and `kvtiers plan`.

Prefill time comes from the model's shapes (weights and causal attention FLOPs) and the
accelerator's throughput (a preset's peak times a utilisation, an override, or measured
prefills); load time from a tier's bandwidth and latency. From the two: TTFT with and
without a cache, and the break-even points (the bandwidth and the prompt length at which
loading cached KV beats recomputing it).
"""

from __future__ import annotations

from kvtiers.costmodel._links import (
    DEFAULT_LINKS,
    TierLink,
    default_link,
    parse_bandwidth,
    parse_duration,
    parse_tier_link,
)
from kvtiers.costmodel._model import GPUS, MODELS, GPUSpec, ModelSpec, load_model
from kvtiers.costmodel._plan import (
    DEFAULT_MFU,
    Compute,
    Plan,
    TierPlan,
    break_even_bandwidth,
    break_even_tokens,
    format_plan,
    make_compute,
    plan,
    ttft_seconds,
)

__all__ = [
    "DEFAULT_LINKS",
    "DEFAULT_MFU",
    "GPUS",
    "MODELS",
    "Compute",
    "GPUSpec",
    "ModelSpec",
    "Plan",
    "TierLink",
    "TierPlan",
    "break_even_bandwidth",
    "break_even_tokens",
    "default_link",
    "format_plan",
    "load_model",
    "make_compute",
    "parse_bandwidth",
    "parse_duration",
    "parse_tier_link",
    "plan",
    "ttft_seconds",
]
