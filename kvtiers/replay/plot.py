"""Plot a replay: hit rate against capacity per policy, and the TTFT distribution.

Needs matplotlib (`pip install kvtiers[plot]`); it is imported only here, on first use.
"""

from __future__ import annotations

import os
from typing import Any

from kvtiers.core.errors import ConfigError
from kvtiers.replay.report import ReplayReport

__all__ = ["plot_report"]


def plot_report(report: ReplayReport, path: str | os.PathLike[str]) -> None:
    """Write a two-panel figure of `report` to `path` (format from the suffix).

    The left panel shows hit rate against capacity for each policy, with the optimum and
    the infinite cache; the right one the TTFT distribution without the cache and with it
    (the best policy at each capacity), when the report has a cost model.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib; install kvtiers[plot]") from exc
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    try:
        _hit_rates(left, report)
        _ttft(right, report)
        fig.suptitle(os.path.basename(report.trace.path))
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=120)
    finally:
        plt.close(fig)


def _hit_rates(ax: Any, report: ReplayReport) -> None:
    unique = max(report.trace.unique_blocks, 1)
    policies = list(dict.fromkeys(r.policy for r in report.runs))
    for policy in policies:
        runs = sorted(
            (r for r in report.runs if r.policy == policy), key=lambda r: r.capacity_blocks
        )
        xs = [100 * r.capacity_blocks / unique for r in runs]
        ax.plot(xs, [100 * r.hit_rate for r in runs], marker="o", label=policy)
    best = sorted(report.optimum, key=lambda o: o.capacity_blocks)
    ax.plot(
        [100 * o.capacity_blocks / unique for o in best],
        [100 * o.hit_rate for o in best],
        "k--",
        marker="s",
        label="optimum (Belady)",
    )
    ax.axhline(100 * report.ideal_hit_rate, color="grey", linestyle=":", label="infinite cache")
    ax.set_xlabel("capacity (% of unique blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title("hit rate vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()


def _ttft(ax: Any, report: ReplayReport) -> None:
    ax.set_title("TTFT distribution")
    if not report.ttft:
        ax.text(0.5, 0.5, "pass --model for TTFT", ha="center", va="center")
        ax.set_axis_off()
        return
    _cdf(ax, report.ttft_without, "no cache", "k")
    for capacity in sorted({r.capacity_blocks for r in report.runs}):
        i = max(
            (i for i, r in enumerate(report.runs) if r.capacity_blocks == capacity),
            key=lambda i: report.runs[i].hits,
        )
        run = report.runs[i]
        _cdf(ax, report.ttft[i].with_cache, f"{run.policy}, {capacity:,} blocks", None)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.grid(True, alpha=0.3)
    ax.legend()


def _cdf(ax: Any, samples: Any, label: str, color: str | None) -> None:
    xs = sorted(max(s, 1e-6) for s in samples)
    ys = [(k + 1) / len(xs) for k in range(len(xs))]
    ax.step(xs, ys, where="post", label=label, color=color)
