"""Prometheus metrics of a `TieredCache`, served over HTTP (`[metrics] port = 9400`).

Nothing is counted twice: the collector reads `TieredCache.stats()` when Prometheus scrapes
(on the cache's event loop, so the snapshot is consistent), so metrics cost the hot path
nothing. Every counter of `CacheStats` and of each tier's `TierStats` becomes a metric;
see docs/operations.md for the list and what each means.

`prometheus-client` is an optional dependency (`pip install kvtiers[metrics]`): without it
a config that asks for metrics logs one warning and the cache runs without an endpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Coroutine, Hashable, Iterator
from types import TracebackType
from typing import Any, NamedTuple, Self

from kvtiers._metrics_http import MetricsHTTPServer, serve
from kvtiers.core.config import MetricsConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.stats import CacheStats, LatencySnapshot, TierStats

__all__ = ["MetricsServer", "metric_families"]

logger = logging.getLogger("kvtiers.metrics")

# CacheStats counters exported as `kvtiers_<name>_total`, with their help text.
_CACHE_COUNTERS = {
    "lookups": "Lookups (lookup and lookup_keys calls).",
    "lookup_tokens": "Tokens asked about by lookups.",
    "hit_tokens": "Tokens of the cached prefixes lookups found.",
    "loads": "Loads (load, load_paged, get_chunks calls).",
    "loaded_tokens": "Tokens delivered by loads.",
    "loaded_bytes": "Bytes delivered by loads.",
    "load_seconds": "Seconds spent in loads.",
    "stores": "Stores (store, store_paged, put_chunks calls).",
    "stored_tokens": "Tokens newly stored (chunks no tier held before).",
    "events_dropped": "KV events dropped because the event queue was full.",
}
# TierStats fields that are not plain counters (exported in their own forms).
_TIER_SKIP = {"name", "kind", "usage", "latency", "breaker", "io"}
_BREAKER_STATES = ("closed", "open", "half_open")
_SCRAPE_TIMEOUT_S = 5.0


def metric_families(stats: CacheStats, labels: dict[str, str]) -> Iterator[Any]:
    """Yield the Prometheus metric families of one stats snapshot.

    Args:
        stats: the snapshot (`TieredCache.stats()`).
        labels: constant labels of this cache (the model, the TP rank).
    """
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    names, values = list(labels), list(labels.values())
    for field, text in _CACHE_COUNTERS.items():
        family = CounterMetricFamily(f"kvtiers_{field}", text, labels=names)
        family.add_metric(values, float(getattr(stats, field)))
        yield family
    misses = CounterMetricFamily(
        "kvtiers_misses",
        "Lookups and short loads, by why the first chunk not served was not.",
        labels=[*names, "reason"],
    )
    for reason, count in sorted(stats.miss_reasons.items()):
        misses.add_metric([*values, reason], float(count))
    yield misses
    evicted = CounterMetricFamily(
        "kvtiers_misses_evicted",
        'Of the "evicted" misses, by the tier that dropped the chunk last.',
        labels=[*names, "tier"],
    )
    for tier, count in sorted(stats.evicted_from.items()):
        evicted.add_metric([*values, tier], float(count))
    yield evicted
    queue = GaugeMetricFamily(
        "kvtiers_write_queue_chunks", "Chunks waiting for write-through tiers.", labels=names
    )
    queue.add_metric(values, float(stats.write_queue_chunks))
    yield queue
    ops = HistogramMetricFamily(
        "kvtiers_op_seconds", "Duration of the cache's calls, by operation.", labels=[*names, "op"]
    )
    for op, hist in sorted(stats.latency.items()):
        ops.add_metric([*values, op], _buckets(hist), hist.total_seconds)
    yield ops
    yield from _tier_families(stats.tiers, names, values)
    yield from _store_families(stats.tiers, names, values)


def _buckets(hist: LatencySnapshot) -> list[tuple[str, float]]:
    """Return the cumulative buckets of `hist` in Prometheus' form, +Inf last."""
    out, seen = [], 0
    for bound, num in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
        seen += num
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(seen)))
    return out


def _tier_families(tiers: tuple[TierStats, ...], names: list[str], values: list[str]) -> Any:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    tier_names = [*names, "tier", "kind"]
    fields = [f.name for f in dataclasses.fields(TierStats) if f.name not in _TIER_SKIP]
    for field in fields:
        family = CounterMetricFamily(
            f"kvtiers_tier_{field}", f"Per tier: {field.replace('_', ' ')}.", labels=tier_names
        )
        for tier in tiers:
            family.add_metric([*values, tier.name, tier.kind], float(getattr(tier, field)))
        yield family
    usage = {
        "capacity_bytes": "Per tier: configured capacity in bytes.",
        "used_bytes": "Per tier: bytes held now.",
        "num_entries": "Per tier: chunks held now.",
    }
    for field, text in usage.items():
        gauge = GaugeMetricFamily(f"kvtiers_tier_{field}", text, labels=tier_names)
        for tier in tiers:
            gauge.add_metric([*values, tier.name, tier.kind], float(getattr(tier.usage, field)))
        yield gauge
    ops = HistogramMetricFamily(
        "kvtiers_tier_op_seconds",
        "Per tier: duration of the cache's calls to the tier, by operation.",
        labels=[*tier_names, "op"],
    )
    for tier in tiers:
        for op, hist in sorted(tier.latency.items()):
            ops.add_metric([*values, tier.name, tier.kind, op], _buckets(hist), hist.total_seconds)
    yield ops


def _store_families(tiers: tuple[TierStats, ...], names: list[str], values: list[str]) -> Any:
    """Breaker state and request counters of the tiers that reach a remote store."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    tier_names = [*names, "tier", "kind"]
    guarded = [tier for tier in tiers if tier.breaker is not None]
    state = GaugeMetricFamily(
        "kvtiers_tier_breaker_state",
        "Per tier with a remote store: 1 for the circuit breaker's current state, else 0.",
        labels=[*tier_names, "state"],
    )
    for tier in guarded:
        for name in _BREAKER_STATES:
            state.add_metric([*values, tier.name, tier.kind, name], float(tier.breaker == name))
    yield state
    fields = sorted({field for tier in guarded for field in tier.io})
    for field in fields:
        family = CounterMetricFamily(
            f"kvtiers_tier_io_{field}",
            f"Per tier with a remote store: {field.replace('_', ' ')} (requests to the store).",
            labels=tier_names,
        )
        for tier in guarded:
            family.add_metric([*values, tier.name, tier.kind], float(tier.io.get(field, 0)))
        yield family


class _Source(NamedTuple):
    """One cache whose stats an endpoint serves."""

    snapshot: Callable[[], Coroutine[Any, Any, CacheStats | None]]
    """Returns the cache's stats, or `None` once the cache is closed."""
    loop: asyncio.AbstractEventLoop
    """The loop the snapshot runs on (the cache's own)."""
    labels: dict[str, str]
    """The cache's constant labels."""


class _Collector:
    """Read each source's snapshot on its cache's loop at each scrape.

    Families of the same name from several sources are merged into one, so each metric
    has one `# HELP` and `# TYPE` line whatever the number of caches.
    """

    def __init__(self, first: _Source) -> None:
        self._first = first
        self._lock = threading.Lock()
        self._more: dict[Hashable, _Source] = {}
        self._warned: set[Hashable] = set()

    def add(self, key: Hashable, source: _Source) -> None:
        with self._lock:
            self._more[key] = source

    def remove(self, key: Hashable, source: _Source) -> None:
        """Forget `key`, unless it was added again (with another source) meanwhile."""
        with self._lock:
            if self._more.get(key) is source:
                del self._more[key]

    def collect(self) -> Iterator[Any]:
        with self._lock:
            more = list(self._more.items())
        merged: dict[str, Any] = {}
        served: set[tuple[tuple[str, str], ...]] = set()
        for key, source in [(None, self._first), *more]:
            try:
                stats = _take(source)
            except Exception:
                if key is None:
                    raise
                # NOTE: another cache that cannot answer leaves this scrape, not the endpoint.
                logger.warning("kvtiers: no stats from %s for this scrape", source.labels)
                continue
            if stats is None:
                if key is not None:
                    self.remove(key, source)  # a closed cache leaves the endpoint
                continue
            # NOTE: two samples with one name and the same labels make the whole scrape
            # invalid, so a cache with the labels of one served already is left out.
            labels = tuple(sorted(source.labels.items()))
            if labels in served:
                if key not in self._warned:  # once per source (two at worst: no lock)
                    self._warned.add(key)
                    logger.warning("kvtiers: another cache is served under %s", source.labels)
                continue
            served.add(labels)
            for family in metric_families(stats, source.labels):
                have = merged.setdefault(family.name, family)
                if have is not family:
                    have.samples.extend(family.samples)
        yield from merged.values()


def _take(source: _Source) -> CacheStats | None:
    """Return `source`'s stats, or `None` when its cache or loop is closed."""
    if source.loop.is_closed():
        return None
    snapshot = source.snapshot()
    try:
        future = asyncio.run_coroutine_threadsafe(snapshot, source.loop)
    except RuntimeError:  # the loop closed meanwhile
        snapshot.close()
        return None
    return future.result(_SCRAPE_TIMEOUT_S)


class MetricsServer:
    """An HTTP endpoint serving one cache's metrics; an async context manager.

    `add_source` lets it serve other caches' metrics beside its own (an engine adapter's
    extra pools), each under its own labels.

    Args:
        config: where to listen.
        snapshot: returns the cache's stats; awaited on the cache's loop.
        labels: constant labels of this cache.
    """

    def __init__(
        self,
        config: MetricsConfig,
        snapshot: Callable[[], Coroutine[Any, Any, CacheStats | None]],
        labels: dict[str, str],
    ) -> None:
        self.config = config
        self._snapshot = snapshot
        self._labels = labels
        self._collector: _Collector | None = None
        self._server: MetricsHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None
        """`http://host:port/metrics` once started; `None` when not serving."""

    def add_source(
        self,
        key: Hashable,
        snapshot: Callable[[], Coroutine[Any, Any, CacheStats | None]],
        loop: asyncio.AbstractEventLoop,
        labels: dict[str, str],
    ) -> bool:
        """Serve another cache's stats too, until its snapshot returns `None`; thread-safe.

        Args:
            key: names the source; adding a key again replaces it.
            snapshot: returns the other cache's stats, or `None` once it is closed.
            loop: the loop `snapshot` runs on.
            labels: the other cache's constant labels (the same names as this cache's).

        Returns:
            Whether the endpoint is serving (if not, nothing is kept).
        """
        collector = self._collector
        if collector is None:
            return False
        collector.add(key, _Source(snapshot, loop, labels))
        return True

    async def __aenter__(self) -> Self:
        try:
            from prometheus_client import CollectorRegistry, make_wsgi_app
        except ImportError:
            logger.warning(
                "kvtiers: metrics asked for, but prometheus-client is not installed "
                "(pip install kvtiers[metrics]); no endpoint is served"
            )
            return self
        registry = CollectorRegistry(auto_describe=False)
        first = _Source(self._snapshot, asyncio.get_running_loop(), self._labels)
        collector = _Collector(first)
        registry.register(collector)
        try:
            self._server, self._thread = serve(self.config, make_wsgi_app(registry))
        except OSError as exc:  # a host that does not resolve, a port in use
            where = f"{self.config.host}:{self.config.port}"
            raise ConfigError(f"metrics: cannot serve on {where}: {exc.strerror or exc}") from exc
        port = self._server.server_port
        host = self.config.host
        host = f"[{host}]" if ":" in host else host  # an IPv6 address goes in brackets
        self.url = f"http://{host}:{port}/metrics"
        self._collector = collector
        logger.info("kvtiers: metrics on %s", self.url)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop serving; idempotent."""
        server, self._server = self._server, None
        self._collector = None
        if server is not None:
            # NOTE: shutdown waits for the serving thread; run it off the loop, since a
            # scrape in flight waits on the loop for its snapshot.
            await asyncio.to_thread(server.shutdown)
            server.server_close()
            server.drop_connections()
            if self._thread is not None:
                await asyncio.to_thread(self._thread.join, 5.0)
        self.url = None
