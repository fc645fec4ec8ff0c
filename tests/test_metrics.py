"""Prometheus metrics, scraped over HTTP from the endpoint a config starts."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid

import pytest

from kvtiers import CacheState, ConfigError, TieredCache, load_config
from kvtiers._cli_stats import quantile
from tests.conftest import make_config, make_kv

parser = pytest.importorskip("prometheus_client.parser")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model"))
            out[(sample.name, labels)] = sample.value
    return out


def metrics_config(**kw):
    return {**make_config(**kw), "metrics": {"port": 0}}


async def test_known_workload_gives_exact_counters(layout, capsys):
    from kvtiers.cli import main

    async with TieredCache.from_config(metrics_config(dram_chunks=4)) as cache:
        assert cache.metrics_url is not None
        tokens = list(range(64))  # 4 chunks of 16
        await cache.store(tokens, make_kv(layout, 64))
        assert await cache.lookup(tokens) == 64  # a hit: no miss reason
        assert await cache.lookup(list(range(1000, 1032))) == 0  # never stored
        await cache.store(list(range(500, 532)), make_kv(layout, 32))  # evicts 2 chunks
        assert await cache.lookup(tokens) < 64  # evicted
        await cache.load(tokens[:16])
        got = await asyncio.to_thread(scrape, cache.metrics_url)
        assert await asyncio.to_thread(main, ["stats", cache.metrics_url]) == 0
    assert "(evicted last from: dram 1)" in capsys.readouterr().out
    tier = (("kind", "dram"), ("tier", "dram"), ("tp_rank", "0"))
    assert got[("kvtiers_lookups_total", (("tp_rank", "0"),))] == 3
    assert got[("kvtiers_hit_tokens_total", (("tp_rank", "0"),))] == 64 + 32
    assert got[("kvtiers_stores_total", (("tp_rank", "0"),))] == 2
    assert got[("kvtiers_stored_tokens_total", (("tp_rank", "0"),))] == 96
    assert got[("kvtiers_loads_total", (("tp_rank", "0"),))] == 1
    assert got[("kvtiers_misses_total", (("reason", "never_stored"), ("tp_rank", "0")))] == 1
    assert got[("kvtiers_misses_total", (("reason", "evicted"), ("tp_rank", "0")))] == 1
    assert got[("kvtiers_misses_evicted_total", (("tier", "dram"), ("tp_rank", "0")))] == 1
    assert got[("kvtiers_tier_evictions_total", tier)] == 2
    assert got[("kvtiers_tier_num_entries", tier)] == 4
    assert got[("kvtiers_tier_capacity_bytes", tier)] == 4 * layout.chunk_bytes
    assert got[("kvtiers_write_queue_chunks", (("tp_rank", "0"),))] == 0


async def test_reuse_hints_are_counted_per_tier(tmp_path, layout, capsys):
    from kvtiers.cli import main

    config = metrics_config(tmp_path=tmp_path, dram_chunks=8, lmdb_chunks=64)
    async with TieredCache.from_config(config) as cache:
        await cache.store(list(range(64)), make_kv(layout, 64), keep_tokens=16)  # 3 cold
        await cache.flush()  # written through to lmdb, cold there too
        await cache.load(list(range(32)))  # the second chunk was wanted after all
        got = await asyncio.to_thread(scrape, cache.metrics_url)
        dram, lmdb = cache.stats().tiers
        assert await asyncio.to_thread(main, ["stats", cache.metrics_url]) == 0
    assert "dram: stored cold 3, hit while cold 1 (33.3%)" in capsys.readouterr().out
    assert (dram.cold_puts, dram.cold_hits) == (3, 1)
    # The lmdb tier counts by itself; the load read DRAM's copy.
    assert (lmdb.cold_puts, lmdb.cold_hits) == (3, 0)
    tier = (("kind", "dram"), ("tier", "dram"), ("tp_rank", "0"))
    assert got[("kvtiers_tier_cold_puts_total", tier)] == 3
    assert got[("kvtiers_tier_cold_hits_total", tier)] == 1


async def test_every_tier_is_labelled(tmp_path, layout):
    async with TieredCache.from_config(metrics_config(tmp_path=tmp_path, lmdb_chunks=64)) as cache:
        await cache.store(list(range(32)), make_kv(layout, 32))
        await cache.flush()
        got = await asyncio.to_thread(scrape, cache.metrics_url)
    lmdb = (("kind", "lmdb"), ("tier", "lmdb"), ("tp_rank", "0"))
    assert got[("kvtiers_tier_puts_total", lmdb)] == 2
    assert got[("kvtiers_tier_num_entries", lmdb)] == 2


async def test_endpoint_stops_with_the_cache(layout):
    cache = TieredCache.from_config(metrics_config())
    async with cache:
        url = cache.metrics_url
        assert url is not None
    assert cache.metrics_url is None
    with pytest.raises(OSError):
        await asyncio.to_thread(urllib.request.urlopen, url, None, 2)


async def test_no_metrics_table_serves_nothing(layout):
    async with TieredCache.from_config(make_config()) as cache:
        assert cache.metrics_url is None


@pytest.mark.parametrize(
    "metrics, field",
    [
        ({"port": -1}, "metrics.port"),
        ({"port": "9400"}, "metrics.port"),
        ({"port": 9400, "bind": "x"}, "metrics.bind"),
        ({"port": 9400, "host": ""}, "metrics.host"),
        (9400, "metrics"),
    ],
)
def test_bad_metrics_config_names_the_field(metrics, field):
    with pytest.raises(ConfigError, match=field):
        load_config({**make_config(), "metrics": metrics})


@pytest.mark.parametrize("host", ["no.such.host.invalid", "192.0.2.1"])
async def test_an_address_it_cannot_serve_on_is_a_config_error(layout, host):
    cache = TieredCache.from_config({**make_config(), "metrics": {"port": 0, "host": host}})
    with pytest.raises(ConfigError, match=f"^metrics: cannot serve on {host}:0"):
        await cache.open()
    assert cache.state is CacheState.CLOSED


async def test_a_port_in_use_is_a_config_error(layout):
    async with TieredCache.from_config({**make_config(), "metrics": {"port": 0}}) as first:
        port = int(first.metrics_url.rsplit(":", 1)[1].split("/")[0])
        other = TieredCache.from_config({**make_config(), "metrics": {"port": port}})
        with pytest.raises(ConfigError, match=f"cannot serve on 127.0.0.1:{port}"):
            await other.open()


async def test_stats_cli_reads_a_running_cache(layout, capsys):
    from kvtiers.cli import main

    cfg = metrics_config(dram_chunks=4)
    url = f"memory://stats-cli/{uuid.uuid4().hex[:8]}"
    cfg["tiers"].append({"kind": "remote", "url": url, "capacity": "1MiB"})
    async with TieredCache.from_config(cfg) as cache:
        tokens = list(range(64))
        await cache.store(tokens, make_kv(layout, 64))
        await cache.lookup(tokens)
        await cache.lookup(list(range(1000, 1032)))
        url = cache.metrics_url.removeprefix("http://").removesuffix("/metrics")
        assert await asyncio.to_thread(main, ["stats", url]) == 0
        text = capsys.readouterr().out
        assert await asyncio.to_thread(main, ["stats", "--json", cache.metrics_url]) == 0
        data = json.loads(capsys.readouterr().out)
    assert "hit rate 66.7% (64 of 96 tokens)" in text
    assert "misses: never_stored 1" in text
    assert "dram" in text
    (only,) = data["caches"]
    assert only["lookups"] == 2 and only["misses"] == {"never_stored": 1.0}
    assert only["tiers"]["dram"]["num_entries"] == 4
    assert "latency p50/p99 (bucket bounds): lookup " in text
    assert "remote: breaker closed (requests " in text
    assert only["tiers"]["remote"]["breaker"] == "closed"
    assert only["latency"]["lookup"]["count"] == 2
    assert quantile(only["latency"]["lookup"], 0.5) is not None
    assert only["tiers"]["remote"]["latency"]["contains"]["count"] >= 1


def test_stats_cli_unreachable_endpoint_fails_cleanly(capsys):
    from kvtiers.cli import main
    from tests.tiers.conftest import free_port

    assert main(["stats", f"127.0.0.1:{free_port()}"]) == 1
    assert "cannot read" in capsys.readouterr().err


async def test_latency_histograms_count_every_call(tmp_path, layout):
    cfg = metrics_config(tmp_path=tmp_path, dram_chunks=4, lmdb_chunks=64)
    async with TieredCache.from_config(cfg) as cache:
        for base in (0, 1000, 2000):
            await cache.store(list(range(base, base + 32)), make_kv(layout, 32))
            # NOTE: written through before the next store, so no copy in flight pins the
            # oldest chunks in dram and the third store evicts them.
            await cache.flush()
        for base in (0, 1000):
            await cache.lookup(list(range(base, base + 32)))
        await cache.load(list(range(32)))  # evicted from dram: read from lmdb
        got = await asyncio.to_thread(scrape, cache.metrics_url)
        stats = cache.stats()
    rank = ("tp_rank", "0")
    for op, calls in (("lookup", 2), ("load", 1), ("store", 3)):
        assert got[("kvtiers_op_seconds_count", (("op", op), rank))] == calls
        inf = got[("kvtiers_op_seconds_bucket", (("le", "+Inf"), ("op", op), rank))]
        assert inf == calls
        assert stats.latency[op].count == calls
        assert got[("kvtiers_op_seconds_sum", (("op", op), rank))] == pytest.approx(
            stats.latency[op].total_seconds
        )
    lmdb = (("kind", "lmdb"), ("op", "get"), ("tier", "lmdb"), rank)
    assert got[("kvtiers_tier_op_seconds_count", lmdb)] >= 1
    assert stats.tiers[1].latency["put"].count >= 1
    assert stats.tiers[1].breaker is None and stats.tiers[1].io == {}


def test_breaker_state_and_store_requests_become_metrics():
    from prometheus_client.core import Metric

    from kvtiers.core.stats import CacheStats, TierStats, TierUsage
    from kvtiers.metrics import metric_families

    tier = TierStats(
        name="s3", kind="remote", usage=TierUsage(1, 0, 0), breaker="open", io={"refused": 7}
    )
    families: dict[str, Metric] = {
        f.name: f for f in metric_families(CacheStats(tiers=(tier,)), {"model": "m"})
    }
    states = {s.labels["state"]: s.value for s in families["kvtiers_tier_breaker_state"].samples}
    assert states == {"closed": 0.0, "open": 1.0, "half_open": 0.0}
    (refused,) = families["kvtiers_tier_io_refused"].samples
    assert refused.value == 7 and refused.labels["tier"] == "s3"


def test_latency_quantiles_are_bucket_bounds():
    from kvtiers.core.stats import LATENCY_BUCKETS, LatencyHistogram

    hist = LatencyHistogram()
    assert hist.snapshot().quantile(0.5) == 0.0
    for seconds in (0.0001, 0.0003, 0.0003, 0.004, 20.0):
        hist.observe(seconds)
    snap = hist.snapshot()
    assert snap.count == 5 and snap.total_seconds == pytest.approx(20.0047)
    assert snap.counts[0] == 1  # a duration equal to a bound counts in its bucket
    assert snap.quantile(0.5) == 0.0005
    assert snap.quantile(0.8) == 0.005
    assert snap.quantile(1.0) == float("inf")
    assert len(snap.counts) == len(LATENCY_BUCKETS) + 1


# -- every miss reason, as Prometheus sees it ---------------------------------------------------


def _remote_config(**remote):
    cfg = metrics_config(dram_chunks=8)
    tier = {"kind": "remote", "capacity": "8MiB", "url": f"faulty://m/{uuid.uuid4().hex[:8]}"}
    cfg["tiers"].append({**tier, "timeout": 0.2, "retries": 0, **remote})
    return cfg


async def _through_faulty_store(layout, faults, **remote):
    """Store one prompt in the store only, then look it up from a fresh cache under `faults`."""
    from tests.reliability import _faulty_fs as faulty

    faulty.register()
    cfg = _remote_config(**remote)
    tokens = list(range(64))
    plain = {key: value for key, value in cfg.items() if key != "metrics"}
    async with TieredCache.from_config(plain) as writer:
        await writer.store(tokens, make_kv(layout, 64))
    faulty.ACTIVE = faults
    try:
        async with TieredCache.from_config(cfg) as cache:
            assert await cache.lookup(tokens) == 0
            return await asyncio.to_thread(scrape, cache.metrics_url)
    finally:
        faulty.ACTIVE = faulty.Faults()


async def _scenario(reason, tmp_path, layout):
    from tests.reliability import _faulty_fs as faulty
    from tests.test_cache_lmdb import (
        _another_layouts_value,
        _flip_payload_byte,
        _store_then_rewrite,
    )

    kv, tokens = make_kv(layout, 64), list(range(64))
    if reason in ("corrupt", "layout_mismatch"):
        edit = _flip_payload_byte if reason == "corrupt" else _another_layouts_value
        cfg, tokens, _ = await _store_then_rewrite(tmp_path, layout, 2, edit)
        async with TieredCache.from_config({**cfg, "metrics": {"port": 0}}) as cache:
            assert await cache.lookup(tokens) == 64
            assert (await cache.load(tokens)).shape[2] < 64
            return await asyncio.to_thread(scrape, cache.metrics_url)
    if reason == "timeout":
        return await _through_faulty_store(layout, faulty.Faults(slow_rate=1.0, delay=0.6))
    if reason == "tier_unavailable":
        return await _through_faulty_store(layout, faulty.Faults(error_rate=1.0))
    async with TieredCache.from_config(metrics_config(dram_chunks=4)) as cache:
        if reason == "salt_mismatch":
            await cache.store(tokens, kv, salt="a")
            assert await cache.lookup(tokens, salt="b") == 0
        elif reason == "load_short":
            await cache.store(tokens, kv)
            assert await cache.lookup(tokens) == 64
            await cache.tiers[0].delete(cache.keys(tokens)[2:3])  # gone before the load
            assert (await cache.load(tokens)).shape[2] == 32
        else:
            assert await cache.lookup(tokens) == 0
        return await asyncio.to_thread(scrape, cache.metrics_url)


@pytest.mark.parametrize(
    "reason",
    [
        "never_stored",
        "salt_mismatch",
        "load_short",
        "corrupt",
        "layout_mismatch",
        "timeout",
        "tier_unavailable",
    ],
)
async def test_each_miss_reason_is_counted_once_in_the_scrape(tmp_path, layout, reason):
    got = await _scenario(reason, tmp_path, layout)
    reasons = {
        dict(labels)["reason"]: value
        for (name, labels), value in got.items()
        if name == "kvtiers_misses_total"
    }
    assert reasons == {reason: 1}


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


async def test_one_endpoint_serves_other_caches_under_their_own_labels(layout, capsys):
    from kvtiers.cli import main
    from kvtiers.integrations._runtime import LoopThread

    other_config = make_config(layout={"model": "tiny#mamba"})
    elsewhere = LoopThread("other-cache")  # the other cache lives on a loop of its own
    other = TieredCache.from_config(other_config)
    try:
        elsewhere.run(other.open())
        elsewhere.run(other.store(list(range(32)), make_kv(other.layout, 32)))
        async with TieredCache.from_config(metrics_config()) as cache:
            assert cache.serve_metrics_of(other)
            assert cache.serve_metrics_of(other)  # again: still one source
            await cache.store(list(range(16)), make_kv(layout, 16))
            text = await asyncio.to_thread(scrape_text, cache.metrics_url)
            assert text.count("# TYPE kvtiers_stored_tokens") == 1  # families merged
            stored = {
                s.labels["model"]: s.value
                for f in parser.text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "kvtiers_stored_tokens_total"
            }
            assert stored == {layout.model: 16, "tiny#mamba": 32}
            assert await asyncio.to_thread(main, ["stats", "--json", cache.metrics_url]) == 0
            shown = json.loads(capsys.readouterr().out)["caches"]
            assert sorted(c["model"] for c in shown) == sorted([layout.model, "tiny#mamba"])
            elsewhere.run(other.close())
            text = await asyncio.to_thread(scrape_text, cache.metrics_url)
            assert "tiny#mamba" not in text  # a closed cache leaves the endpoint
            assert f'model="{layout.model}"' in text
    finally:
        elsewhere.run(other.close())
        elsewhere.stop()


async def test_serving_others_needs_an_endpoint(layout):
    async with (
        TieredCache.from_config(make_config()) as cache,
        TieredCache.from_config(make_config(layout={"model": "other"})) as other,
    ):
        assert not cache.serve_metrics_of(other)  # no [metrics] table
    unopened = TieredCache.from_config(make_config(layout={"model": "other"}))
    async with TieredCache.from_config(metrics_config()) as cache:
        assert not cache.serve_metrics_of(unopened)  # never opened: no loop to read on
        assert not cache.serve_metrics_of(cache)


async def test_a_source_that_fails_leaves_the_scrape_not_the_endpoint(layout):
    from kvtiers.core.config import MetricsConfig
    from kvtiers.metrics import MetricsServer

    async with TieredCache.from_config(make_config()) as cache:
        stats = cache.stats()

        async def good():
            return stats

        async def bad():
            raise RuntimeError("a pool's loop is wedged")

        loop = asyncio.get_running_loop()
        async with MetricsServer(MetricsConfig(port=0), good, {"model": "kv"}) as server:
            assert server.add_source("pool", bad, loop, {"model": "kv#pool"})
            text = await asyncio.to_thread(scrape_text, server.url)
    assert 'kvtiers_lookups_total{model="kv"}' in text
    assert "kv#pool" not in text
