"""The `explain` subcommand of `kvtiers`: what a config's tiers need.

Prints the layout, then per tier its capacity in chunks, eviction, write policy, options
(URLs without credentials) and what it takes on this machine, then checks the tiers that
share host memory, GPU memory or a filesystem against what is available, with a WARNING
line for each shortfall. Builds the cache to validate the config but opens no tier.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtiers._host_copies import MIN_PARALLEL_BYTES, default_copy_threads
from kvtiers.cache import TieredCache
from kvtiers.core.config import CacheConfig, TierConfig, format_size, load_config
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from kvtiers.gpu.pinned import cuda_available
from kvtiers.tiers.base import Tier
from kvtiers.tiers.dram import MemoryTier
from kvtiers.tiers.registry import TierRegistry

__all__ = ["Machine", "add_explain_command", "read_machine"]

_CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2; "max" means no limit
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)

# NOTE: cgroup v1 writes "no limit" as a huge page-aligned number (0x7FFFFFFFFFFFF000).
_NO_LIMIT = 2**60


def add_explain_command(commands: Any) -> None:
    """Add the `explain` subcommand to `commands` (argparse subparsers)."""
    explain = commands.add_parser(
        "explain", help="show what a config's tiers hold and need, without opening them"
    )
    explain.add_argument("config", metavar="CONFIG", help="a .toml, .yaml or .yml file")
    explain.set_defaults(run=_run_explain)


@dataclass(frozen=True, slots=True)
class Machine:
    """What this machine offers the tiers."""

    ram_bytes: int
    cgroup_limit: int | None
    """The cgroup's memory limit; `None` when there is none."""

    @property
    def memory_bytes(self) -> int:
        """Return the host memory the tiers may use: RAM capped by the cgroup."""
        return min(self.ram_bytes, self.cgroup_limit or self.ram_bytes)


def read_machine() -> Machine:
    """Return the machine's RAM and the first cgroup memory limit found."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMIT_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        limit = None if text == "max" or int(text) >= _NO_LIMIT else int(text)
        return Machine(ram, limit)
    return Machine(ram, None)


def _run_explain(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    registry = TierRegistry()
    # NOTE: building the cache validates every tier's options, eviction and write policy
    # exactly as a real run does; tiers allocate and open nothing until the cache is opened.
    try:
        classes = [registry.resolve(tc.kind, where=tc.where) for tc in config.tiers]
        tiers: Sequence[Tier | None] = [None] * len(classes)
        if config.layout is not None:
            tiers = TieredCache(config, registry=registry).tiers
        else:
            TieredCache.check_tiers(config, registry=registry)  # as an engine's build will
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in {args.config})") from exc
    machine = read_machine()
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
        f"host copies   {_copy_threads(config.copy_threads)}",
    ]


def _copy_threads(threads: int) -> str:
    if threads == 1:
        return "on the calling thread alone"
    auto = " (copy_threads = 0: the usable cores, at most 4)" if not threads else ""
    size = f"{MIN_PARALLEL_BYTES // 2**20} MiB"
    return f"batches of {size} and more on {threads or default_copy_threads()} threads{auto}"


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
    """Return the lines a tier writes about itself with `explain_lines`."""
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
    # NOTE: not "nothing": a pool tier may lend this process's memory (mooncake's
    # segment_size), which its own lines say.
    return ["  takes       its capacity on its store, not on this machine (not checked)"]


def _existing_parent(path: Any) -> Path:
    """Return `path` or its nearest existing parent (where its files would go)."""
    current = Path(os.fspath(path)).expanduser().absolute()
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def _machine_lines(
    tiers: Sequence[TierConfig], classes: Sequence[type[Tier]], machine: Machine
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
