"""Plot a replay: hit rate against capacity per policy, and the TTFT distribution.

Needs matplotlib (`pip install kvtiers[plot]`); it is imported only here, on first use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtiers.core.errors import ConfigError
from kvtiers.replay.report import ReplayReport

__all__ = ["plot_path", "plot_report"]

_DEFAULT_FORMAT = "png"  # the format of a path without a suffix


def plot_path(path: str | os.PathLike[str]) -> Path:
    """Return the file a plot asked for as `path` goes to, checked before any replay runs.

    A path without a suffix gets `.png`, as matplotlib would add.

    Raises:
        ConfigError: matplotlib is not installed, the suffix names a format it cannot
            write, `path` is a directory, or its folder does not exist or is not writable.
    """
    given = os.fspath(path)
    out = Path(given)
    if not given.strip() or out.is_dir():
        raise ConfigError(f"--plot {given!r}: a directory; give a file such as out.png")
    fmt = out.suffix.lower().removeprefix(".")
    if not fmt:
        out, fmt = out.with_name(f"{out.name}.{_DEFAULT_FORMAT}"), _DEFAULT_FORMAT
    supported = _formats()
    if fmt not in supported:
        raise ConfigError(
            f"--plot {given}: matplotlib cannot write {fmt!r} files; use one of "
            + ", ".join(sorted(supported))
        )
    folder = out.parent
    if not folder.is_dir():
        raise ConfigError(f"--plot {given}: no folder {str(folder)!r}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--plot {given}: cannot write into {str(folder)!r}")
    return out


def _formats() -> set[str]:
    """Return the file formats matplotlib writes (by suffix)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib; install kvtiers[plot]") from exc
    return set(FigureCanvasBase.get_supported_filetypes())


def plot_report(report: ReplayReport, path: str | os.PathLike[str]) -> None:
    """Write a two-panel figure of `report` to `path` (format from the suffix).

    The left panel shows hit rate against capacity for each policy, with the optimum and
    the infinite cache; the right one the TTFT distribution without the cache and with it
    (the best policy at each capacity), when the report has a cost model. Check `path`
    with `plot_path` first: this writes to it as it is.

    Raises:
        ConfigError: matplotlib is not installed, or the file cannot be written.
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
    except OSError as exc:
        raise ConfigError(f"--plot {os.fspath(path)}: cannot write it: {exc}") from exc
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
