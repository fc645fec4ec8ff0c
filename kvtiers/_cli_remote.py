"""The `remote ls` and `remote purge` subcommands of `kvtiers`.

`remote ls` lists the pool of a config's remote tiers: objects, bytes and last access per
layout namespace (with `--keys`, every object of the config's layout). `remote purge`
deletes the config layout's objects, all of them or those idle for `--older-than AGE`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
from collections.abc import Sequence
from typing import Any

from kvtiers._cli_args import parse_age
from kvtiers.core.config import CacheConfig, TierConfig, format_size, load_config
from kvtiers.core.errors import ConfigError

__all__ = ["add_remote_command"]


def add_remote_command(commands: Any) -> None:
    """Add `remote ls` and `remote purge` to `commands` (argparse subparsers)."""
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
        type=parse_age,
        metavar="AGE",
        help="objects not read or written for AGE (e.g. 3600, 90m, 12h, 7d)",
    )
    purge.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    purge.set_defaults(run=_run_remote_purge)


def _remote_tiers(config: CacheConfig, name: str | None, path: str) -> list[TierConfig]:
    remote = [tc for tc in config.tiers if tc.kind == "remote"]
    tiers = [tc for tc in remote if name in (None, tc.name)]
    if tiers:
        return tiers
    named = next((tc for tc in config.tiers if tc.name == name), None)
    if named is not None:
        raise ConfigError(
            f"--tier {name}: {named.where} is a {named.kind!r} tier, not a remote one (in {path})"
        )
    if name is None:
        raise ConfigError(f"tiers: no tier of kind 'remote' in the config (in {path})")
    names = ", ".join(tc.name for tc in remote) or "none"
    raise ConfigError(
        f"tiers: no tier named {name!r} in the config; remote tiers: {names} (in {path})"
    )


def _run_remote_ls(args: argparse.Namespace) -> int:
    from kvtiers.tiers._remote_admin import list_pool

    config = load_config(args.config)
    for tc in _remote_tiers(config, args.tier, args.config):
        namespaces = asyncio.run(list_pool(tc, config.layout))
        print("\n".join(_pool_lines(tc, namespaces, keys=args.keys)))
    return 0


def _pool_lines(tc: TierConfig, namespaces: Sequence[Any], *, keys: bool) -> list[str]:
    from kvtiers.tiers import _layout_record as layout_record
    from kvtiers.tiers._remote_admin import is_fingerprint
    from kvtiers.tiers._remote_options import display_url

    lines = [f"{tc.where}      {tc.name} (kind remote) at {display_url(tc.options['url'])}"]
    if not namespaces:
        lines.append("  empty")
    for ns in namespaces:
        objects, listing = ns.objects, ns.listing
        used = sum(o.size for o in objects)
        what = "this layout" if ns.current else "layout" if is_fingerprint(ns.fingerprint) else "?"
        if ns.layout is not None and not ns.current:  # the config names the current one
            what += f" ({layout_record.describe(ns.layout)})"
        line = f"  {ns.fingerprint}  {what}: {len(objects):,} objects, {format_size(used)}"
        if ns.current:
            line += f" of {format_size(tc.capacity_bytes)}"
        if objects:
            times = [o.last_access for o in objects]
            line += f"; last access {_when(min(times))} .. {_when(max(times))}"
        num_cold = sum(o.cold for o in objects)
        extras = [
            f"{num_cold:,} cold (stored with no reuse expected)" if num_cold else "",
            f"{len(listing.access_logs)} access logs" if listing.access_logs else "",
            f"{len(listing.temps)} temporaries" if listing.temps else "",
            f"{len(listing.others)} other files" if listing.others else "",
        ]
        lines.append(line + "".join(f"; {e}" for e in extras if e))
        if keys and ns.current:
            lines += [
                f"    {o.key.hex()}  {o.size:>12,}  {_when(o.last_access)}{'  cold' * o.cold}"
                for o in objects
            ]
    return lines


def _when(timestamp: float) -> str:
    when = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return when.strftime("%Y-%m-%d %H:%M:%SZ")


def _run_remote_purge(args: argparse.Namespace) -> int:
    from kvtiers.tiers._remote_admin import purge_namespace

    config = load_config(args.config)
    if config.layout is None:
        raise ConfigError(
            f"layout: required to purge: the layout names the namespace (in {args.config})"
        )
    for tc in _remote_tiers(config, args.tier, args.config):
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
