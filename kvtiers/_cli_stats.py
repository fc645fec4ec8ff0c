"""`kvtiers stats URL`: what a running cache is doing, read from its metrics endpoint.

Reads the Prometheus text a cache serves (`[metrics]` in its config) and prints the hit
rate, why requests missed, and one line per tier; `--json` prints the same as JSON. Parses
the text format itself, so it needs no `prometheus-client`.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

from kvtiers.core.config import format_size
from kvtiers.core.errors import TierIOError

__all__ = ["fetch_stats", "format_stats", "to_json"]

_LINE = re.compile(r"^(kvtiers_\w+?)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_TIER_COLUMNS = ("hits", "misses", "puts", "evictions", "promotions", "errors", "corrupt")


def fetch_stats(url: str, *, timeout: float = 10.0) -> dict[str, Any]:
    """Return the cache stats a metrics endpoint serves, grouped per cache and tier.

    Raises:
        TierIOError: the endpoint cannot be reached or serves no kvtiers metrics.
    """
    if "://" not in url:
        url = f"http://{url}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TierIOError(f"cannot read {url}: {exc}") from exc
    caches: dict[tuple[str, str], dict[str, Any]] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        name, raw_labels, raw_value = match.groups()
        labels = dict(_LABEL.findall(raw_labels or ""))
        key = (labels.pop("model", ""), labels.pop("tp_rank", ""))
        cache = caches.setdefault(
            key, {"model": key[0], "tp_rank": key[1], "misses": {}, "tiers": defaultdict(dict)}
        )
        name = name.removeprefix("kvtiers_").removesuffix("_total")
        value = float(raw_value)
        if "tier" in labels:
            tier = cache["tiers"][labels["tier"]]
            tier["kind"] = labels.get("kind", "")
            tier[name.removeprefix("tier_")] = value
        elif name == "misses":
            cache["misses"][labels.get("reason", "")] = value
        else:
            cache[name] = value
    if not caches:
        raise TierIOError(f"{url} serves no kvtiers metrics")
    out = list(caches.values())
    for cache in out:
        cache["tiers"] = dict(cache["tiers"])
    return {"url": url, "caches": out}


def format_stats(stats: dict[str, Any]) -> list[str]:
    """Return `fetch_stats`'s result as lines of text."""
    lines = []
    for cache in stats["caches"]:
        asked = cache.get("lookup_tokens", 0.0)
        hit = cache.get("hit_tokens", 0.0)
        rate = f"{hit / asked:.1%}" if asked else "-"
        lines.append(f"{cache['model']} (tp_rank {cache['tp_rank']}) at {stats['url']}")
        lines.append(
            f"  lookups {cache.get('lookups', 0):,.0f}, hit rate {rate} "
            f"({hit:,.0f} of {asked:,.0f} tokens)"
        )
        seconds = cache.get("load_seconds", 0.0)
        loaded = cache.get("loaded_bytes", 0.0)
        speed = f", {format_size(int(loaded / seconds))}/s" if seconds else ""
        lines.append(
            f"  loads {cache.get('loads', 0):,.0f} ({format_size(int(loaded))}{speed}), "
            f"stores {cache.get('stores', 0):,.0f}, write queue "
            f"{cache.get('write_queue_chunks', 0):,.0f} chunks"
        )
        misses = cache["misses"]
        reasons = ", ".join(f"{r} {n:,.0f}" for r, n in sorted(misses.items(), key=lambda x: -x[1]))
        lines.append(f"  misses: {reasons or 'none'}")
        lines.append("  " + _row(("tier", "kind", "entries", "used", *_TIER_COLUMNS)))
        for name, tier in cache["tiers"].items():
            used = f"{format_size(int(tier.get('used_bytes', 0)))}/" + format_size(
                int(tier.get("capacity_bytes", 0))
            )
            counts = [f"{tier.get(c, 0):,.0f}" for c in _TIER_COLUMNS]
            row = (name, tier.get("kind", ""), f"{tier.get('num_entries', 0):,.0f}", used)
            lines.append("  " + _row((*row, *counts)))
    return lines


def _row(cells: tuple[str, ...]) -> str:
    widths = (10, 8, 9, 20) + (11,) * len(_TIER_COLUMNS)
    return " ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()


def to_json(stats: dict[str, Any]) -> str:
    """Return `fetch_stats`'s result as JSON text."""
    return json.dumps(stats, indent=2, sort_keys=True)
