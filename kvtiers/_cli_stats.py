"""`kvtiers stats URL`: what a running cache does, from its metrics.

Reads the Prometheus text a cache serves (`[metrics]` in its config) and prints the hit
rate, why requests missed, latency quantiles (upper bounds of the histogram buckets), one
line per tier, and the circuit breaker of tiers on a remote store; `--json` prints the same
as JSON. Parses the text format itself, so it needs no `prometheus-client`.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from typing import Any

from kvtiers.core.config import format_size
from kvtiers.core.errors import ConfigError, TierIOError

__all__ = ["fetch_stats", "format_stats", "quantile", "to_json"]

# A sample: name, labels, value and an optional timestamp (which the text format allows).
_LINE = re.compile(r"^(kvtiers_\w+?)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")
_ESCAPED = {"n": "\n"}  # a label value's escapes: \\, \" and \n
# Keys of the result that hold its grouping, not a sample's value.
_CACHE_KEYS = frozenset({"model", "tp_rank", "tiers", "evicted_from", "latency"})
_TIER_KEYS = frozenset({"kind", "latency", "breaker"})
_MAX_BYTES = 16 << 20  # read no more of a response than this
_TIER_COLUMNS = ("hits", "misses", "puts", "evictions", "promotions", "errors", "corrupt")


def fetch_stats(url: str, *, timeout: float = 10.0) -> dict[str, Any]:
    """Return a metrics endpoint's cache stats, grouped per cache and tier.

    Raises:
        ConfigError: `url` is not an http(s) address with a numeric port.
        TierIOError: the endpoint cannot be reached or serves no kvtiers metrics.
    """
    url = _metrics_url(url)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read(_MAX_BYTES + 1)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        raise TierIOError(f"cannot read {url}: {_printable(str(exc))}") from exc
    if len(body) > _MAX_BYTES:  # a cache serves kilobytes; this is something else
        raise TierIOError(f"{url} serves more than {format_size(_MAX_BYTES)}: no cache's metrics")
    text = body.decode("utf-8", "replace")
    caches: dict[tuple[str, str], dict[str, Any]] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        try:
            _add_sample(caches, *match.groups())
        except ValueError:  # a value or bucket bound that is no number (NaN, +Inf are)
            raise TierIOError(f"{url}: malformed sample {line!r:.100}") from None
    if not caches:
        raise TierIOError(f"{url} serves no kvtiers metrics")
    out = list(caches.values())
    for cache in out:
        cache["tiers"] = dict(cache["tiers"])
    return {"url": url, "caches": out}


def _printable(text: str) -> str:
    """Return `text` with control characters escaped, so that an error stays one line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _metrics_url(url: str) -> str:
    """Return the full metrics URL of `HOST:PORT` or a URL, checking its scheme and port.

    Raises:
        ConfigError: not http(s), no host, or a port that is not a number in range.
    """
    given = url
    if "://" not in url:
        url = f"http://{url}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (reading the port parses it)
    except ValueError as exc:  # a port out of range or not a number, a bad IPv6 host
        raise ConfigError(f"URL {given!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"URL {given!r}: expected HOST:PORT or an http(s):// URL")
    return url


def _add_sample(
    caches: dict[tuple[str, str], dict[str, Any]],
    name: str,
    raw_labels: str | None,
    raw_value: str,
) -> None:
    """Record one sample in the stats of the cache its labels name.

    Side effects: adds the cache, keyed by (model, tp_rank), and its tier if missing.
    """
    labels = {
        name: _ESCAPE.sub(lambda m: _ESCAPED.get(m[1], m[1]), value)
        for name, value in _LABEL.findall(raw_labels or "")
    }
    key = (labels.pop("model", ""), labels.pop("tp_rank", ""))
    cache = caches.setdefault(
        key, {"model": key[0], "tp_rank": key[1], "misses": {}, "tiers": defaultdict(dict)}
    )
    name = name.removeprefix("kvtiers_").removesuffix("_total")
    value = float(raw_value)
    where = cache
    if name == "misses_evicted":
        cache.setdefault("evicted_from", {})[labels.get("tier", "")] = value
        return
    if "tier" in labels:
        where = cache["tiers"][labels["tier"]]
        where["kind"] = labels.get("kind", "")
        name = name.removeprefix("tier_")
    if name.startswith("op_seconds_") and "op" in labels:
        _add_latency(where, labels, name.removeprefix("op_seconds_"), value)
    elif name == "breaker_state":
        if value == 1.0:
            where["breaker"] = labels.get("state", "")
    elif name in (_CACHE_KEYS if where is cache else _TIER_KEYS):
        return  # no metric has that name; one that did would overwrite the grouping
    elif where is not cache:
        where[name] = value
    elif name == "misses":
        cache["misses"][labels.get("reason", "")] = value
    else:
        cache[name] = value


def _add_latency(where: dict[str, Any], labels: dict[str, str], part: str, value: float) -> None:
    op = where.setdefault("latency", {}).setdefault(labels["op"], {"buckets": {}})
    if part == "bucket":
        le = labels.get("le", "+Inf")
        float(le)  # a bound that is no number raises ValueError, as a bad value does
        op["buckets"][le] = value
    elif part in ("count", "sum"):
        op[part] = value


def quantile(latency: dict[str, Any], q: float) -> float | None:
    """Return the upper bucket bound (seconds) of quantile `q` of one op.

    `None` when nothing was recorded (or the count is not a finite positive number); `inf`
    past the last bound.
    """
    buckets = sorted((float(le), n) for le, n in latency.get("buckets", {}).items())
    total = buckets[-1][1] if buckets else 0.0
    if not (total > 0 and math.isfinite(total)):  # NaN, infinite or negative counts rank nothing
        return None
    return next(le for le, n in buckets if n >= q * total)


def _latency_line(latency: dict[str, Any]) -> str:
    cells = []
    for op, hist in sorted(latency.items()):
        p50, p99 = quantile(hist, 0.5), quantile(hist, 0.99)
        if p50 is not None and p99 is not None:
            cells.append(f"{op} {_ms(p50)}/{_ms(p99)}")
    return ", ".join(cells)


def _ms(seconds: float) -> str:
    return "inf" if seconds == float("inf") else f"{seconds * 1e3:g} ms"


def format_stats(stats: dict[str, Any]) -> list[str]:
    """Return `fetch_stats`'s result as lines of text."""
    lines = []
    for cache in stats["caches"]:
        lines += _cache_lines(cache, stats["url"])
        lines.append("  " + _row(("tier", "kind", "entries", "used", *_TIER_COLUMNS)))
        for name, tier in cache["tiers"].items():
            used = f"{_size(tier.get('used_bytes', 0))}/{_size(tier.get('capacity_bytes', 0))}"
            counts = [f"{tier.get(c, 0):,.0f}" for c in _TIER_COLUMNS]
            row = (name, tier.get("kind", ""), f"{tier.get('num_entries', 0):,.0f}", used)
            lines.append("  " + _row((*row, *counts)))
        for name, tier in cache["tiers"].items():
            extra = _tier_extras(tier)
            if extra:
                lines.append(f"  {name}: " + "; ".join(extra))
    return lines


def _cache_lines(cache: dict[str, Any], url: str) -> list[str]:
    """Return a cache's heading, lookups, loads, misses and latency lines."""
    asked = cache.get("lookup_tokens", 0.0)
    hit = cache.get("hit_tokens", 0.0)
    rate = f"{hit / asked:.1%}" if asked else "-"
    seconds = cache.get("load_seconds", 0.0)
    loaded = cache.get("loaded_bytes", 0.0)
    speed = f", {_size(loaded / seconds)}/s" if seconds else ""
    misses = cache["misses"]
    reasons = ", ".join(f"{r} {n:,.0f}" for r, n in sorted(misses.items(), key=lambda x: -x[1]))
    evicted_from = cache.get("evicted_from", {})
    if evicted_from:
        reasons += (
            " (evicted last from: "
            + ", ".join(f"{t} {n:,.0f}" for t, n in sorted(evicted_from.items()))
            + ")"
        )
    lines = [
        f"{_printable(cache['model'])} (tp_rank {_printable(cache['tp_rank'])}) at {url}",
        f"  lookups {cache.get('lookups', 0):,.0f}, hit rate {rate} "
        f"({hit:,.0f} of {asked:,.0f} tokens)",
        f"  loads {cache.get('loads', 0):,.0f} ({_size(loaded)}{speed}), "
        f"stores {cache.get('stores', 0):,.0f}, write queue "
        f"{cache.get('write_queue_chunks', 0):,.0f} chunks",
        f"  misses: {reasons or 'none'}",
    ]
    latency = _latency_line(cache.get("latency", {}))
    if latency:
        lines.append(f"  latency p50/p99 (bucket bounds): {latency}")
    return lines


def _tier_extras(tier: dict[str, Any]) -> list[str]:
    """Return a tier's circuit breaker, reuse-hint and latency cells, if it has them."""
    extra = []
    if "breaker" in tier:
        io = ", ".join(
            f"{field} {tier.get('io_' + field, 0):,.0f}"
            for field in ("requests", "failures", "timeouts", "refused", "dropped_writes")
        )
        extra.append(f"breaker {tier['breaker']} ({io})")
    cold = tier.get("cold_puts", 0)
    if cold:
        wrong = tier.get("cold_hits", 0)
        extra.append(f"stored cold {cold:,.0f}, hit while cold {wrong:,.0f} ({wrong / cold:.1%})")
    latency = _latency_line(tier.get("latency", {}))
    if latency:
        extra.append(f"p50/p99 {latency}")
    return extra


def _size(num_bytes: float) -> str:
    """Return a byte count in binary units; "?" for a NaN or infinite one."""
    return format_size(int(num_bytes)) if math.isfinite(num_bytes) else "?"


def _row(cells: tuple[str, ...]) -> str:
    widths = (10, 8, 9, 20) + (11,) * len(_TIER_COLUMNS)
    return " ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()


def to_json(stats: dict[str, Any]) -> str:
    """Return `fetch_stats`'s result as JSON text; a NaN or infinite value becomes null."""
    return json.dumps(_finite(stats), indent=2, sort_keys=True, allow_nan=False)


def _finite(value: Any) -> Any:
    """Return `value` with every float that is not finite replaced by `None`, at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
