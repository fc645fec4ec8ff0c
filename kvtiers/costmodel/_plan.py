"""Prefill vs load: TTFT with and without a cache, break-even points, and the plan report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtiers.core.checks import MAX_DIM, describe, is_int
from kvtiers.core.config import format_size
from kvtiers.core.errors import ConfigError
from kvtiers.costmodel._links import TierLink, is_real
from kvtiers.costmodel._model import GPUS, ModelSpec

__all__ = [
    "DEFAULT_MFU",
    "Compute",
    "Plan",
    "TierPlan",
    "break_even_bandwidth",
    "break_even_tokens",
    "format_plan",
    "make_compute",
    "plan",
    "ttft_seconds",
]

#: Share of peak throughput that prefill reaches (model FLOPs utilisation), by default.
DEFAULT_MFU = 0.5
_PREFILL_LENGTHS = (1024, 8192, 32768, 131072)


@dataclass(frozen=True, slots=True)
class Compute:
    """The prefill throughput the cost model assumes."""

    flops_per_s: float
    """Achieved FLOP/s during prefill."""
    label: str
    """Where the figure comes from, for reports."""

    def __post_init__(self) -> None:
        # NOTE: at least 1 FLOP/s, so that every prefill time stays a finite float.
        if not is_real(self.flops_per_s) or not self.flops_per_s >= 1:
            raise ConfigError(
                f"compute: expected a finite FLOP/s >= 1, got {describe(self.flops_per_s, 40)} "
                f"({self.label})"
            )

    def prefill_seconds(self, model: ModelSpec, num_new: int, num_cached: int = 0) -> float:
        """Return the time to prefill `num_new` tokens after `num_cached` cached ones."""
        return model.prefill_flops(num_new, num_cached) / self.flops_per_s


def make_compute(
    model: ModelSpec,
    gpu: str = "H100",
    *,
    mfu: float = DEFAULT_MFU,
    tflops: float | None = None,
    measured: Sequence[tuple[int, float]] = (),
) -> Compute:
    """Return the prefill throughput from a preset, an override, or measurements.

    Args:
        model: the model (measurements are converted to FLOP/s through it).
        gpu: a preset name (`GPUS`), used unless `tflops` or `measured` is given.
        mfu: the share of peak reached, applied to the preset or `tflops`.
        tflops: peak TFLOP/s, overriding the preset's.
        measured: (prompt tokens, seconds) of measured prefills without cache; their mean
            FLOP/s wins over everything else.

    Raises:
        ConfigError: unknown GPU, or a value out of range.
    """
    if not is_real(mfu) or not 0 < mfu <= 1:
        raise ConfigError(f"mfu: expected a share in (0, 1], got {describe(mfu, 40)}")
    if measured:
        rates = [_measured_rate(model, point) for point in measured]
        rate = sum(r / len(rates) for r in rates)  # NOTE: a sum of the rates may overflow
        return Compute(rate, f"measured ({len(rates)} point(s)): {rate / 1e12:.0f} TFLOP/s")
    if tflops is not None:
        if not is_real(tflops) or not tflops > 0 or not is_real(tflops * 1e12 * mfu):
            raise ConfigError(f"tflops: expected a finite number > 0, got {describe(tflops, 40)}")
        if tflops * 1e12 * mfu < 1:
            raise ConfigError(f"tflops: {tflops:g} x {mfu:g} utilisation is below 1 FLOP/s")
        return Compute(tflops * 1e12 * mfu, f"{tflops:g} TFLOP/s x {mfu:.2f} utilisation")
    if not isinstance(gpu, str):
        raise ConfigError(f"gpu: expected one of {', '.join(GPUS)}, got {describe(gpu, 40)}")
    spec = GPUS.get(gpu.upper())
    if spec is None:
        raise ConfigError(f"gpu: {gpu!r} is not one of {', '.join(GPUS)}")
    return Compute(
        spec.peak_tflops * 1e12 * mfu,
        f"{spec.name}: {spec.peak_tflops:g} TFLOP/s dense bf16 x {mfu:.2f} utilisation",
    )


def _measured_rate(model: ModelSpec, point: object) -> float:
    """Return the FLOP/s of one measured prefill, a (tokens, seconds) pair.

    Raises:
        ConfigError: not a pair, tokens not in [1, `MAX_DIM`], seconds not finite and > 0,
            or a rate that is not finite or below 1 FLOP/s.
    """
    if not isinstance(point, tuple | list) or len(point) != 2:
        raise ConfigError(f"measured: expected (TOKENS, SECONDS) pairs, got {describe(point)}")
    tokens, seconds = point
    given = f"{describe(tokens, 40)}:{describe(seconds, 40)}"
    if not is_int(tokens) or not 1 <= tokens <= MAX_DIM:
        raise ConfigError(f"measured: TOKENS must be an integer in [1, {MAX_DIM}], got {given}")
    if not is_real(seconds) or not seconds > 0:
        raise ConfigError(f"measured: SECONDS must be a finite number > 0, got {given}")
    rate = model.prefill_flops(tokens) / seconds
    if not is_real(rate):
        raise ConfigError(f"measured: {given} is not a finite throughput (too few seconds)")
    if rate < 1:
        raise ConfigError(f"measured: {given} is below 1 FLOP/s (too many seconds)")
    return float(rate)


def ttft_seconds(
    model: ModelSpec, compute: Compute, num_tokens: int, loads: Sequence[tuple[TierLink, int]] = ()
) -> float:
    """Return the time to first token of a prompt, given the cached tokens each tier serves.

    Loading and compute are taken as serial (no layer-wise overlap) and queueing is left
    out: the figure is the prefill's own latency. At least one token is always computed.

    Args:
        model: the model.
        compute: the prefill throughput.
        num_tokens: prompt tokens.
        loads: (tier link, cached tokens it serves); their sum is capped at the prompt.
    """
    budget = max(num_tokens - 1, 0)
    load = 0.0
    cached = 0
    for link, tokens in loads:
        tokens = min(tokens, budget - cached)
        if tokens > 0:
            load += link.load_seconds(tokens * model.bytes_per_token)
            cached += tokens
    return load + compute.prefill_seconds(model, num_tokens - cached, cached)


def break_even_bandwidth(
    model: ModelSpec, compute: Compute, num_tokens: int, latency: float = 0.0
) -> float:
    """Return the bandwidth (B/s) at which loading a `num_tokens` prefix ties recomputing it.

    Recomputing a prefix costs `prefill_seconds(num_tokens)` whatever follows it, since
    prefill FLOPs add up along the prompt. Infinite when latency alone exceeds that.
    """
    recompute = compute.prefill_seconds(model, num_tokens)
    if recompute <= latency:
        return float("inf")
    return num_tokens * model.bytes_per_token / (recompute - latency)


def break_even_tokens(model: ModelSpec, compute: Compute, link: TierLink) -> int | None:
    """Return the shortest cached prefix that loads faster than it recomputes.

    The gain (recompute minus load) is convex in the prefix length and negative at zero,
    so it crosses zero once. `None` when it stays negative up to the model's context.
    """

    def pays(n: int) -> bool:
        load = link.load_seconds(n * model.bytes_per_token)
        return compute.prefill_seconds(model, n) > load

    if pays(1):
        return 1
    if not pays(model.max_context):
        return None
    lo, hi = 1, model.max_context  # pays(lo) is False, pays(hi) is True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pays(mid) else (mid, hi)
    return hi


@dataclass(frozen=True, slots=True)
class TierPlan:
    """What caching in one tier buys."""

    link: TierLink
    break_even_tokens: int | None
    """Shortest prefix worth loading from this tier; `None` if none up to the context."""
    break_even_bandwidth: float
    """Bandwidth at which a 1K-token prefix ties recompute, given this tier's latency."""
    saved_per_1k: float
    """Seconds of TTFT saved per 1,024 cached tokens at the head of a prompt."""
    saved_per_1k_deep: float
    """The same for 1,024 cached tokens that follow 31K others (attention costs more)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Whether pooling pays off for a model on an accelerator, per tier; no trace needed."""

    model: ModelSpec
    compute: Compute
    prefill: tuple[tuple[int, float], ...]
    """(prompt tokens, seconds) of prefill without cache, for a few lengths."""
    tiers: tuple[TierPlan, ...]


def plan(model: ModelSpec, compute: Compute, links: Sequence[TierLink]) -> Plan:
    """Return the break-even points and TTFT savings of `links` for `model`."""
    prefill = tuple(
        (n, compute.prefill_seconds(model, n)) for n in _PREFILL_LENGTHS if n <= model.max_context
    )
    kib = 1024
    tiers = []
    for link in links:
        load_1k = link.load_seconds(kib * model.bytes_per_token)
        tiers.append(
            TierPlan(
                link,
                break_even_tokens(model, compute, link),
                break_even_bandwidth(model, compute, kib, link.latency),
                compute.prefill_seconds(model, kib) - load_1k,
                compute.prefill_seconds(model, kib, 31 * kib) - load_1k,
            )
        )
    return Plan(model, compute, prefill, tuple(tiers))


def format_plan(p: Plan) -> str:
    """Return a plan as the text `kvtiers plan` prints."""
    m = p.model
    params = f"{m.num_params / 1e9:.2f}B params" + (" active" if m.total_params else "")
    lines = [
        f"model         {m.name}: {params}, {m.num_layers} layers, {m.num_heads} heads "
        f"({m.num_kv_heads} KV x {m.kv_head_size}), {m.kind}, {m.dtype}",
        f"KV per token  {format_size(m.bytes_per_token)} ({m.bytes_per_token:,} B)",
        f"compute       {p.compute.label} = {p.compute.flops_per_s / 1e12:.0f} TFLOP/s",
        "prefill       " + ", ".join(f"{_tokens(n)} {_secs(s)}" for n, s in p.prefill),
        "",
    ]
    header = ("tier", "bandwidth", "latency", "break-even prompt", "break-even BW @1K")
    rows = [header + ("saved / 1K cached (head)", "(after 31K)")]
    for t in p.tiers:
        rows.append(
            (
                t.link.name,
                _rate(t.link.bandwidth),
                _secs(t.link.latency),
                _prompt(t.break_even_tokens),
                _rate(t.break_even_bandwidth),
                _saved(t.saved_per_1k, p.compute.prefill_seconds(m, 1024)),
                _saved(t.saved_per_1k_deep, p.compute.prefill_seconds(m, 1024, 31 * 1024)),
            )
        )
    lines += _table(rows)
    lines += [
        "",
        "Loading pays when it beats recompute: a tier slower than the break-even bandwidth",
        "loses on short prompts; longer prompts favour loading (attention grows quadratically).",
    ]
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _prompt(n: int | None) -> str:
    if n is None:
        return "never"
    return "any length" if n == 1 else f"{n:,} tokens"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def _secs(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def _rate(bytes_per_s: float) -> str:
    if bytes_per_s == float("inf"):
        return "never"
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def _saved(saved: float, recompute: float) -> str:
    sign = "-" if saved < 0 else ""
    return f"{sign}{_secs(abs(saved))} ({saved / recompute:.0%})"
