"""The replay report: its JSON object, the gap closed, TTFT and the text tables."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from kvtiers.core.config import load_config
from kvtiers.core.errors import ConfigError
from kvtiers.costmodel import TierLink, load_model, make_compute, ttft_seconds
from kvtiers.replay import (
    CostSetup,
    build_report,
    format_report,
    from_config,
    parse_capacity,
    parse_policies,
    read_trace,
    single_tier,
)
from tests.replay._factories import SYNTHETIC, trace_head, write_lines


@pytest.fixture(scope="module")
def trace():
    return trace_head(SYNTHETIC, 400)


@pytest.fixture(scope="module")
def report(trace):
    capacities = [int(0.05 * trace.unique_blocks), int(0.10 * trace.unique_blocks)]
    cascades = [single_tier(c, p) for c in capacities for p in parse_policies("all")]
    return build_report(trace, cascades)


def test_json_object_has_the_documented_shape(report, trace):
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["requests"] == trace.num_requests
    assert data["total_blocks"] == trace.total_blocks
    assert data["unique_blocks"] == trace.unique_blocks
    assert 0 < data["ideal_hit_rate"] < 1
    assert data["block_bytes"] is None
    assert [(r["policy"], r["capacity_blocks"]) for r in data["runs"]] == [
        (p, c)
        for c in (int(0.05 * trace.unique_blocks), int(0.10 * trace.unique_blocks))
        for p in ("lru", "2q", "arc")
    ]
    for run in data["runs"]:
        assert isinstance(run["hit_rate"], float)
        assert run["hits"] == run["tiers"][0]["hits"] == run["tiers"][0]["blocks_read"]
        assert run["tiers"][0]["bytes_read"] is None
        assert run["hit_rate"] <= data["ideal_hit_rate"]
    assert [o["capacity_blocks"] for o in data["optimum"]] == sorted(
        {r["capacity_blocks"] for r in data["runs"]}
    )
    assert "cost" not in data
    assert "ttft" not in data["runs"][0]


def test_gap_closed_is_measured_from_lru_to_the_optimum(report):
    for run in report.runs:
        gap = report.gap_closed(run)
        best = report.optimum_at(run.capacity_blocks)
        assert best is not None
        assert run.hits <= best.hits
        lru = next(
            r for r in report.runs if r.policy == "lru" and r.capacity_blocks == run.capacity_blocks
        )
        assert gap == pytest.approx((run.hits - lru.hits) / (best.hits - lru.hits))
        if run.policy == "lru":
            assert gap == 0


def test_text_report_lists_every_policy_and_the_optimum(report):
    text = format_report(report)
    assert "reuse" in text
    for run in report.runs:
        assert f"{run.hit_rate:.2%}" in text
    assert text.count("optimum") >= 2
    assert "gap closed" in text


def test_costs_add_ttft_and_break_even(trace):
    model = load_model("llama-3.1-8b")
    costs = CostSetup(model, make_compute(model, "H200"), (TierLink("dram", 50e9, 20e-6),))
    block_bytes = model.bytes_per_token * trace.block_tokens
    report = build_report(trace, [single_tier(300, "lru")], block_bytes=block_bytes, costs=costs)
    data = report.to_dict()
    run = data["runs"][0]
    assert run["tiers"][0]["bytes_read"] == run["hits"] * block_bytes
    ttft = run["ttft"]
    assert ttft["mean_s"] < ttft["mean_without_s"]
    assert 0 < ttft["reduction"] < 1
    assert ttft["throughput_gain"] > 1
    assert data["cost"]["bytes_per_token"] == 131_072
    assert data["cost"]["tiers"][0]["break_even_bandwidth"] > 0
    # Per request: the cost model's TTFT with the hit blocks as cached tokens.
    r = next(i for i, h in enumerate(report.runs[0].request_hits[0]) if h)
    hits = report.runs[0].request_hits[0][r]
    expected = ttft_seconds(
        model, costs.compute, trace.input_tokens[r], [(costs.links[0], hits * 512)]
    )
    assert report.ttft[0].with_cache[r] == pytest.approx(expected)
    assert statistics.fmean(report.ttft_without) == pytest.approx(ttft["mean_without_s"])
    assert "TTFT mean" in format_report(report)


@pytest.mark.parametrize(
    ("text", "blocks"),
    [("9140", 9140), ("5%", 2196), ("10%", 4392), ("0.5%", 219), ("1MiB", 8)],
)
def test_parse_capacity(text, blocks):
    assert parse_capacity(text, unique_blocks=43_924, block_bytes=131_072) == blocks


@pytest.mark.parametrize(
    ("text", "block_bytes", "match"),
    [
        ("16GiB", None, "needs the KV layout"),
        ("0", 1, "less than one block"),
        ("0.001%", 1, "less than one block"),
        ("lots", 1, "expected a size"),
    ],
)
def test_parse_capacity_errors(text, block_bytes, match):
    with pytest.raises(ConfigError, match=match):
        parse_capacity(text, unique_blocks=43_924, block_bytes=block_bytes)


def test_parse_policies():
    assert parse_policies("all") == ["lru", "2q", "arc"]
    assert parse_policies("arc, lru,arc") == ["lru", "arc"]
    with pytest.raises(ConfigError, match="unknown policy 'mru'"):
        parse_policies("lru,mru")


def test_from_config_sizes_tiers_in_blocks(tmp_path):
    config = load_config(
        {
            "tiers": [
                {"kind": "dram", "capacity": "1MiB", "eviction": "arc"},
                {"kind": "lmdb", "path": str(tmp_path), "capacity": "4MiB", "name": "disk"},
            ]
        }
    )
    tiers = from_config(config, block_bytes=65_536)
    assert [(t.name, t.capacity_blocks, t.policy, t.kind) for t in tiers] == [
        ("dram", 16, "arc", "dram"),
        ("disk", 64, "lru", "lmdb"),
    ]
    top = from_config(config, block_bytes=65_536, policy="2q", top_capacity=5)
    assert (top[0].capacity_blocks, top[0].policy, top[1].policy) == (5, "2q", "lru")
    with pytest.raises(ConfigError, match=r"tiers\[0\].capacity: .* less than one"):
        from_config(config, block_bytes=2**21)


def test_infinite_break_even_is_null_in_json(trace):
    model = load_model("llama-3.1-8b")
    slow = TierLink("s3", 1e9, 1e3)  # a latency no prefill outlasts
    costs = CostSetup(model, make_compute(model), (slow,))
    data = build_report(trace.head(50), [single_tier(50, "lru")], costs=costs).to_dict()
    assert data["cost"]["tiers"][0]["break_even_bandwidth"] is None
    assert not math.isnan(data["runs"][0]["ttft"]["mean_s"])


def test_parse_capacity_share_is_exact():
    # 0.29 * 100 is 28.999... in floating point; the share is floored exactly.
    assert parse_capacity("29%", unique_blocks=100, block_bytes=None) == 29


def test_a_break_even_that_never_comes_reads_never(tmp_path):
    # Prompts of no tokens: the median is 0, recompute costs nothing, no bandwidth ties it.
    empty = {"timestamp": 0, "input_length": 0, "output_length": 0, "hash_ids": []}
    trace = read_trace(write_lines(tmp_path / "t.jsonl", [empty, empty]))
    model = load_model("llama-3.1-8b")
    costs = CostSetup(model, make_compute(model), (TierLink("dram", 50e9, 20e-6),))
    report = build_report(trace, [single_tier(5, "lru")], costs=costs)
    text = format_report(report)
    assert "break-even never" in text and "inf GB/s" not in text
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["cost"]["tiers"][0]["break_even_bandwidth"] is None
