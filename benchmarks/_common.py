"""Shared pieces of the benchmarks: the result record, machine description, table printing.

Every benchmark times kvtiers and its baseline in the same process, interleaving their
repetitions so that noise on a shared machine hits both alike, and reports medians (the
timing helpers are in `benchmarks._timing`).

`Result.ratio` always reads "how kvtiers compares with the baseline, higher is better":
baseline time / kvtiers time for durations, kvtiers rate / baseline rate for rates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal

__all__ = [
    "GIB",
    "MIB",
    "Result",
    "Target",
    "machine_info",
    "main",
    "print_report",
]

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True, slots=True)
class Target:
    """A goal for one result: `metric` `op` `threshold`, e.g. ratio >= 50."""

    metric: Literal["ratio", "value"]
    """Which number the goal is about: the ratio, or kvtiers' own value."""
    op: Literal[">=", "<"]
    threshold: float

    def check(self, value: float, ratio: float | None) -> bool | None:
        """Return whether the goal is met (`None` when the number is missing)."""
        x = ratio if self.metric == "ratio" else value
        if x is None:
            return None
        return x >= self.threshold if self.op == ">=" else x < self.threshold

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g}"


@dataclass(frozen=True, slots=True)
class Result:
    """One line of a benchmark report."""

    name: str
    """What was measured."""
    value: float
    """kvtiers' figure, in `unit`."""
    baseline: float | None
    """The baseline's figure in the same unit, measured in the same run."""
    unit: str
    ratio: float | None
    """kvtiers vs baseline, higher is better (speed-up, or fraction of the baseline's rate)."""
    target: str
    """The goal in words (`"ratio >= 50"`), or `"-"` for an informative line."""
    passed: bool | None
    """Whether the goal was met; `None` for an informative line."""
    notes: str = ""

    @classmethod
    def of_times(
        cls,
        name: str,
        seconds: float,
        baseline_seconds: float | None,
        *,
        unit: str = "ms",
        target: Target | None = None,
        notes: str = "",
    ) -> Result:
        """Build a result from durations (lower is better); ratio = baseline / kvtiers."""
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
        ratio = baseline_seconds / seconds if baseline_seconds is not None and seconds else None
        return cls._make(
            name, seconds * scale, _scaled(baseline_seconds, scale), unit, ratio, target, notes
        )

    @classmethod
    def of_rates(
        cls,
        name: str,
        rate: float,
        baseline_rate: float | None,
        *,
        unit: str,
        target: Target | None = None,
        notes: str = "",
    ) -> Result:
        """Build a result from rates (higher is better); ratio = kvtiers / baseline."""
        ratio = rate / baseline_rate if baseline_rate else None
        return cls._make(name, rate, baseline_rate, unit, ratio, target, notes)

    @classmethod
    def _make(
        cls,
        name: str,
        value: float,
        baseline: float | None,
        unit: str,
        ratio: float | None,
        target: Target | None,
        notes: str,
    ) -> Result:
        passed = target.check(value, ratio) if target is not None else None
        return cls(
            name, value, baseline, unit, ratio, str(target) if target else "-", passed, notes
        )


def _scaled(x: float | None, scale: float) -> float | None:
    return None if x is None else x * scale


# -- machine -----------------------------------------------------------------------------


def machine_info() -> dict[str, str]:
    """Describe the machine and the versions that the figures depend on."""
    info = {
        "cpu": _cpu_model(),
        "cores": f"{os.cpu_count()} logical, {len(os.sched_getaffinity(0))} usable",
        "ram": f"{_mem_total_gib():.1f} GiB",
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "python": platform.python_version(),
    }
    for dist in ("kvtiers", "torch", "numpy", "lmdb", "xxhash"):
        info[dist] = _version(dist)
    try:
        import torch

        info["torch threads"] = str(torch.get_num_threads())
    except ImportError:
        pass
    info["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return float("nan")


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


# -- reporting ---------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    ax = abs(x)
    if ax >= 100:
        return f"{x:,.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "MISS", None: "-"}[passed]


def print_report(results: Sequence[Result], *, file: Any = None) -> None:
    """Print `results` as a Markdown table, then their notes."""
    out = file or sys.stdout
    header = ("benchmark", "kvtiers", "baseline", "unit", "ratio", "target", "result")
    rows = [_cells(r) for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    right = {1, 2, 4}

    def line(cells: Sequence[str]) -> str:
        padded = (
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        return "| " + " | ".join(padded) + " |"

    print(line(header), file=out)
    print(
        "|"
        + "|".join(
            ("-" * (w + 1) + ":" if i in right else "-" * (w + 2)) for i, w in enumerate(widths)
        )
        + "|",
        file=out,
    )
    for row in rows:
        print(line(row), file=out)
    _print_notes(results, out)
    out.flush()


def _cells(r: Result) -> tuple[str, ...]:
    """Return the table cells of one result, formatted."""
    return (
        r.name,
        _fmt(r.value),
        _fmt(r.baseline),
        r.unit,
        "-" if r.ratio is None else f"{_fmt(r.ratio)}x",
        r.target,
        _verdict(r.passed),
    )


def _print_notes(results: Sequence[Result], out: Any) -> None:
    """Print the notes of `results` after a blank line and a "Notes:" heading, if any."""
    noted = [r for r in results if r.notes]
    if noted:
        print(file=out)
        print("Notes:", file=out)
        for r in noted:
            print(f"- {r.name}: {r.notes}", file=out)


def print_machine(info: dict[str, str], *, file: Any = None) -> None:
    """Print the machine description as a Markdown list."""
    out = file or sys.stdout
    for key, value in info.items():
        print(f"- {key}: {value}", file=out)
    out.flush()


def write_json(path: str, info: dict[str, str], results: Sequence[Result], **extra: Any) -> None:
    """Write the machine description and the results to `path` as JSON."""
    data = {"machine": info, **extra, "results": [asdict(r) for r in results]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def main(run: Callable[[bool], list[Result]], description: str) -> None:
    """Run one benchmark module from the command line (`--quick`, `--json OUT`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args()
    info = machine_info()
    print_machine(info)
    print()
    results = run(args.quick)
    print_report(results)
    if args.json:
        write_json(args.json, info, results, quick=args.quick)
