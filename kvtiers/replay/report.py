"""Run a whole replay (policies x capacities, the optimum) and report it as text or JSON."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtiers.core.config import format_size
from kvtiers.replay.hints import ReuseHints
from kvtiers.replay.optimum import OptimumResult, ideal_hits, optimum
from kvtiers.replay.simulate import RunResult, TierSpec, replay
from kvtiers.replay.trace import Trace
from kvtiers.replay.ttft import CostSetup, TTFTSummary, percentile, summarize_ttft
from kvtiers.replay.ttft import ttft_without_cache as _ttft_without

__all__ = [
    "REUSE_RULE",
    "ReplayReport",
    "build_report",
    "format_report",
    "format_seconds",
    "format_table",
]

#: Below this ideal reuse rate, pooling KV pays little (a rule of thumb).
REUSE_RULE = 0.30


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """Everything `kvtiers replay` reports about one trace."""

    trace: Trace
    ideal_hits: int
    """Hits of an infinite cache with prefix semantics."""
    runs: tuple[RunResult, ...]
    """One per (capacity, policy), capacity-major."""
    optimum: tuple[OptimumResult, ...]
    """Belady's hits, one per distinct total capacity of the runs."""
    block_bytes: int | None = None
    """Bytes of KV per block, when a layout is known."""
    costs: CostSetup | None = None
    """The cost model, when a model was given."""
    ttft: tuple[TTFTSummary, ...] = ()
    """Per run (aligned with `runs`) when `costs` is set."""
    ttft_without: tuple[float, ...] = ()
    """Per request, TTFT without a cache, when `costs` is set."""
    hints: str | None = None
    """The source of the reuse hints of the `<policy>+<source>` runs, if any."""

    @property
    def ideal_hit_rate(self) -> float:
        """Return the infinite cache's share of requested blocks served from cache."""
        total = self.trace.total_blocks
        return self.ideal_hits / total if total else 0.0

    def optimum_at(self, capacity_blocks: int) -> OptimumResult | None:
        """Return Belady's result at a total capacity, if computed."""
        return next((o for o in self.optimum if o.capacity_blocks == capacity_blocks), None)

    def gap_closed(self, run: RunResult) -> float | None:
        """Return the share of the LRU-to-optimum gap that `run` closes at its capacity."""
        lru = next(
            (
                r
                for r in self.runs
                if r.policy == "lru" and r.capacity_blocks == run.capacity_blocks
            ),
            None,
        )
        best = self.optimum_at(run.capacity_blocks)
        if lru is None or best is None or best.hits <= lru.hits:
            return None
        return (run.hits - lru.hits) / (best.hits - lru.hits)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as one JSON-ready object."""
        trace = self.trace
        out: dict[str, Any] = {
            "trace": trace.path,
            "format": trace.format,
            "block_tokens": trace.block_tokens,
            "block_bytes": self.block_bytes,
            "requests": trace.num_requests,
            "total_blocks": trace.total_blocks,
            "unique_blocks": trace.unique_blocks,
            "ideal_hit_rate": self.ideal_hit_rate,
            "hints": self.hints,
            "runs": [self._run_dict(i, run) for i, run in enumerate(self.runs)],
            "optimum": [
                {"capacity_blocks": o.capacity_blocks, "hit_rate": o.hit_rate, "hits": o.hits}
                for o in self.optimum
            ],
        }
        if self.costs is not None:
            out["cost"] = self._cost_dict(self.costs)
        return out

    def _run_dict(self, i: int, run: RunResult) -> dict[str, Any]:
        total = run.total_blocks or 1
        tiers = [
            {
                "name": t.spec.name,
                "kind": t.spec.kind,
                "policy": t.spec.policy,
                "write_policy": t.spec.write_policy,
                "capacity_blocks": t.spec.capacity_blocks,
                "hits": t.hits,
                "hit_rate": t.hits / total,
                "blocks_read": t.hits,
                "bytes_read": None if self.block_bytes is None else t.hits * self.block_bytes,
                "inserts": t.inserts,
                "evictions": t.evictions,
            }
            for t in run.tiers
        ]
        out: dict[str, Any] = {
            "policy": run.policy,
            "capacity_blocks": run.capacity_blocks,
            "capacity_share": run.capacity_blocks / max(self.trace.unique_blocks, 1),
            "hit_rate": run.hit_rate,
            "hits": run.hits,
            "gap_closed": self.gap_closed(run),
            "tiers": tiers,
        }
        if self.ttft:
            out["ttft"] = _ttft_dict(self.ttft[i], self.ttft_without)
        return out

    def _cost_dict(self, costs: CostSetup) -> dict[str, Any]:
        median = _median_prompt(self.trace)
        return {
            "model": costs.model.name,
            "bytes_per_token": costs.model.bytes_per_token,
            "compute": costs.compute.label,
            "flops_per_s": costs.compute.flops_per_s,
            "median_prompt_tokens": median,
            "tiers": [
                {
                    "name": link.name,
                    "bandwidth": link.bandwidth,
                    "latency_s": link.latency,
                    "break_even_bandwidth": be if be != float("inf") else None,
                }
                for link, be in zip(costs.links, costs.break_even(median), strict=True)
            ],
        }


def build_report(
    trace: Trace,
    cascades: Sequence[Sequence[TierSpec]],
    *,
    block_bytes: int | None = None,
    costs: CostSetup | None = None,
    progress: Callable[[int], None] | None = None,
    hints: ReuseHints | None = None,
) -> ReplayReport:
    """Replay `trace` through each cascade and Belady at each distinct total capacity.

    Args:
        trace: the requests.
        cascades: the tier cascades to replay, in report order.
        block_bytes: bytes per block, to report bytes read.
        costs: the cost model, to report TTFT and prefill throughput.
        progress: called with request counts as the replays advance.
        hints: reuse hints; each cascade is then replayed again with them, right after
            its plain run, as policy `<policy>+<source>`.
    """
    runs: list[RunResult] = []
    for tiers in cascades:
        runs.append(replay(trace, tiers, progress=progress))
        if hints is not None:
            hinted = replay(trace, tiers, progress=progress, hints=hints.blocks)
            runs.append(replace(hinted, policy=f"{hinted.policy}+{hints.source}"))
    capacities = sorted({run.capacity_blocks for run in runs})
    best = tuple(optimum(trace, c, progress=progress) for c in capacities)
    ttft: tuple[TTFTSummary, ...] = ()
    without: tuple[float, ...] = ()
    if costs is not None:
        ttft = tuple(summarize_ttft(trace, run, costs) for run in runs)
        without = _ttft_without(trace, costs)
    source = None if hints is None else hints.source
    return ReplayReport(
        trace, ideal_hits(trace), tuple(runs), best, block_bytes, costs, ttft, without, source
    )


def format_report(report: ReplayReport) -> str:
    """Return the report as the text tables `kvtiers replay` prints."""
    trace = report.trace
    rule = "above" if report.ideal_hit_rate >= REUSE_RULE else "below"
    lines = [
        f"trace      {trace.path} ({trace.format}, {trace.block_tokens}-token blocks)",
        f"requests   {trace.num_requests:,}; blocks {trace.total_blocks:,} requested, "
        f"{trace.unique_blocks:,} unique",
        f"reuse      {report.ideal_hit_rate:.2%} of blocks with an infinite cache (prefix "
        f"semantics): {rule} the ~{REUSE_RULE:.0%} at which pooling starts to pay",
    ]
    if report.costs is not None:
        lines += _cost_lines(report, report.costs)
    for capacity in sorted({r.capacity_blocks for r in report.runs}):
        lines += ["", *_capacity_table(report, capacity)]
    lines += [
        "",
        "hit rate: share of requested blocks served from cache; gap closed: share of the way",
        "from LRU to the optimum (Belady, farthest next use) at the same capacity.",
    ]
    if report.hints is not None:
        lines += [
            f"+{report.hints}: the policy given reuse hints taken from the trace's future",
            f"({_HINTS[report.hints]}); the other blocks are stored cold.",
        ]
    return "\n".join(lines)


_HINTS = {
    "turns": "a prompt that a later request continues is kept",
    "future": "the blocks that a later request shares are kept",
}


def _capacity_table(report: ReplayReport, capacity: int) -> list[str]:
    runs = [(i, r) for i, r in enumerate(report.runs) if r.capacity_blocks == capacity]
    share = capacity / max(report.trace.unique_blocks, 1)
    tiers = runs[0][1].tiers
    layout = " + ".join(f"{t.spec.name} {t.spec.capacity_blocks:,}" for t in tiers)
    title = f"capacity {capacity:,} blocks ({share:.1%} of unique)"
    if len(tiers) > 1:
        title += f": {layout}"
    if report.block_bytes is not None:
        title += f", {format_size(capacity * report.block_bytes)}"
    header = ["policy", "hit rate", "vs lru", "gap closed"]
    if len(tiers) > 1:
        header += [f"{t.spec.name} hits" for t in tiers]
    header += [f"read {t.spec.name}" if len(tiers) > 1 else "read" for t in tiers]
    if report.ttft:
        header += ["TTFT mean", "p90", "prefill x"]
    lru = next((r for _, r in runs if r.policy == "lru"), None)
    rows = [header]
    for i, run in runs:
        rows.append(_run_row(report, i, run, lru))
    best = report.optimum_at(capacity)
    if best is not None:
        rows.append(
            ["optimum", f"{best.hit_rate:.2%}", _delta(best.hit_rate, lru), "100%"]
            + [""] * (len(header) - 4)
        )
    return [title, *format_table(rows)]


def _run_row(report: ReplayReport, i: int, run: RunResult, lru: RunResult | None) -> list[str]:
    total = run.total_blocks or 1
    gap = report.gap_closed(run)
    row = [
        run.policy,
        f"{run.hit_rate:.2%}",
        _delta(run.hit_rate, lru) if run is not lru else "-",
        "-" if gap is None or run is lru else f"{gap:.1%}",
    ]
    if len(run.tiers) > 1:
        row += [f"{t.hits / total:.2%}" for t in run.tiers]
    for t in run.tiers:
        if report.block_bytes is None:
            row.append(f"{t.hits:,} blocks")
        else:
            row.append(format_size(t.hits * report.block_bytes))
    if report.ttft:
        summary = report.ttft[i]
        row += [
            format_seconds(statistics.fmean(summary.with_cache)),
            format_seconds(percentile(summary.with_cache, 90)),
            f"{summary.throughput_gain:.2f}x",
        ]
    return row


def _cost_lines(report: ReplayReport, costs: CostSetup) -> list[str]:
    without = report.ttft_without
    median = _median_prompt(report.trace)
    lines = [
        f"model      {costs.model.name}, {format_size(costs.model.bytes_per_token)} of KV per "
        f"token; {costs.compute.label}",
        f"no cache   TTFT mean {format_seconds(statistics.fmean(without))}, "
        f"p50 {format_seconds(percentile(without, 50))}, "
        f"p90 {format_seconds(percentile(without, 90))}, "
        f"p99 {format_seconds(percentile(without, 99))}",
    ]
    for link, be in zip(costs.links, costs.break_even(median), strict=True):
        verdict = "loading beats recompute" if link.bandwidth > be else "recompute is faster"
        # NOTE: infinite when the latency alone outlasts the recompute (or nothing is computed).
        rate = "never" if be == float("inf") else f"{be / 1e9:.2f} GB/s"
        lines.append(
            f"tier       {link.name}: {link.bandwidth / 1e9:.2f} GB/s, "
            f"{format_seconds(link.latency)}; "
            f"break-even {rate} at the median prompt ({median:,} tokens): {verdict}"
        )
    return lines


def _ttft_dict(summary: TTFTSummary, without: Sequence[float]) -> dict[str, float]:
    mean_with, mean_without = statistics.fmean(summary.with_cache), statistics.fmean(without)
    out = {"mean_s": mean_with, "mean_without_s": mean_without}
    for q in (50, 90, 99):
        out[f"p{q}_s"] = percentile(summary.with_cache, q)
        out[f"p{q}_without_s"] = percentile(without, q)
    out["reduction"] = 1 - mean_with / mean_without if mean_without else 0.0
    out["throughput_gain"] = summary.throughput_gain
    return out


def _median_prompt(trace: Trace) -> int:
    return int(statistics.median(trace.input_tokens)) if trace.input_tokens else 0


def _delta(rate: float, lru: RunResult | None) -> str:
    return "-" if lru is None else f"{(rate - lru.hit_rate) * 100:+.2f} pp"


def format_seconds(s: float) -> str:
    """Return `s` seconds as text: "1.23 s", "4.5 ms" or "67 us"."""
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def format_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Return `rows` as lines of left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
