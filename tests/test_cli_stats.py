"""`kvtiers stats`: bad addresses and odd values from the endpoint, without a cache running."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from kvtiers.cli import main
from tests._cli_errors import one_line_error

# What an endpoint may serve: Prometheus writes NaN and +Inf/-Inf as they are.
ODD_VALUES = """\
kvtiers_lookups_total{model="m",tp_rank="0"} NaN
kvtiers_lookup_tokens_total{model="m",tp_rank="0"} +Inf
kvtiers_hit_tokens_total{model="m",tp_rank="0"} 3
kvtiers_load_seconds_total{model="m",tp_rank="0"} NaN
kvtiers_loaded_bytes_total{model="m",tp_rank="0"} +Inf
kvtiers_misses_total{model="m",tp_rank="0",reason="never_stored"} NaN
kvtiers_tier_used_bytes{model="m",tp_rank="0",tier="dram",kind="dram"} NaN
kvtiers_tier_capacity_bytes{model="m",tp_rank="0",tier="dram",kind="dram"} +Inf
kvtiers_tier_hits_total{model="m",tp_rank="0",tier="dram",kind="dram"} -Inf
kvtiers_op_seconds_bucket{model="m",tp_rank="0",op="lookup",le="0.1"} NaN
kvtiers_op_seconds_bucket{model="m",tp_rank="0",op="lookup",le="+Inf"} +Inf
"""


def _refuse(name: str) -> None:
    raise AssertionError(f"not JSON: {name}")


@pytest.fixture
def serve() -> Iterator[list[str]]:
    """Serve the text put in the yielded list at an HTTP address (set as its second item)."""
    body = ["", ""]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body[0].encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    body[1] = f"127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield body
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "url, message",
    [
        ("127.0.0.1:abc", "'abc'"),
        ("127.0.0.1:99999", "out of range"),
        ("[::1", "IPv6"),
        ("ftp://127.0.0.1:21", "expected HOST:PORT or an http(s):// URL"),
        ("http://:9400", "expected HOST:PORT or an http(s):// URL"),
    ],
)
def test_a_bad_address_is_a_one_line_error(capsys, url, message):
    line = one_line_error(capsys, main(["stats", url]), status=2)
    assert f"URL {url!r}" in line and message in line


def test_json_writes_null_for_nan_and_infinity(serve, capsys):
    serve[0] = ODD_VALUES
    assert main(["stats", "--json", serve[1]]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and "Infinity" not in out
    (cache,) = json.loads(out, parse_constant=_refuse)["caches"]
    assert cache["lookups"] is None and cache["hit_tokens"] == 3.0
    assert cache["tiers"]["dram"]["capacity_bytes"] is None
    assert cache["latency"]["lookup"]["buckets"] == {"0.1": None, "+Inf": None}


def test_text_prints_odd_values_without_failing(serve, capsys):
    serve[0] = ODD_VALUES
    assert main(["stats", serve[1]]) == 0
    out = capsys.readouterr().out
    assert "loads 0 (?, ?/s)" in out
    assert "?/?" in out


def test_a_malformed_sample_is_a_one_line_error(serve, capsys):
    serve[0] = 'kvtiers_lookups_total{model="m",tp_rank="0"} lots\n'
    line = one_line_error(capsys, main(["stats", serve[1]]), status=1)
    assert "TierIOError" in line and "malformed sample" in line
