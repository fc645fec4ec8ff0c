"""`kvtiers replay --full`: the replay through a real `TieredCache`, and its report.

The hit rates, per-tier hits, optimum and TTFT come out in the index-only report's shape,
from the hits the cache served; the full mode adds what only a real cache shows: the
time of each request's lookup and load, store and flush, the bytes each tier read, and
blocks that came back with the wrong bytes (a bug: the exit status is then 1).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtiers._cli_replay import _progress, write_plot
from kvtiers._replay_full import DEFAULT_BLOCK_BYTES, FullRun, replay_full, replay_layout
from kvtiers.core.config import CacheConfig, format_size, parse_size
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from kvtiers.replay import (
    CostSetup,
    ReplayReport,
    ReuseHints,
    TierSpec,
    Trace,
    build_report,
    format_report,
    hints_for,
    summarize_ttft,
)
from kvtiers.replay.report import format_seconds, format_table
from kvtiers.replay.ttft import percentile

__all__ = ["format_full", "full_dict", "run_full"]

_SMALLER = "give a smaller --block-bytes, --capacity or --limit"
# The tier counters a full run reports per tier (`TierStats` fields).
_MEASURED = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "puts",
    "evictions",
    "promotions",
    "demotions",
    "corrupt",
    "foreign",
    "errors",
    "cold_puts",
    "cold_hits",
)


def run_full(
    args: argparse.Namespace,
    trace: Trace,
    config: CacheConfig | None,
    cascades: Sequence[Sequence[TierSpec]],
    costs: CostSetup | None,
    block_bytes: int | None,
    *,
    plot: Path | None = None,
) -> int:
    """Replay each cascade through a real cache, print the report; return the exit status.

    `plot` is the figure's file, checked already (`plot_path`).
    """
    if not args.full:
        raise ConfigError("--block-bytes: only with --full")
    layout = _stored_layout(args.block_bytes, trace, config)
    _check_memory(layout, trace, cascades)
    capacities = {sum(t.capacity_blocks for t in tiers) for tiers in cascades}
    hints = hints_for(trace, args.hints) if args.hints is not None else None
    runs_each = 2 if hints is None else 4  # full and index-only, each also hinted
    total = trace.num_requests * (runs_each * len(cascades) + len(capacities))
    with _progress(total, enabled=not args.no_progress and sys.stderr.isatty()) as tick:
        runs = _replay_all(trace, cascades, layout, config, tick, hints)
        index = build_report(
            trace, cascades, block_bytes=block_bytes, costs=costs, progress=tick, hints=hints
        )
    report = dataclasses.replace(
        index,
        runs=tuple(f.run for f in runs),
        ttft=tuple(summarize_ttft(trace, f.run, costs) for f in runs) if costs else (),
    )
    if args.json:
        print(json.dumps(full_dict(report, index, runs, layout), indent=2))
    else:
        print(format_full(report, index, runs, layout))
    if plot is not None:
        write_plot(report, plot)
    return _verify_status(runs)


def _verify_status(runs: Sequence[FullRun]) -> int:
    """Return the exit status: 1, said on stderr, when any block read back wrong bytes."""
    failures = sum(f.verify_failures for f in runs)
    if failures:
        print(
            f"kvtiers replay: {failures:,} blocks loaded with other bytes than were stored "
            "under their key (a bug in the cache or a tier; please report it)",
            file=sys.stderr,
        )
        return 1
    return 0


def _stored_layout(text: str | None, trace: Trace, config: CacheConfig | None) -> KVLayout:
    if text is None or text.strip() != "layout":
        size = DEFAULT_BLOCK_BYTES if text is None else parse_size(text, where="--block-bytes")
        return replay_layout(trace.block_tokens, size)
    if config is None or config.layout is None:
        raise ConfigError("--block-bytes layout: needs a --config with a [layout]")
    if config.layout.chunk_size != trace.block_tokens:
        raise ConfigError(
            f"--block-bytes layout: the layout's chunk_size is {config.layout.chunk_size} "
            f"tokens, the trace's blocks {trace.block_tokens} (see --block-tokens)"
        )
    return config.layout


def _check_memory(layout: KVLayout, trace: Trace, cascades: Sequence[Sequence[TierSpec]]) -> None:
    """Refuse a full replay whose buffers would not fit in this machine's memory.

    A run holds the payloads and read buffers of its longest request (three copies of
    it) and the blocks its memory tiers fill (at most the trace's unique blocks each).

    Raises:
        ConfigError: the estimate exceeds the RAM (or the cgroup's memory limit).
    """
    from kvtiers._cli_explain import read_machine

    longest = max((len(ids) for ids in trace.requests), default=0)
    held = max(
        sum(min(t.capacity_blocks, trace.unique_blocks) for t in tiers if t.kind == "dram")
        for tiers in cascades
    )
    need = (3 * longest + 1 + held) * layout.chunk_bytes
    memory = read_machine().memory_bytes
    if need > memory:
        raise ConfigError(
            f"--full: blocks of {format_size(layout.chunk_bytes)} need about "
            f"{format_size(need)} of host memory, this machine has {format_size(memory)}; "
            f"{_SMALLER}"
        )


def _replay_all(
    trace: Trace,
    cascades: Sequence[Sequence[TierSpec]],
    layout: KVLayout,
    config: CacheConfig | None,
    tick: Callable[[int], None] | None,
    hints: ReuseHints | None = None,
) -> list[FullRun]:
    """Replay each cascade in a fresh cache (and temporary directory), one after another.

    With `hints`, each cascade is replayed again with them, right after its plain run.

    Raises:
        ConfigError: a buffer cannot be allocated (past what `_check_memory` foresaw).
    """
    every = [None] if hints is None else [None, hints]

    async def run_all() -> list[FullRun]:
        return [
            await replay_full(trace, t, layout, base=config, progress=tick, hints=h)
            for t in cascades
            for h in every
        ]

    try:
        return asyncio.run(run_all())
    except MemoryError as exc:  # e.g. a machine that does not overcommit memory
        raise ConfigError(
            f"--full: cannot allocate buffers for blocks of {format_size(layout.chunk_bytes)} "
            f"({exc}); {_SMALLER}"
        ) from exc


def full_dict(
    report: ReplayReport, index: ReplayReport, runs: Sequence[FullRun], layout: KVLayout
) -> dict[str, Any]:
    """Return the full replay's report as one JSON-ready object."""
    out = report.to_dict()
    out["mode"] = "full"
    out["stored_layout"] = dataclasses.asdict(layout)
    out["stored_block_bytes"] = layout.chunk_bytes
    for run_dict, full, simulated in zip(out["runs"], runs, index.runs, strict=True):
        run_dict["index_only_hits"] = simulated.hits
        run_dict["index_only_hit_rate"] = simulated.hit_rate
        run_dict["seconds"] = full.seconds
        run_dict["lookup_load_s"] = _quantiles(full.lookup_load_s)
        run_dict["store_s"] = _quantiles(full.store_s)
        run_dict["flush_s"] = _quantiles(full.flush_s)
        run_dict["short_loads"] = full.short_loads
        run_dict["miss_reasons"] = full.miss_reasons
        run_dict["verify_failures"] = full.verify_failures
        for tier_dict, stats in zip(run_dict["tiers"], full.tiers, strict=True):
            tier_dict["measured"] = {name: getattr(stats, name) for name in _MEASURED}
    return out


def format_full(
    report: ReplayReport, index: ReplayReport, runs: Sequence[FullRun], layout: KVLayout
) -> str:
    """Return the text `kvtiers replay --full` prints: the report, then the measurements."""
    planes = "K and V" if layout.kind == "mha" else "a latent"
    shape = (
        f"{_count(layout.num_layers, 'layer')}, {planes} of {_count(layout.num_kv_heads, 'head')}"
        f" x {layout.head_size} {layout.dtype}, {layout.chunk_size} tokens"
    )
    title = f"full mode  TieredCache, {format_size(layout.chunk_bytes)} blocks ({shape})"
    tiers = runs[0].run.tiers
    moved = [t.spec.name for t in tiers if t.spec.kind in ("lmdb", "remote")]
    if moved:
        title += f"; {', '.join(moved)} in a temporary directory"
    lines = [format_report(report), "", title]
    names = [t.spec.name for t in tiers]
    header = ["policy", "capacity", "hit rate", "index-only", "lookup+load p50", "p90"]
    header += ["store p50", "p90", "flush p50", "p90"]
    header += [f"read {name}" for name in names] + ["short loads", "verify", "wall"]
    rows = [header]
    for full, simulated in zip(runs, index.runs, strict=True):
        rows.append(
            [
                full.run.policy,
                f"{full.run.capacity_blocks:,}",
                f"{full.run.hit_rate:.2%}",
                f"{simulated.hit_rate:.2%}",
                *_pair(full.lookup_load_s),
                *_pair(full.store_s),
                *_pair(full.flush_s),
                *(format_size(s.bytes_read) for s in full.tiers),
                f"{full.short_loads:,}",
                "ok" if not full.verify_failures else f"{full.verify_failures:,} FAILED",
                format_seconds(full.seconds),
            ]
        )
    lines += format_table(rows)
    lines += [
        "",
        "index-only: the same replay without bytes (see docs/replay.md for why they may differ);",
        "times per request, wall per run; short loads: loads that delivered fewer blocks than",
        "their lookup found; verify: blocks read back with the bytes stored under their key.",
    ]
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _quantiles(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {"median": 0.0, "p90": 0.0, "mean": 0.0}
    return {
        "median": statistics.median(samples),
        "p90": percentile(samples, 90),
        "mean": statistics.fmean(samples),
    }


def _pair(samples: Sequence[float]) -> list[str]:
    q = _quantiles(samples)
    return [format_seconds(q["median"]), format_seconds(q["p90"])]
