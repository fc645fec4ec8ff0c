"""The report of a `kvtiers demo` replay: what was served, per tier, and the KV check."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtiers.core.config import format_size

if TYPE_CHECKING:
    from kvtiers.demo import DemoReport

__all__ = ["format_report"]

_MAX_LISTED = 20  # mismatches printed one by one; the rest are only counted


def format_report(report: DemoReport) -> str:
    """Return the human-readable report of a replay."""
    lines = _summary_lines(report) + [""] + _tier_lines(report) + [""] + _check_lines(report)
    return "\n".join(lines)


def _summary_lines(report: DemoReport) -> list[str]:
    stats, totals, layout, work = report.stats, report.totals, report.layout, report.workload
    recomputed = totals.recomputed_tokens * layout.bytes_per_token
    return [
        f"kvtiers demo: {work.conversations} conversations x {work.turns} turns "
        f"(seed {work.seed}), model {layout.model!r}",
        f"  layout            {layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
        f"{layout.head_size}, {layout.dtype}; chunk {layout.chunk_size} tokens = "
        f"{format_size(layout.chunk_bytes)}",
        f"  requests          {totals.requests} ({totals.prompt_tokens:,} prompt tokens)",
        f"  prefix hit rate   {stats.hit_rate:.1%} of prompt tokens found by lookup "
        f"({stats.hit_tokens:,})",
        f"  served from cache {format_size(stats.loaded_bytes)} "
        f"({totals.loaded_tokens:,} tokens, {totals.short_loads} short loads)",
        f"  recomputed        {format_size(recomputed)} ({totals.recomputed_tokens:,} tokens)",
        f"  load bandwidth    {format_size(stats.load_bandwidth)}/s "
        f"({stats.loads} loads in {stats.load_seconds:.2f} s)",
        f"  wall time         {report.wall_seconds:.1f} s",
    ]


def _tier_lines(report: DemoReport) -> list[str]:
    lines = [
        "hits per tier (chunks) and tier usage:",
        f"  {'tier':<10} {'kind':<6} {'hits':>7} {'misses':>7} {'promoted':>8} "
        f"{'evicted':>8} {'entries':>8}  used / capacity",
    ]
    for tier in report.stats.tiers:
        usage = tier.usage
        lines.append(
            f"  {tier.name:<10} {tier.kind:<6} {tier.hits:>7} {tier.misses:>7} "
            f"{tier.promotions:>8} {tier.evictions:>8} {usage.num_entries:>8}  "
            f"{format_size(usage.used_bytes)} / {format_size(usage.capacity_bytes)}"
        )
    lines += [
        f"  {t.name} at {t.options['path']}" for t in report.config.tiers if "path" in t.options
    ]
    queued = report.stats.write_queue_chunks
    if queued:
        lines.append(f"  ({queued} chunk{'s' * (queued != 1)} still queued for write-through)")
    return lines


def _check_lines(report: DemoReport) -> list[str]:
    totals = report.totals
    if report.ok:
        return [f"KV check: OK, all {totals.checked_chunks} loaded chunks match (0 mismatches)"]
    lines = [
        f"KV check: FAILED, {len(totals.mismatches)} of {totals.checked_chunks} loaded "
        "chunks differ from what their prefix produces"
    ]
    lines += [
        f"  mismatch: request {m.request} (conversation {m.conversation}, turn {m.turn}), "
        f"chunk {m.chunk_idx}"
        for m in totals.mismatches[:_MAX_LISTED]
    ]
    if len(totals.mismatches) > _MAX_LISTED:
        lines.append(f"  ... and {len(totals.mismatches) - _MAX_LISTED} more")
    return lines
