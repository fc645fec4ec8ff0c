"""Replay request traces through the prefix index and eviction policies, counting blocks.

`read_trace` reads a Mooncake or token trace; `replay` runs it through a tier cascade of the
library's own index and policies without storing bytes (index-only mode); `optimum` runs
Belady's offline rule as the ceiling; `build_report` does all of it for several policies and
capacities, with TTFT from the cost model, and `format_report` / `ReplayReport.to_dict`
print it. `hints_for` and its kin derive reuse hints from a trace's future, to replay what
an application's hints to `TieredCache.store` would buy. The package imports `core`,
`eviction` and `costmodel`, never the tiers or torch.
"""

from __future__ import annotations

from kvtiers.replay.cascade import from_config, parse_capacity, parse_policies, single_tier
from kvtiers.replay.hints import (
    HINTS,
    ReuseHints,
    flip_hints,
    future_hints,
    hints_for,
    turn_hints,
)
from kvtiers.replay.optimum import OptimumResult, ideal_hits, optimum
from kvtiers.replay.report import REUSE_RULE, ReplayReport, build_report, format_report
from kvtiers.replay.simulate import RunResult, TierResult, TierSpec, replay
from kvtiers.replay.trace import (
    MOONCAKE_BLOCK_TOKENS,
    Trace,
    TraceError,
    read_prompts,
    read_trace,
)
from kvtiers.replay.ttft import CostSetup, TTFTSummary, summarize_ttft

__all__ = [
    "HINTS",
    "MOONCAKE_BLOCK_TOKENS",
    "REUSE_RULE",
    "CostSetup",
    "OptimumResult",
    "ReplayReport",
    "ReuseHints",
    "RunResult",
    "TTFTSummary",
    "TierResult",
    "TierSpec",
    "Trace",
    "TraceError",
    "build_report",
    "flip_hints",
    "format_report",
    "from_config",
    "future_hints",
    "hints_for",
    "ideal_hits",
    "optimum",
    "parse_capacity",
    "parse_policies",
    "read_prompts",
    "read_trace",
    "replay",
    "single_tier",
    "summarize_ttft",
    "turn_hints",
]
