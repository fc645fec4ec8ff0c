"""The metrics endpoint and `kvtiers stats` at their edges: odd labels, odd clients, odd peers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator

import pytest

from kvtiers import TieredCache
from kvtiers.cli import main
from tests.conftest import make_config, make_kv

parser = pytest.importorskip("prometheus_client.parser")

Sample = tuple[str, tuple[tuple[str, str], ...]]


def metrics_config(**kw: object) -> dict[str, object]:
    return {**make_config(**kw), "metrics": {"port": 0}}  # type: ignore[arg-type]


def scrape_text(url: str | None) -> str:
    assert url is not None
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def samples(text: str) -> list[tuple[Sample, float]]:
    """Return every sample of `text`, parsed by prometheus-client's own parser."""
    return [
        ((s.name, tuple(sorted(s.labels.items()))), s.value)
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
    ]


def port_of(url: str | None) -> int:
    assert url is not None
    return int(url.rsplit(":", 1)[1].split("/")[0])


def dropped(sock: socket.socket) -> bool:
    """Return whether the peer closed `sock` (EOF or a reset; 10 s at most)."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return True


# -- the endpoint -------------------------------------------------------------------------------


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_an_ipv6_endpoint_has_a_url_that_works(layout, capsys):
    cfg = {**make_config(), "metrics": {"port": 0, "host": "::1"}}
    async with TieredCache.from_config(cfg) as cache:
        url = cache.metrics_url
        assert url is not None and url.startswith("http://[::1]:")
        assert "kvtiers_lookups_total" in await asyncio.to_thread(scrape_text, url)
        assert await asyncio.to_thread(main, ["stats", "--json", url]) == 0
    assert json.loads(capsys.readouterr().out)["url"] == url


async def test_a_cache_under_labels_served_already_is_left_out(layout):
    twin_labels = make_config()  # the endpoint's own model and TP rank
    async with (
        TieredCache.from_config(metrics_config()) as cache,
        TieredCache.from_config(twin_labels) as twin,
        TieredCache.from_config(make_config(layout={"model": "pool"})) as pool,
        TieredCache.from_config(make_config(layout={"model": "pool"})) as pool_twin,
    ):
        for other in (twin, pool, pool_twin):
            assert cache.serve_metrics_of(other)
        await cache.store(list(range(16)), make_kv(layout, 16))
        await twin.store(list(range(32)), make_kv(layout, 32))
        await pool.store(list(range(48)), make_kv(pool.layout, 48))
        await pool_twin.store(list(range(64)), make_kv(pool.layout, 64))
        text = await asyncio.to_thread(scrape_text, cache.metrics_url)
    got = samples(text)
    counts = Counter(key for key, _ in got)
    assert [key for key, n in counts.items() if n > 1] == []  # a valid exposition
    stored = {dict(k[1])["model"]: v for k, v in got if k[0] == "kvtiers_stored_tokens_total"}
    assert stored == {layout.model: 16, "pool": 48}  # the first under each labels is served


async def test_a_source_added_again_while_its_old_one_closes_stays(layout):
    async with (
        TieredCache.from_config(metrics_config()) as cache,
        TieredCache.from_config(make_config(layout={"model": "pool"})) as pool,
    ):
        server = cache._metrics
        assert server is not None
        loop = asyncio.get_running_loop()

        async def closing_after_a_new_one_came():
            # The pool was reopened under the same key while this scrape read the old one.
            server.add_source("pool", pool._snapshot, loop, pool._metric_labels())
            return None

        labels = pool._metric_labels()
        assert server.add_source("pool", closing_after_a_new_one_came, loop, labels)
        await asyncio.to_thread(scrape_text, cache.metrics_url)
        text = await asyncio.to_thread(scrape_text, cache.metrics_url)
    assert 'model="pool"' in text


async def test_a_client_that_sends_or_reads_nothing_is_dropped_at_close(layout):
    async with TieredCache.from_config(metrics_config()) as cache:
        port = port_of(cache.metrics_url)
        silent = socket.create_connection(("127.0.0.1", port))
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never ends its request
        unread = socket.create_connection(("127.0.0.1", port))
        unread.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # never reads the answer
        try:
            # The loop and other scrapers carry on meanwhile.
            await cache.store(list(range(32)), make_kv(layout, 32))
            text = await asyncio.to_thread(scrape_text, cache.metrics_url)
            assert (
                dict(samples(text))[
                    ("kvtiers_stores_total", (("model", layout.model), ("tp_rank", "0")))
                ]
                == 1
            )
        except BaseException:
            for sock in (silent, half, unread):
                sock.close()
            raise
    try:
        assert await asyncio.to_thread(dropped, silent)
        assert await asyncio.to_thread(dropped, half)
        assert await asyncio.to_thread(dropped, unread)
    finally:
        for sock in (silent, half, unread):
            sock.close()


async def test_an_idle_client_is_dropped_while_the_cache_serves(layout, monkeypatch):
    from kvtiers import _metrics_http

    monkeypatch.setattr(_metrics_http.ScrapeHandler, "timeout", 0.2)  # instead of waiting 30 s
    async with TieredCache.from_config(metrics_config()) as cache:
        with socket.create_connection(("127.0.0.1", port_of(cache.metrics_url))) as silent:
            assert await asyncio.to_thread(dropped, silent)
            assert "kvtiers_lookups_total" in await asyncio.to_thread(
                scrape_text, cache.metrics_url
            )


def _scrape_until_down(url: str, out: list[str], started: threading.Event) -> None:
    while True:
        try:
            out.append(scrape_text(url))
        except (urllib.error.URLError, ConnectionError, OSError):
            return
        finally:
            started.set()


def _check_histograms(got: dict[Sample, float]) -> None:
    """Check that every histogram's buckets are cumulative and end at its `_count`."""
    buckets: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]] = {}
    for (name, labels), value in got.items():
        if name.endswith("_bucket"):
            rest = tuple(kv for kv in labels if kv[0] != "le")
            le = float(dict(labels)["le"])
            buckets.setdefault((name.removesuffix("_bucket"), rest), []).append((le, value))
    assert buckets
    for (base, labels), series in buckets.items():
        counts = [n for _, n in sorted(series)]
        assert counts == sorted(counts), (base, labels)
        assert counts[-1] == got[(f"{base}_count", labels)]
        assert got[(f"{base}_sum", labels)] >= 0


async def test_counters_never_go_down_under_traffic_and_through_close(tmp_path, layout):
    cfg = metrics_config(tmp_path=tmp_path, dram_chunks=4, lmdb_chunks=64)
    scrapes: list[str] = []
    started = threading.Event()
    cache = TieredCache.from_config(cfg)
    async with cache:
        scraper = threading.Thread(
            target=_scrape_until_down, args=(cache.metrics_url, scrapes, started)
        )
        scraper.start()
        try:
            await asyncio.to_thread(started.wait, 10)
            for base in range(0, 20 * 64, 64):
                tokens = list(range(base, base + 64))
                await cache.store(tokens, make_kv(layout, 64))
                await cache.lookup(tokens)
                await cache.load(list(range(64)))
            await cache.flush()
        finally:
            await cache.close()  # the scraper still runs: it stops when the endpoint does
            await asyncio.to_thread(scraper.join)
    last = cache.stats()  # the stats of a closed cache stay readable
    assert len(scrapes) >= 2
    previous: dict[Sample, float] = {}
    for text in scrapes:
        got = dict(samples(text))
        if not got:
            continue  # scraped as the cache closed: nothing, but a valid nothing
        _check_histograms(got)
        for key, value in got.items():
            if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
                assert value >= previous.get(key, 0.0), key
        previous = got
    rank = (("model", layout.model), ("tp_rank", "0"))
    assert last.stores == 20 and previous[("kvtiers_stores_total", rank)] <= 20
    assert last.tiers[1].usage.num_entries > 0


@pytest.mark.parametrize("model", ['say "hi"', "back\\slash", "new\nline", "ünï €😀", "a,b=}{ c"])
async def test_label_values_survive_the_exposition_and_the_stats_command(model, capsys):
    cfg = {**make_config(layout={"model": model}), "metrics": {"port": 0}}
    async with TieredCache.from_config(cfg) as cache:
        url = str(cache.metrics_url)
        await cache.store(list(range(16)), make_kv(cache.layout, 16))
        text = await asyncio.to_thread(scrape_text, url)
        assert await asyncio.to_thread(main, ["stats", "--json", url]) == 0
        (shown,) = json.loads(capsys.readouterr().out)["caches"]
        assert await asyncio.to_thread(main, ["stats", url]) == 0
        heading = capsys.readouterr().out.splitlines()[0]
    assert {dict(labels)["model"] for (_, labels), _ in samples(text)} == {model}
    assert shown["model"] == model and shown["stores"] == 1
    assert " (tp_rank 0) at http://127.0.0.1:" in heading  # one line, whatever the name


# -- `kvtiers stats` against peers that are not a cache -----------------------------------------


@pytest.fixture
def raw_peer() -> Iterator[list[bytes | str]]:
    """Answer one connection with the bytes put in the yielded list (its address second)."""
    reply: list[bytes | str] = [b"", ""]
    listener = socket.create_server(("127.0.0.1", 0))
    reply[1] = f"127.0.0.1:{listener.getsockname()[1]}"

    def answer() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply[0])  # type: ignore[arg-type]

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield reply
    finally:
        listener.close()
        thread.join(10)


def test_a_peer_that_answers_no_http_is_a_one_line_error(raw_peer, capsys):
    raw_peer[0] = b"\x00\xfe garbage\r\nmore\r\n\r\n"
    assert main(["stats", str(raw_peer[1])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\r" not in err and "\x00" not in err  # one line, as is
    assert err.startswith("kvtiers stats: TierIOError: cannot read") and "garbage" in err


def test_samples_with_timestamps_and_escaped_labels_are_read(raw_peer, capsys):
    body = (
        "# TYPE kvtiers_lookups_total counter\n"
        'kvtiers_lookups_total{model="a\\"b\\\\c\\nd",tp_rank="0"} 3 1700000000000\n'
        'kvtiers_stores_total{model="a\\"b\\\\c\\nd",tp_rank="0"} 2\n'
    )
    raw_peer[0] = b"HTTP/1.0 200 OK\r\n\r\n" + body.encode()
    assert main(["stats", "--json", str(raw_peer[1])]) == 0
    (cache,) = json.loads(capsys.readouterr().out)["caches"]
    assert cache["model"] == 'a"b\\c\nd'
    assert cache["lookups"] == 3 and cache["stores"] == 2


def test_a_peer_that_serves_without_end_is_not_read_whole(raw_peer, capsys):
    line = b'kvtiers_lookups_total{model="m",tp_rank="0"} 1\n'
    raw_peer[0] = b"HTTP/1.0 200 OK\r\n\r\n" + line * ((17 << 20) // len(line))
    assert main(["stats", str(raw_peer[1])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "serves more than 16.00 MiB" in err


def test_negative_bucket_counts_print_no_quantile(raw_peer, capsys):
    body = (
        'kvtiers_op_seconds_bucket{model="m",tp_rank="0",op="lookup",le="0.1"} -6\n'
        'kvtiers_op_seconds_bucket{model="m",tp_rank="0",op="lookup",le="+Inf"} -5\n'
    )
    raw_peer[0] = b"HTTP/1.0 200 OK\r\n\r\n" + body.encode()
    assert main(["stats", str(raw_peer[1])]) == 0
    assert "latency p50/p99" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, tier",
    [
        ("kvtiers_model", False),
        ("kvtiers_tp_rank", False),
        ("kvtiers_tiers", False),
        ("kvtiers_evicted_from", False),
        ("kvtiers_latency", False),
        ("kvtiers_tier_kind", True),
        ("kvtiers_tier_latency", True),
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_samples_named_like_the_grouping_leave_it_whole(raw_peer, capsys, name, tier, as_json):
    labels = 'model="m",tp_rank="0"' + (',tier="d",kind="dram"' if tier else "")
    body = (
        'kvtiers_tier_hits_total{model="m",tp_rank="0",tier="d",kind="dram"} 4\n'
        f"{name}{{{labels}}} 1\n"
    )
    raw_peer[0] = b"HTTP/1.0 200 OK\r\n\r\n" + body.encode()
    assert main(["stats", *(["--json"] if as_json else []), str(raw_peer[1])]) == 0
    out = capsys.readouterr().out
    if as_json:
        (cache,) = json.loads(out)["caches"]
        assert cache["model"] == "m" and cache["tiers"]["d"] == {"kind": "dram", "hits": 4.0}
    else:
        assert out.startswith("m (tp_rank 0) at http://")
