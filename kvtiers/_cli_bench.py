"""`kvtiers bench CONFIG`: measure a config's tiers on this machine, for the cost model.

Prints a row per tier (read bandwidth, read latency, write bandwidth, where reads came
from), what became of the chunks it wrote, and the `--tier NAME:BW:LATENCY` flags that
`kvtiers replay` and `kvtiers plan` take. `--json` prints one object and `--out FILE` writes
it; those commands read it back with `--tiers-from FILE` (`read_tier_links`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtiers._cli_args import positive_int
from kvtiers.core.config import format_size, load_config
from kvtiers.core.errors import ConfigError
from kvtiers.costmodel import TierLink
from kvtiers.replay.report import format_seconds

if TYPE_CHECKING:
    from kvtiers._tierbench import BenchReport, TierBench

__all__ = ["FORMAT_VERSION", "add_bench_command", "read_tier_links", "report_dict", "tier_flags"]

FORMAT_VERSION = 1
"""The `kvtiers_bench` field of a saved report, checked by `read_tier_links`."""

_NOTES = {
    "page cache": "page cache: the chunks had just been written, so the OS page cache served\n"
    "  the reads (warm); a cold read from the disk is slower. The bench drops no caches\n"
    "  without --cold.",
    "disk (cold)": "disk (cold): before each timed read the bench synced the tier's files and\n"
    "  dropped them from the OS page cache (--cold); at most 1% of their pages stayed.",
    "partly warm": "partly warm: after the drop more than 1% of the tier's files stayed in\n"
    "  the page cache, as another process maps them; those reads were partly warm.",
    "network": "network: what the store itself caches is not known.",
}


def add_bench_command(commands: Any) -> None:
    """Add the `bench` subcommand to `kvtiers`' subparsers."""
    bench = commands.add_parser(
        "bench",
        help="measure a config's tiers on this machine: bandwidth and latency for plan/replay",
        description="Write, read and delete a batch of chunks in each tier of CONFIG, alone, "
        "with the config's layout; the chunks are keyed under a salt of the run alone.",
    )
    bench.add_argument(
        "config", metavar="CONFIG", help="a .toml, .yaml or .yml file with a [layout]"
    )
    bench.add_argument(
        "--chunks",
        type=positive_int,
        metavar="N",
        help="chunks per batch (default: up to 256 MiB, 2 to 1024 chunks); a tier that "
        "evicts by itself takes no more than its free room",
    )
    bench.add_argument(
        "--cold",
        action="store_true",
        help="read lmdb tiers and remote tiers on a local filesystem from the disk: sync and "
        "drop their files from the OS page cache before each timed read (no root needed); "
        "other processes reading those files then read them from the disk too, and slow down",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object instead")
    bench.add_argument("--out", metavar="FILE", help="write the JSON to FILE (for --tiers-from)")
    bench.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from kvtiers._tierbench import bench_config

    config = load_config(args.config)
    try:
        report = asyncio.run(bench_config(config, chunks=args.chunks, cold=args.cold))
    except ConfigError as exc:  # a tier's own checks, run as the cache is built
        raise ConfigError(f"{exc} (in {args.config})") from exc
    data = report_dict(report, args.config)
    if args.out:
        try:
            Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise ConfigError(f"--out {args.out}: cannot write it: {exc}") from exc
    print(json.dumps(data, indent=2) if args.json else "\n".join(format_bench(report, args.config)))
    ok = all(t.status != "failed" and t.clean for t in report.tiers)
    return 0 if ok else 1


def report_dict(report: BenchReport, config: str) -> dict[str, Any]:
    """Return a bench report as JSON-ready data (what `--json` prints)."""
    layout = report.layout
    return {
        "kvtiers_bench": FORMAT_VERSION,
        "config": config,
        "layout": {
            "model": layout.model,
            "chunk_size": layout.chunk_size,
            "chunk_bytes": layout.chunk_bytes,
            "fingerprint": layout.fingerprint.hex(),
        },
        "device": report.device,
        "cold": report.cold,
        "tiers": [{**dataclasses.asdict(t), "notes": list(t.notes)} for t in report.tiers],
        "flags": tier_flags(report),
    }


def tier_flags(report: BenchReport) -> list[str]:
    """Return `--tier NAME:BW:LATENCY` for each measured tier, for replay and plan."""
    return [
        f"--tier {t.name}:{_bandwidth_flag(t.read_bandwidth)}:{_duration_flag(t.read_latency)}"
        for t in report.tiers
        if t.measured
    ]


def format_bench(report: BenchReport, config: str) -> list[str]:
    """Return the report as lines of text."""
    layout = report.layout
    where = "host memory (no CUDA device)" if report.device == "host" else report.device
    lines = [
        f"config  {config}",
        f"layout  {layout.model}: {format_size(layout.chunk_bytes)} chunks of "
        f"{layout.chunk_size} tokens",
        f"chunks  from and to {where}",
        "",
    ]
    header = ("tier", "kind", "chunks", "read BW", "latency", "1-chunk read", "write BW", "reads")
    rows: list[tuple[str, ...]] = [header]
    rows += [_row(t) for t in report.tiers]
    lines += _table(rows)
    lines.append("")
    for t in report.tiers:
        if t.cleanup and not t.cleanup.startswith("nothing kept"):
            lines.append(f"{t.name}: {t.cleanup}")
        lines += [f"{t.name}: {note}" for note in t.notes]
    sources = {t.reads_from for t in report.tiers if t.measured}
    lines += [note for source, note in _NOTES.items() if any(s.startswith(source) for s in sources)]
    lines += _cold_lines(report)
    flags = tier_flags(report)
    if flags:
        lines += ["", "for kvtiers replay / plan (or --tiers-from a file from --out):"]
        lines.append(" ".join(flags))
    return lines


def _cold_lines(report: BenchReport) -> list[str]:
    """Say which tiers' reads were cold, when the bench was asked to make them so."""
    if not report.cold:
        return []
    cold = ", ".join(t.name for t in report.tiers if t.cold) or "none"
    rest = ", ".join(t.name for t in report.tiers if t.measured and not t.cold)
    lines = [f"cold (--cold): {cold}"]
    if rest:
        lines.append(f"not cold (measured as without --cold): {rest}")
    return lines


def _row(t: TierBench) -> tuple[str, ...]:
    if not t.measured:
        return (t.name, t.kind, "-", f"{t.status}: {t.reason}", "", "", "", "")
    return (
        t.name,
        t.kind,
        f"{t.chunks:,}",
        f"{_gb(t.read_bandwidth)} GB/s",
        format_seconds(t.read_latency),
        format_seconds(t.chunk_read_seconds),
        f"{_gb(t.write_bandwidth)} GB/s",
        "page cache (warm)" if t.reads_from == "page cache" else t.reads_from,
    )


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    # NOTE: a status cell spans the figure columns, so it does not set their width.
    full = [r for r in rows if r[4] or r is rows[0]]
    widths = [max(len(r[i]) for r in full) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _gb(bytes_per_s: float) -> str:
    return _significant(bytes_per_s / 1e9)


def _significant(x: float) -> str:
    """Return `x` with three significant digits, never in exponent form."""
    if x <= 0:
        return "0"
    decimals = min(6, max(0, 2 - math.floor(math.log10(x))))
    return f"{x:.{decimals}f}"


def _bandwidth_flag(bytes_per_s: float) -> str:
    for scale, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if bytes_per_s >= scale:
            return _significant(bytes_per_s / scale) + unit
    return _significant(bytes_per_s) + "B/s"


def _duration_flag(seconds: float) -> str:
    for scale, unit in ((1.0, "s"), (1e-3, "ms")):
        if seconds >= scale:
            return _significant(seconds / scale) + unit
    return _significant(seconds * 1e6) + "us"


def read_tier_links(path: str) -> list[TierLink]:
    """Return the measured tiers of a `kvtiers bench --out` file as cost-model links.

    Raises:
        ConfigError: the file is missing, not JSON, not a bench report, or holds no
            measured tier.
    """
    where = f"--tiers-from {path}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON: {exc}") from exc
    except RecursionError:  # arrays or objects nested thousands deep
        raise ConfigError(f"{where}: not JSON: nested too deep") from None
    if (
        not isinstance(data, dict)
        or data.get("kvtiers_bench") != FORMAT_VERSION
        or not isinstance(data.get("tiers"), list)
    ):
        raise ConfigError(
            f"{where}: not a kvtiers bench report (write one with `kvtiers bench CONFIG --out "
            "FILE`)"
        )
    links = [_link(i, tier, where) for i, tier in enumerate(data["tiers"])]
    measured = [link for link in links if link is not None]
    if not measured:
        raise ConfigError(f"{where}: the bench measured no tier")
    return measured


def _link(i: int, tier: object, where: str) -> TierLink | None:
    """Return a report entry's link; `None` for a tier the bench did not measure."""
    if not isinstance(tier, dict) or not isinstance(tier.get("name"), str):
        raise ConfigError(f"{where}: tiers[{i}]: expected an object with a name")
    if tier.get("status") != "measured":
        return None
    figures = [tier.get("read_bandwidth"), tier.get("read_latency")]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in figures):
        raise ConfigError(
            f"{where}: tiers[{i}] ({tier['name']}): read_bandwidth and read_latency must be numbers"
        )
    try:
        return TierLink(tier["name"], float(tier["read_bandwidth"]), float(tier["read_latency"]))
    except OverflowError:  # an integer past the largest float
        raise ConfigError(
            f"{where}: tiers[{i}] ({tier['name']}): read_bandwidth and read_latency must be "
            "finite numbers"
        ) from None
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
