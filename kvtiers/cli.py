"""Run the `kvtiers` command: `demo`, `explain`, `remote` and `--version`.

`demo` replays a synthetic chat through DRAM and LMDB tiers; `explain` shows what a
config's tiers hold and need without opening them; `remote ls` and `remote purge` list and
delete the objects of a config's remote tiers.

Exit status: 0 on success; 1 when the demo finds wrong KV, a tier fails, or a store
cannot be read or changed (`TierIOError`, or an `OSError` the command did not expect); 2
for bad arguments or a bad config (`ConfigError`: the message names the field). A failure
is one line on stderr; a reader that closes the output early (`| head`) ends the command
quietly, with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtiers import __version__
from kvtiers._cli_args import non_negative_int, parse_age
from kvtiers._cli_args import positive_int as _positive_int
from kvtiers._cli_bench import add_bench_command
from kvtiers._cli_explain import add_explain_command
from kvtiers._cli_remote import add_remote_command
from kvtiers._cli_replay import add_replay_commands
from kvtiers.core.config import format_size, load_config
from kvtiers.core.errors import ConfigError, KVTiersError
from kvtiers.demo import ChatWorkload, default_demo_config, format_report, run_demo

__all__ = ["main"]

_WORKLOAD = ChatWorkload()  # the demo's defaults
_STORE_COMMANDS = frozenset({"inspect", "purge", "remote"})  # they read stores, not caches


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
        with _quiet_store_logs(args.command in _STORE_COMMANDS):
            status = run(args)
            sys.stdout.flush()  # a reader that left fails the flush here, not at exit
            return status
    except ConfigError as exc:
        print(f"kvtiers {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left early (`kvtiers ... | head`): nothing to say
        _silence_stdout()
        return 1
    except (KVTiersError, OSError) as exc:  # TierIOError is an OSError too
        print(f"kvtiers {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that its flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout has no descriptor (captured, closed)
        pass


@contextmanager
def _quiet_store_logs(quiet: bool) -> Iterator[None]:
    """Keep kvtiers' warnings off stderr while `quiet`.

    A remote store's retries warn as a running cache's would ("serving misses"); a command
    that gives up instead says so in its one line of error.
    """
    logger = logging.getLogger("kvtiers")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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
    demo.add_argument(
        "--seed", type=non_negative_int, default=0, metavar="S", help="workload seed (>= 0)"
    )
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.set_defaults(run=_run_demo)
    add_explain_command(commands)
    add_remote_command(commands)
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
        try:
            report = asyncio.run(run_demo(config, workload, progress=progress))
        except ConfigError as exc:  # a tier's own checks, run as the cache is built
            raise ConfigError(f"{exc} (in {args.config})") from exc
    else:
        with _demo_directory(args.dir) as directory:
            config = load_config(default_demo_config(directory))
            report = asyncio.run(run_demo(config, workload, progress=progress))
    print(format_report(report))
    return 0 if report.ok else 1


@contextmanager
def _demo_directory(path: str | None) -> Iterator[Path]:
    """Yield `path` (created if missing), or a temporary directory.

    Raises:
        ConfigError: `path` is a file, or cannot be created (a file on the way, no room,
            no permission).
    """
    if path is not None:
        directory = Path(path)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"--dir {path}: a file, not a directory") from None
        except OSError as exc:
            raise ConfigError(f"--dir {path}: cannot create it: {exc.strerror or exc}") from None
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="kvtiers-demo-") as tmp:
        yield Path(tmp)


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
    except RecursionError:  # arrays or objects nested thousands deep
        raise ConfigError("--storage-options: not JSON: nested too deep") from None
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
        type=parse_age,
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
