"""The `replay` and `plan` subcommands of `kvtiers`.

`replay` answers "will pooling pay off on this workload": it replays a request trace through
the prefix index and eviction policies (index-only, no bytes stored; with `--full`, through a
real `TieredCache`, see `_cli_replay_full`) and reports hit rates, bytes read per tier, the
offline optimum and, given a model, TTFT and prefill throughput.
`plan` answers the same from the model, accelerator and tier bandwidths alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtiers._cli_args import positive_int
from kvtiers._cli_bench import read_tier_links
from kvtiers._replay_full import DEFAULT_BLOCK_BYTES
from kvtiers.core.checks import describe
from kvtiers.core.config import CacheConfig
from kvtiers.core.errors import ConfigError
from kvtiers.costmodel import (
    DEFAULT_MFU,
    GPUS,
    MODELS,
    Compute,
    ModelSpec,
    Plan,
    TierLink,
    default_link,
    format_plan,
    load_model,
    make_compute,
    parse_tier_link,
    plan,
)
from kvtiers.replay import (
    CostSetup,
    ReplayReport,
    TierSpec,
    Trace,
    TraceError,
    build_report,
    format_report,
    from_config,
    parse_capacity,
    parse_policies,
    read_trace,
    single_tier,
)
from kvtiers.replay.hints import HINTS, hints_for
from kvtiers.replay.plot import plot_path

__all__ = ["add_replay_commands", "write_plot"]

_DEFAULT_CAPACITIES = "5%,10%"
_PLAN_TIERS = ("dram", "nvme", "s3")


def add_replay_commands(commands: Any) -> None:
    """Add the `replay` and `plan` subcommands to `kvtiers`' subparsers."""
    _add_replay_parser(commands)
    plan_parser = commands.add_parser(
        "plan",
        help="break-even bandwidth and prompt length per tier for a model; no trace needed",
    )
    _add_cost_arguments(plan_parser, model_required=True)
    plan_parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    plan_parser.set_defaults(run=_run_plan)


def _add_replay_parser(commands: Any) -> None:
    replay = commands.add_parser(
        "replay",
        help="replay a request trace: hit rates per policy and capacity, optimum, TTFT",
        description="Replay a Mooncake or token trace through the prefix index and eviction "
        "policies (index-only: blocks are counted, not stored; --full stores them in a real "
        "TieredCache).",
    )
    _add_trace_arguments(replay)
    _add_mode_arguments(replay)
    _add_cost_arguments(replay, model_required=False)
    _add_output_arguments(replay)
    replay.set_defaults(run=_run_replay)


def _add_trace_arguments(replay: argparse.ArgumentParser) -> None:
    """Add the trace, its tiers config, policies, capacities and block size to `replay`."""
    replay.add_argument("trace", metavar="TRACE", help="a JSON-lines trace file")
    replay.add_argument("--config", help="a tiers config (.toml/.yaml); default: one DRAM tier")
    replay.add_argument(
        "--policy",
        help="comma list of policies, or 'all' (default: all; with --config, its own)",
    )
    replay.add_argument(
        "--capacity",
        help="comma list of blocks (9140), shares of the unique blocks (5%%) or sizes "
        "(16GiB); with --config, the top tier's (default: "
        + _DEFAULT_CAPACITIES.replace("%", "%%")  # argparse formats help with %
        + ", or the config's)",
    )
    replay.add_argument(
        "--block-tokens",
        type=positive_int,
        metavar="N",
        help="tokens per block (default: 512 for Mooncake traces; for token traces the "
        "config's chunk size, else 256)",
    )
    replay.add_argument("--limit", type=positive_int, metavar="N", help="replay N requests only")


def _add_mode_arguments(replay: argparse.ArgumentParser) -> None:
    """Add the reuse hints and the full mode (real bytes through a TieredCache) to `replay`."""
    replay.add_argument(
        "--hints",
        choices=HINTS,
        help="also replay each run with reuse hints taken from the trace's future: 'turns' "
        "keeps a prompt that a later request continues, 'future' the blocks a later request "
        "shares; the others are stored cold (TieredCache.store's keep_tokens; with --full, "
        "put_chunks' keep_chunks)",
    )
    replay.add_argument(
        "--full",
        action="store_true",
        help="store and load real bytes through a TieredCache, one fresh cache per run "
        "(small blocks; lmdb and remote tiers in a temporary directory)",
    )
    replay.add_argument(
        "--block-bytes",
        metavar="SIZE",
        help=f"with --full: bytes of a stored block (default: {DEFAULT_BLOCK_BYTES}), or "
        "'layout' for blocks of the config's [layout]",
    )


def _add_output_arguments(replay: argparse.ArgumentParser) -> None:
    """Add the output options (JSON, a figure, the progress bar) to `replay`."""
    replay.add_argument("--json", action="store_true", help="print one JSON object instead")
    replay.add_argument("--plot", metavar="OUT", help="write a figure (PNG, SVG, PDF)")
    replay.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _add_cost_arguments(parser: argparse.ArgumentParser, *, model_required: bool) -> None:
    parser.add_argument(
        "--model",
        required=model_required,
        help=f"a preset ({', '.join(MODELS)}) or a model file (.toml/.json, or a "
        "Hugging Face config.json)" + ("" if model_required else "; enables TTFT"),
    )
    parser.add_argument(
        "--gpu", default="H100", help=f"accelerator preset: {', '.join(GPUS)} (default: H100)"
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help=f"share of peak throughput prefill reaches (default: {DEFAULT_MFU})",
    )
    parser.add_argument("--tflops", type=float, help="peak TFLOP/s, overriding the preset's")
    parser.add_argument(
        "--measured",
        action="append",
        default=[],
        metavar="TOKENS:SECONDS",
        help="a measured prefill without cache (repeatable); overrides --gpu/--tflops",
    )
    parser.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="NAME[:BW[:LATENCY]]",
        help="a tier's bandwidth and latency, e.g. nvme:5GB/s:100us (repeatable)",
    )
    parser.add_argument(
        "--tiers-from",
        metavar="FILE",
        help="tier bandwidths and latencies measured by `kvtiers bench CONFIG --out FILE`; "
        "--tier flags override them",
    )


# -- replay ----------------------------------------------------------------------------


def _run_replay(args: argparse.Namespace) -> int:
    # NOTE: the plot's file is checked first, not after a replay of many minutes.
    plot = plot_path(args.plot) if args.plot is not None else None
    config = _replay_config(args.config) if args.config else None
    model = load_model(args.model) if args.model else None
    if model is None:
        _refuse_cost_flags(args)
    layout_chunk = config.layout.chunk_size if config and config.layout else None
    try:
        trace = read_trace(
            args.trace,
            block_tokens=args.block_tokens,
            token_block_tokens=layout_chunk,
            limit=args.limit,
        )
    except TraceError as exc:
        print(f"kvtiers replay: {exc}", file=sys.stderr)
        return 2
    block_bytes = _block_bytes(trace, config, model)
    cascades = _cascades(args, trace, config, block_bytes)
    costs = _costs(args, model, cascades[0]) if model is not None else None
    if args.full or args.block_bytes is not None:
        # NOTE: imported here: that module imports this one.
        from kvtiers._cli_replay_full import run_full

        return run_full(args, trace, config, cascades, costs, block_bytes, plot=plot)
    capacities = {sum(t.capacity_blocks for t in tiers) for tiers in cascades}
    hints = hints_for(trace, args.hints) if args.hints is not None else None
    runs = len(cascades) * (1 if hints is None else 2)
    total = trace.num_requests * (runs + len(capacities))
    with _progress(total, enabled=not args.no_progress and sys.stderr.isatty()) as tick:
        report = build_report(
            trace, cascades, block_bytes=block_bytes, costs=costs, progress=tick, hints=hints
        )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    if plot is not None:
        write_plot(report, plot)
    return 0


def _replay_config(path: str) -> CacheConfig:
    """Load the config at `path` and check its tiers as a cache built from it would.

    The index-only mode builds no tier, so without this a misspelt option or kind would
    be replayed as if it were valid.
    """
    # NOTE: imported here: the cache imports torch, which the index-only mode never needs.
    from kvtiers.cache import TieredCache

    return TieredCache.check_tiers(path)


def _refuse_cost_flags(args: argparse.Namespace) -> None:
    """Refuse cost-model flags given without `--model`, which alone uses them."""
    given = {
        "--tier": bool(args.tier),
        "--tiers-from": args.tiers_from is not None,
        "--tflops": args.tflops is not None,
        "--measured": bool(args.measured),
    }
    for flag, present in given.items():
        if present:
            raise ConfigError(f"{flag}: only with --model (TTFT needs a model's prefill cost)")


def write_plot(report: ReplayReport, path: Path) -> None:
    """Write the report's figure to `path` (from `plot_path`) and say so on stderr."""
    from kvtiers.replay.plot import plot_report

    plot_report(report, path)
    print(f"kvtiers replay: wrote {path}", file=sys.stderr)


def _block_bytes(trace: Trace, config: CacheConfig | None, model: ModelSpec | None) -> int | None:
    """Return bytes per trace block from the config's layout, else the model's, else None."""
    if config is not None and config.layout is not None:
        return config.layout.bytes_per_token * trace.block_tokens
    if model is not None:
        return model.bytes_per_token * trace.block_tokens
    return None


def _cascades(
    args: argparse.Namespace, trace: Trace, config: CacheConfig | None, block_bytes: int | None
) -> list[list[TierSpec]]:
    """Return the tier cascades to replay: capacities outer, policies inner."""
    text = args.capacity
    if text is None and config is None:
        text = _DEFAULT_CAPACITIES
    capacities: list[int | None] = [None]
    if text is not None:
        parts = [part for part in text.split(",") if part.strip()]
        if not parts:  # no runs to replay: refused rather than read as the default
            raise ConfigError(
                "--capacity: expected a comma list of blocks (9140), shares (5%) or sizes "
                f"(16GiB), got {describe(text)}"
            )
        parsed = (
            parse_capacity(part, unique_blocks=trace.unique_blocks, block_bytes=block_bytes)
            for part in parts
        )
        capacities = list(dict.fromkeys(parsed))
    if config is None:
        policies = parse_policies(args.policy or "all")
        return [single_tier(c, p) for c in capacities if c is not None for p in policies]
    if block_bytes is None:
        raise ConfigError(
            f"{args.config}: tier capacities are bytes; give the config a [layout] or pass "
            "--model to size blocks"
        )
    # NOTE: without --policy, the config's own policies (one run per capacity).
    overrides: list[str | None] = list(parse_policies(args.policy)) if args.policy else [None]
    try:
        return [
            from_config(config, block_bytes=block_bytes, policy=p, top_capacity=c)
            for c in capacities
            for p in overrides
        ]
    except ConfigError as exc:  # a tier's capacity, in blocks of the layout
        raise ConfigError(f"{exc} (in {args.config})") from exc


def _costs(args: argparse.Namespace, model: ModelSpec, tiers: list[TierSpec]) -> CostSetup:
    flags = {link.name: link for link in map(parse_tier_link, args.tier)}
    names = [t.name for t in tiers]
    for name in flags:
        if name not in names:
            raise ConfigError(f"--tier {name}: no such tier; the replay has {', '.join(names)}")
    overrides = _measured_links(args.tiers_from, names) if args.tiers_from else {}
    overrides.update(flags)
    links = tuple(overrides.get(t.name) or default_link(t.name, t.kind) for t in tiers)
    return CostSetup(model, _compute(args, model), links)


def _measured_links(path: str, names: list[str]) -> dict[str, TierLink]:
    """Return the links a bench file measured for the replay's tiers (by name)."""
    links = read_tier_links(path)
    found = {link.name: link for link in links if link.name in names}
    if not found:
        raise ConfigError(
            f"--tiers-from {path}: none of its tiers ({', '.join(x.name for x in links)}) is a "
            f"tier of the replay ({', '.join(names)})"
        )
    return found


def _compute(args: argparse.Namespace, model: ModelSpec) -> Compute:
    measured = []
    for text in args.measured:
        tokens, _, seconds = text.partition(":")
        try:
            measured.append((int(tokens), float(seconds)))
        except ValueError as exc:
            raise ConfigError(f"--measured: expected TOKENS:SECONDS, got {text!r}") from exc
    return make_compute(model, args.gpu, mfu=args.mfu, tflops=args.tflops, measured=measured)


@contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """Yield a callback that advances a progress bar on stderr, or `None` when disabled."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="req", desc="replay", file=sys.stderr, leave=False) as bar:
        yield bar.update


# -- plan ------------------------------------------------------------------------------


def _run_plan(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    compute = _compute(args, model)
    links = {x.name: x for x in read_tier_links(args.tiers_from)} if args.tiers_from else {}
    links.update((x.name, x) for x in map(parse_tier_link, args.tier))
    defaults = [default_link(name, name) for name in _PLAN_TIERS]
    result = plan(model, compute, list(links.values()) or defaults)
    if args.json:
        print(json.dumps(_plan_dict(result), indent=2))
    else:
        print(format_plan(result))
    return 0


def _plan_dict(result: Plan) -> dict[str, Any]:
    out: dict[str, Any] = asdict(result)
    out["model"]["bytes_per_token"] = result.model.bytes_per_token
    out["compute"]["label"] = result.compute.label
    out["prefill"] = [{"tokens": n, "seconds": s} for n, s in result.prefill]
    for tier in out["tiers"]:
        if tier["break_even_bandwidth"] == float("inf"):
            tier["break_even_bandwidth"] = None  # JSON has no infinity: never breaks even
    return out
