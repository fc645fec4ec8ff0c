"""Run the `kvtiers` command: `demo`, `explain`, `remote` and `--version`.

`demo` replays a synthetic chat through DRAM and LMDB tiers; `explain` shows what a
config's tiers hold and need without opening them; `remote ls` and `remote purge` list and
delete the objects of a config's remote tiers.

Exit status: 0 on success; 1 when the demo finds wrong KV or a tier fails; 2 for bad
arguments or a bad config (the message names the field).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtiers import __version__
from kvtiers._cli_args import positive_int as _positive_int
from kvtiers._cli_bench import add_bench_command
from kvtiers._cli_replay import add_replay_commands
from kvtiers.cache import TieredCache
from kvtiers.core.config import CacheConfig, TierConfig, format_size, load_config
from kvtiers.core.errors import ConfigError, KVTiersError
from kvtiers.core.layout import KVLayout
from kvtiers.demo import ChatWorkload, default_demo_config, format_report, run_demo
from kvtiers.gpu.pinned import cuda_available
from kvtiers.tiers.base import Tier
from kvtiers.tiers.dram import MemoryTier
from kvtiers.tiers.registry import TierRegistry

__all__ = ["main"]

_CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2; "max" means no limit
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)
_WORKLOAD = ChatWorkload()  # the demo's defaults

# NOTE: cgroup v1 writes "no limit" as a huge page-aligned number (0x7FFFFFFFFFFFF000).
_NO_LIMIT = 2**60


def main(argv: list[str] | None = None) -> int:
    """Run the `kvtiers` command line on `argv` and return the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version or bad arguments; argparse said why
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    if args.command is None:
        parser.print_usage(sys.stderr)
        return 2
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except ConfigError as exc:
        print(f"kvtiers {args.command}: {exc}", file=sys.stderr)
        return 2
    except KVTiersError as exc:
        print(f"kvtiers {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtiers", description="Tiered KV cache for LLM inference."
    )
    parser.add_argument("--version", action="version", version=f"kvtiers {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="replay a synthetic multi-turn chat through DRAM and LMDB tiers"
    )
    demo.add_argument("--dir", help="directory for the demo's LMDB tier (default: a temporary one)")
    demo.add_argument(
        "--config", help="a TOML/YAML config with a [layout] to use instead (--dir is unused)"
    )
    demo.add_argument(
        "--conversations",
        type=_positive_int,
        default=_WORKLOAD.conversations,
        metavar="N",
        help=f"conversations sharing one system prompt (default: {_WORKLOAD.conversations})",
    )
    demo.add_argument(
        "--turns",
        type=_positive_int,
        default=_WORKLOAD.turns,
        metavar="N",
        help=f"requests per conversation (default: {_WORKLOAD.turns})",
    )
    demo.add_argument("--seed", type=int, default=0, metavar="S", help="workload seed")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.set_defaults(run=_run_demo)
    explain = commands.add_parser(
        "explain", help="show what a config's tiers hold and need, without opening them"
    )
    explain.add_argument("config", metavar="CONFIG", help="a .toml, .yaml or .yml file")
    explain.set_defaults(run=_run_explain)
    _add_remote_parser(commands)
    _add_inspect_parser(commands)
    _add_stats_parser(commands)
    _add_purge_parser(commands)
    add_replay_commands(commands)
    add_bench_command(commands)
    return parser


# -- demo ------------------------------------------------------------------------------


def _run_demo(args: argparse.Namespace) -> int:
    workload = ChatWorkload(conversations=args.conversations, turns=args.turns, seed=args.seed)
    progress = not args.no_progress and sys.stderr.isatty()
    if args.config is not None:
        config = load_config(args.config)
        report = asyncio.run(run_demo(config, workload, progress=progress))
    else:
        with _demo_directory(args.dir) as directory:
            config = load_config(default_demo_config(directory))
            report = asyncio.run(run_demo(config, workload, progress=progress))
    print(format_report(report))
    return 0 if report.ok else 1


@contextmanager
def _demo_directory(path: str | None) -> Iterator[Path]:
    """Yield `path` (created if missing), or a temporary directory."""
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="kvtiers-demo-") as tmp:
        yield Path(tmp)


# -- explain ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Machine:
    """What this machine offers the tiers."""

    ram_bytes: int
    cgroup_limit: int | None
    """The cgroup's memory limit; `None` when there is none."""

    @property
    def memory_bytes(self) -> int:
        """Return the host memory the tiers may use: RAM capped by the cgroup."""
        return min(self.ram_bytes, self.cgroup_limit or self.ram_bytes)


def _read_machine() -> _Machine:
    """Return the machine's RAM and the first cgroup memory limit found."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMIT_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        limit = None if text == "max" or int(text) >= _NO_LIMIT else int(text)
        return _Machine(ram, limit)
    return _Machine(ram, None)


def _run_explain(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    registry = TierRegistry()
    classes = [registry.resolve(tc.kind, where=tc.where) for tc in config.tiers]
    # NOTE: building the cache validates every tier's options, eviction and write policy
    # exactly as a real run does; tiers allocate and open nothing until the cache is opened.
    tiers: Sequence[Tier | None] = [None] * len(classes)
    if config.layout is not None:
        tiers = TieredCache(config, registry=registry).tiers
    machine = _read_machine()
    lines = [f"config        {args.config}", *_layout_lines(config)]
    for tc, cls, tier in zip(config.tiers, classes, tiers, strict=True):
        lines += _tier_lines(tc, cls, tier, config.layout)
    lines += _machine_lines(config.tiers, classes, machine)
    print("\n".join(lines))
    return 0


def _layout_lines(config: CacheConfig) -> list[str]:
    layout = config.layout
    if layout is None:
        return ["layout        none: an engine adapter supplies it, so chunk counts are unknown"]
    revision = f" @ {layout.model_revision}" if layout.model_revision else ""
    return [
        f"layout        model {layout.model!r}{revision}: {layout.kind}, {layout.dtype}",
        f"shape         {layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
        f"{layout.head_size}, tp rank {layout.tp_rank} of {layout.tp_size}",
        f"chunk size    {layout.chunk_size} tokens",
        f"bytes/token   {_size_and_bytes(layout.bytes_per_token)}",
        f"bytes/chunk   {_size_and_bytes(layout.chunk_bytes)}",
        f"fingerprint   {layout.fingerprint.hex()}",
        f"write queue   {config.write_queue_chunks} chunks per write-through tier",
        "split loads   "
        + ("all lower tiers at once" if config.concurrent_reads else "one tier after another"),
    ]


def _size_and_bytes(num_bytes: int) -> str:
    exact = f" ({num_bytes:,} B)" if num_bytes >= 1024 else ""
    return format_size(num_bytes) + exact


def _tier_lines(
    tc: TierConfig, cls: type[Tier], tier: Tier | None, layout: KVLayout | None
) -> list[str]:
    options = ", ".join(f"{k}={_shown(k, v)}" for k, v in sorted(tc.options.items())) or "none"
    evicted_by = "the tier itself" if cls.manages_eviction else "the cache"
    shared = "; shared with other processes" if cls.shared else ""
    policy = "top tier: written by store" if tc.index == 0 else tc.write_policy
    return [
        "",
        f"{tc.where}      {tc.name} (kind {tc.kind}, {cls.__module__}.{cls.__qualname__})",
        f"  capacity    {format_size(tc.capacity_bytes)} = {_chunks(tc, tier, layout)}",
        f"  eviction    {tc.eviction}, by {evicted_by}{shared}",
        f"  write       {policy}",
        f"  options     {options}",
        *_takes(tc, cls, tier),
        *_described(tier),
    ]


def _shown(name: str, value: Any) -> Any:
    """Return an option's value for display: a URL without its credentials."""
    if name == "url" and isinstance(value, str):
        from kvtiers.tiers._remote_options import display_url

        return display_url(value)
    return value


def _described(tier: Tier | None) -> list[str]:
    """Return the lines a tier writes about itself (`explain_lines`), if it does."""
    explain_lines = getattr(tier, "explain_lines", None)
    return list(explain_lines()) if callable(explain_lines) else []


def _chunks(tc: TierConfig, tier: Tier | None, layout: KVLayout | None) -> str:
    if layout is None:
        return "? chunks (no layout)"
    num_chunks = getattr(tier, "num_chunks", None)
    if isinstance(num_chunks, int):
        return f"{num_chunks:,} chunks"
    # NOTE: a tier that stores a header with each chunk holds slightly fewer.
    return f"up to {tc.capacity_bytes // layout.chunk_bytes:,} chunks"


def _resource(tc: TierConfig, cls: type[Tier]) -> str:
    """Return what a tier's capacity takes: host memory, GPU memory or disk."""
    if tc.kind == "hbm":
        return "GPU memory"
    if issubclass(cls, MemoryTier):
        return "host memory"
    if "path" in tc.options:
        return "disk"
    return ""


def _takes(tc: TierConfig, cls: type[Tier], tier: Tier | None) -> list[str]:
    resource = _resource(tc, cls)
    size = format_size(tc.capacity_bytes)
    if resource == "disk":
        anchor = _existing_parent(tc.options["path"])
        free = shutil.disk_usage(anchor).free
        lines = [f"  takes       up to {size} of disk; {format_size(free)} free on {anchor}"]
        map_size = getattr(tier, "map_size", None)
        if isinstance(map_size, int):
            # NOTE: the file can grow up to the map size (pages freed by copy-on-write).
            grows = "; it may outgrow the free space" if map_size > free else ""
            lines.append(f"  map size    {format_size(map_size)}{grows}")
        return lines
    if resource:
        return [f"  takes       {size} of {resource}, allocated when the cache opens"]
    return ["  takes       nothing on this machine (not checked)"]


def _existing_parent(path: Any) -> Path:
    """Return `path` or its nearest existing parent (where its files would go)."""
    current = Path(os.fspath(path)).expanduser().absolute()
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def _machine_lines(
    tiers: Sequence[TierConfig], classes: Sequence[type[Tier]], machine: _Machine
) -> list[str]:
    limit = "none" if machine.cgroup_limit is None else format_size(machine.cgroup_limit)
    by_resource: dict[str, list[TierConfig]] = {}
    for tc, cls in zip(tiers, classes, strict=True):
        by_resource.setdefault(_resource(tc, cls), []).append(tc)
    host, gpu = by_resource.get("host memory", []), by_resource.get("GPU memory", [])
    lines = [
        "",
        f"machine       RAM {format_size(machine.ram_bytes)}, cgroup memory limit {limit}",
    ]
    lines += _check_budget("host memory", host, machine.memory_bytes, "RAM and cgroup limit")
    lines += _gpu_lines(gpu)
    for anchor, group in _by_filesystem(by_resource.get("disk", [])).items():
        free = shutil.disk_usage(anchor).free
        lines += _check_budget(f"disk at {anchor}", group, free, "free space")
    return lines


def _check_budget(
    resource: str, tiers: Sequence[TierConfig], available: int, source: str
) -> list[str]:
    """Return a summary of `tiers` that share one resource, with WARNINGs."""
    if not tiers:
        return []
    need = sum(tc.capacity_bytes for tc in tiers)
    short = f"of {resource}; only {format_size(available)} available"
    lines = [
        f"  {resource}: tiers need {format_size(need)} of {format_size(available)} "
        f"available ({source})"
    ]
    for tc in tiers:
        if tc.capacity_bytes > available:
            lines.append(
                f"WARNING: {tc.where} ({tc.name}) needs {format_size(tc.capacity_bytes)} {short}"
            )
    if len(tiers) > 1 and need > available:
        names = ", ".join(tc.where for tc in tiers)
        lines.append(f"WARNING: {names} together need {format_size(need)} {short}")
    return lines


def _gpu_lines(tiers: Sequence[TierConfig]) -> list[str]:
    if not tiers:
        return []
    if not cuda_available():
        return ["WARNING: GPU memory tiers are configured, but no CUDA device is visible"]
    total = torch.cuda.get_device_properties(0).total_memory
    return _check_budget("GPU memory", tiers, total, "device 0")


def _by_filesystem(tiers: Sequence[TierConfig]) -> dict[Path, list[TierConfig]]:
    """Group disk tiers by filesystem, keyed by an existing path on it."""
    groups: dict[int, tuple[Path, list[TierConfig]]] = {}
    for tc in tiers:
        anchor = _existing_parent(tc.options["path"])
        groups.setdefault(anchor.stat().st_dev, (anchor, []))[1].append(tc)
    return dict(groups.values())


# -- inspect ---------------------------------------------------------------------------


def _add_inspect_parser(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect", help="count (and with --verify, check) what an LMDB path or remote URL holds"
    )
    inspect.add_argument("target", metavar="PATH|URL", help="an LMDB directory or fsspec URL")
    inspect.add_argument("--verify", action="store_true", help="read and checksum every entry")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument(
        "--storage-options", metavar="JSON", help="fsspec options for a URL, as a JSON object"
    )
    inspect.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from kvtiers._inspect import format_text, inspect, to_json

    options = _storage_options(args.storage_options)
    result = inspect(args.target, verify=args.verify, storage_options=options)
    print(to_json(result) if args.json else "\n".join(format_text(result)))
    return 1 if result.bad else 0


def _storage_options(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        options = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"--storage-options: not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ConfigError("--storage-options: expected a JSON object")
    return options


# -- stats -----------------------------------------------------------------------------


def _add_stats_parser(commands: Any) -> None:
    stats = commands.add_parser(
        "stats", help="hit rate, miss reasons and tiers of a running cache (its metrics URL)"
    )
    stats.add_argument(
        "url", metavar="URL", help="the cache's metrics endpoint, e.g. 127.0.0.1:9400"
    )
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(run=_run_stats)


def _run_stats(args: argparse.Namespace) -> int:
    from kvtiers._cli_stats import fetch_stats, format_stats, to_json

    result = fetch_stats(args.url)
    print(to_json(result) if args.json else "\n".join(format_stats(result)))
    return 0


# -- purge -----------------------------------------------------------------------------


def _add_purge_parser(commands: Any) -> None:
    purge = commands.add_parser(
        "purge", help="delete one layout's chunks, or the bad ones, from an LMDB path or URL"
    )
    purge.add_argument("target", metavar="PATH|URL", help="an LMDB directory or fsspec URL")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--fingerprint", metavar="F", help="a layout fingerprint (or prefix) as inspect shows"
    )
    which.add_argument("--bad", action="store_true", help="entries that fail verification")
    purge.add_argument(
        "--older-than",
        type=_age,
        metavar="AGE",
        help="with --fingerprint on a URL: only objects not read or written for AGE "
        "(e.g. 3600, 90m, 12h, 7d); an LMDB path records no times",
    )
    purge.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    purge.add_argument("--json", action="store_true", help="print JSON")
    purge.add_argument(
        "--storage-options", metavar="JSON", help="fsspec options for a URL, as a JSON object"
    )
    purge.set_defaults(run=_run_purge)


def _run_purge(args: argparse.Namespace) -> int:
    from kvtiers._purge import purge, to_json

    report = purge(
        args.target,
        fingerprint=args.fingerprint,
        bad=args.bad,
        older_than=args.older_than,
        dry_run=args.dry_run,
        storage_options=_storage_options(args.storage_options),
    )
    if args.json:
        print(to_json(report))
    else:
        verb = "would remove" if report.dry_run else "removed"
        what = f"layout {report.fingerprint}" if report.fingerprint else "bad entries"
        size = format_size(report.removed_bytes)
        print(f"{report.target}: {verb} {report.removed:,} chunks ({size}, {what}); ", end="")
        print(f"{report.kept:,} kept")
    return 0


# -- remote ----------------------------------------------------------------------------

_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def _add_remote_parser(commands: Any) -> None:
    remote = commands.add_parser(
        "remote", help="list or purge the objects of a config's remote tiers"
    )
    actions = remote.add_subparsers(dest="remote_command", metavar="ACTION", required=True)
    ls = actions.add_parser("ls", help="list the pool: objects per layout, bytes, last access")
    ls.add_argument("config", metavar="CONFIG", help="a .toml, .yaml or .yml file")
    ls.add_argument("--tier", metavar="NAME", help="only this remote tier (default: all)")
    ls.add_argument("--keys", action="store_true", help="also list every object of the layout")
    ls.set_defaults(run=_run_remote_ls)
    purge = actions.add_parser("purge", help="delete the config layout's objects")
    purge.add_argument("config", metavar="CONFIG", help="a .toml, .yaml or .yml file")
    purge.add_argument("--tier", metavar="NAME", help="only this remote tier (default: all)")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every object of the layout")
    which.add_argument(
        "--older-than",
        type=_age,
        metavar="AGE",
        help="objects not read or written for AGE (e.g. 3600, 90m, 12h, 7d)",
    )
    purge.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    purge.set_defaults(run=_run_remote_purge)


def _age(text: str) -> float:
    match = _AGE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected an age such as 3600, 90m, 12h or 7d, got {text!r}"
        )
    return float(match.group(1)) * _AGE_UNITS[match.group(2)]


def _remote_tiers(config: CacheConfig, name: str | None) -> list[TierConfig]:
    tiers = [tc for tc in config.tiers if tc.kind == "remote" and name in (None, tc.name)]
    if not tiers:
        which = f"named {name!r}" if name is not None else "of kind 'remote'"
        raise ConfigError(f"tiers: no tier {which} in the config")
    return tiers


def _run_remote_ls(args: argparse.Namespace) -> int:
    from kvtiers.tiers._remote_admin import list_pool

    config = load_config(args.config)
    for tc in _remote_tiers(config, args.tier):
        namespaces = asyncio.run(list_pool(tc, config.layout))
        print("\n".join(_pool_lines(tc, namespaces, keys=args.keys)))
    return 0


def _pool_lines(tc: TierConfig, namespaces: Sequence[Any], *, keys: bool) -> list[str]:
    from kvtiers.tiers._remote_admin import is_fingerprint
    from kvtiers.tiers._remote_options import display_url

    lines = [f"{tc.where}      {tc.name} (kind remote) at {display_url(tc.options['url'])}"]
    if not namespaces:
        lines.append("  empty")
    for ns in namespaces:
        objects, listing = ns.objects, ns.listing
        used = sum(o.size for o in objects)
        what = "this layout" if ns.current else "layout" if is_fingerprint(ns.fingerprint) else "?"
        line = f"  {ns.fingerprint}  {what}: {len(objects):,} objects, {format_size(used)}"
        if ns.current:
            line += f" of {format_size(tc.capacity_bytes)}"
        if objects:
            line += (
                f"; last access {_when(objects[0].last_access)} .. {_when(objects[-1].last_access)}"
            )
        extras = [
            f"{len(listing.access_logs)} access logs" if listing.access_logs else "",
            f"{len(listing.temps)} temporaries" if listing.temps else "",
            f"{len(listing.others)} other files" if listing.others else "",
        ]
        lines.append(line + "".join(f"; {e}" for e in extras if e))
        if keys and ns.current:
            lines += [f"    {o.key.hex()}  {o.size:>12,}  {_when(o.last_access)}" for o in objects]
    return lines


def _when(timestamp: float) -> str:
    when = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return when.strftime("%Y-%m-%d %H:%M:%SZ")


def _run_remote_purge(args: argparse.Namespace) -> int:
    from kvtiers.tiers._remote_admin import purge_namespace

    config = load_config(args.config)
    if config.layout is None:
        raise ConfigError("layout: required to purge: the layout names the namespace")
    for tc in _remote_tiers(config, args.tier):
        result = asyncio.run(
            purge_namespace(
                tc,
                config.layout.fingerprint.hex(),
                older_than=args.older_than,
                dry_run=args.dry_run,
            )
        )
        verb = "would delete" if args.dry_run else "deleted"
        print(
            f"{tc.where} {tc.name}: {verb} {result.num_objects:,} objects "
            f"({format_size(result.num_bytes)}) and {result.num_other_files:,} other files; "
            f"{result.num_kept:,} objects kept"
        )
    return 0
