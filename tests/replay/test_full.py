"""The replay's full mode: a trace through a real `TieredCache`, against the index-only mode."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers._replay_full import replay_full, replay_layout, sandbox_config
from kvtiers.cli import main
from kvtiers.core.config import load_config
from kvtiers.core.errors import ConfigError
from kvtiers.eviction import available_policies
from kvtiers.replay import (
    ReuseHints,
    TierSpec,
    hints_for,
    ideal_hits,
    optimum,
    read_trace,
    replay,
    single_tier,
)
from kvtiers.tiers import _lmdb_format
from kvtiers.tiers.lmdb import LMDBTier
from tests._cli_errors import one_line_error
from tests.replay._factories import (
    CONVERSATION,
    SYNTHETIC,
    random_chains,
    trace_from_chains,
    write_lines,
)

LAYOUT = replay_layout(512, 1024)  # 1 KiB blocks: the bytes are real, just few
LIMIT = "100"  # of the synthetic trace: reuse beyond 20 blocks, so lmdb serves some


def dram_lmdb_config(
    tmp_path, *, dram: str = "20KiB", lmdb: str = "512KiB", write_policy: str = "write_through"
):
    """Write a dram -> lmdb config of 1 KiB blocks whose lmdb path must stay untouched."""
    path = tmp_path / "tiers.toml"
    path.write_text(
        "[layout]\n"
        'model = "replay-test"\nnum_layers = 1\nnum_kv_heads = 1\nhead_size = 1\n'
        'dtype = "uint8"\nchunk_size = 512\n\n'
        f'[[tiers]]\nkind = "dram"\ncapacity = "{dram}"\n\n'
        f'[[tiers]]\nkind = "lmdb"\npath = "{tmp_path / "real-lmdb"}"\ncapacity = "{lmdb}"\n'
        f'write_policy = "{write_policy}"\n',
        encoding="utf-8",
    )
    return path


def run_cli(capsys, *argv: str) -> tuple[int, dict, str]:
    status = main(["replay", *argv, "--full", "--json", "--no-progress"])
    out, err = capsys.readouterr()
    return status, json.loads(out) if out else {}, err


@pytest.mark.parametrize(
    ("path", "num_requests", "share"),
    [(CONVERSATION, 600, 0.05), (CONVERSATION, 600, 0.01), (SYNTHETIC, 200, 0.10)],
    ids=["conversation-5%", "conversation-1%", "synthetic-10%"],
)
async def test_lru_serves_what_the_index_only_mode_serves(path, num_requests, share):
    trace = read_trace(path, limit=num_requests)
    tiers = single_tier(int(share * trace.unique_blocks), "lru")
    full = await replay_full(trace, tiers, LAYOUT)
    assert full.run.request_hits == replay(trace, tiers).request_hits
    assert full.verify_failures == 0
    assert full.short_loads == 0
    assert full.tiers[0].hits == full.run.hits
    assert full.tiers[0].bytes_read == full.run.hits * LAYOUT.chunk_bytes


async def test_lru_keeps_prefixes_more_recent_than_their_suffixes(tmp_path):
    # The store of [1, 2, 3] touches 1 and 2 after inserting 3, so [4], newer than all
    # three, outlives them (a prefix older than its child would be passed over instead).
    trace = trace_from_chains(tmp_path / "t.jsonl", [[1, 2], [1, 2, 3], [4], [5, 6], [4]])
    tiers = single_tier(4, "lru")
    assert replay(trace, tiers).request_hits[0][4] == 1
    full = await replay_full(trace, tiers, LAYOUT)
    assert full.run.request_hits == replay(trace, tiers).request_hits


@settings(max_examples=60, deadline=None)
@given(chains=random_chains(max_requests=25), capacity=st.integers(1, 12))
def test_lru_matches_the_index_only_mode_on_random_tries(tmp_path_factory, chains, capacity):
    trace = trace_from_chains(tmp_path_factory.mktemp("t") / "t.jsonl", chains)
    tiers = single_tier(capacity, "lru")
    full = asyncio.run(replay_full(trace, tiers, LAYOUT))
    assert full.run.request_hits == replay(trace, tiers).request_hits


@pytest.mark.parametrize("source", ["turns", "future"])
async def test_lru_with_hints_serves_what_the_index_only_mode_serves(source):
    """The cache makes room before it stores, the simulation evicts after: with reuse
    hints they still agree, because a cold chunk takes room only from other cold ones."""
    trace = read_trace(CONVERSATION, limit=600)
    tiers = single_tier(int(0.05 * trace.unique_blocks), "lru")
    hints = hints_for(trace, source)
    full = await replay_full(trace, tiers, LAYOUT, hints=hints)
    assert full.run.request_hits == replay(trace, tiers, hints=hints.blocks).request_hits
    assert full.run.policy == f"lru+{source}" and full.verify_failures == 0
    assert full.run.hits > replay(trace, tiers).hits


@settings(max_examples=40, deadline=None)
@given(chains=random_chains(max_requests=25), capacity=st.integers(1, 12), data=st.data())
def test_lru_with_random_hints_matches_the_index_only_mode(
    tmp_path_factory, chains, capacity, data
):
    trace = trace_from_chains(tmp_path_factory.mktemp("t") / "t.jsonl", chains)
    blocks = tuple(data.draw(st.integers(0, len(ids))) for ids in trace.requests)
    hints = ReuseHints("random", blocks)
    tiers = single_tier(capacity, "lru")
    full = asyncio.run(replay_full(trace, tiers, LAYOUT, hints=hints))
    assert full.run.request_hits == replay(trace, tiers, hints=blocks).request_hits


def test_full_mode_replays_each_run_with_hints_too(capsys):
    argv = [str(SYNTHETIC), "--limit", LIMIT, "--capacity", "5%", "--policy", "lru", "--full"]
    assert main(["replay", *argv, "--hints", "turns", "--json", "--no-progress"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["policy"] for r in runs] == ["lru", "lru+turns"]
    assert all(r["hits"] == r["index_only_hits"] and r["verify_failures"] == 0 for r in runs)


@pytest.mark.parametrize("policy", available_policies())
async def test_without_evictions_every_policy_serves_the_ideal(policy):
    trace = read_trace(CONVERSATION, limit=200)
    tiers = single_tier(trace.unique_blocks, policy)
    full = await replay_full(trace, tiers, LAYOUT)
    assert full.run.request_hits == replay(trace, tiers).request_hits
    assert full.run.hits == ideal_hits(trace)
    assert full.tiers[0].evictions == 0


@pytest.mark.parametrize("policy", ["arc", "2q"])
async def test_adaptive_policies_stay_under_the_optimum(policy):
    # NOTE: ARC and 2Q see a store's evictions before its inserts in the cache, after them
    # in the index-only mode, so their hits may differ; no schedule beats Belady's.
    trace = read_trace(CONVERSATION, limit=600)
    capacity = int(0.01 * trace.unique_blocks)
    full = await replay_full(trace, single_tier(capacity, policy), LAYOUT)
    assert 0 < full.run.hits <= optimum(trace, capacity).hits
    assert full.verify_failures == 0


async def test_token_traces_are_keyed_by_the_cache_with_their_salt(tmp_path):
    system = list(range(64))
    records = [
        {"tokens": system + [100 + i] * 32, "salt": "a" if i % 3 else "b"} for i in range(12)
    ]
    records.append({"tokens": system + [100] * 32, "salt": "c"})  # a new tenant: no hit
    trace = read_trace(write_lines(tmp_path / "t.jsonl", records), block_tokens=16)
    tiers = single_tier(10, "lru")
    full = await replay_full(trace, tiers, replay_layout(16))
    assert full.run.request_hits == replay(trace, tiers).request_hits
    assert full.run.hits > 0
    assert full.run.request_hits[0][-1] == 0
    assert full.verify_failures == 0


def test_dram_lmdb_cascade_reports_lmdb_hits_in_a_sandbox(capsys, tmp_path):
    config = dram_lmdb_config(tmp_path)
    argv = [str(SYNTHETIC), "--config", str(config), "--limit", LIMIT, "--block-bytes", "layout"]
    status, data, _ = run_cli(capsys, *argv)
    assert status == 0
    run = data["runs"][0]
    dram, lmdb = run["tiers"]
    assert (dram["capacity_blocks"], lmdb["capacity_blocks"]) == (20, 512)
    assert lmdb["hits"] > 0
    assert lmdb["measured"]["bytes_read"] == lmdb["measured"]["hits"] * 1024
    assert dram["hits"] + lmdb["hits"] == run["hits"]
    assert run["hits"] <= ideal_hits(read_trace(SYNTHETIC, limit=int(LIMIT)))
    assert run["verify_failures"] == 0
    assert data["mode"] == "full"
    assert data["stored_block_bytes"] == 1024
    assert not (tmp_path / "real-lmdb").exists()


def test_a_hinted_cascade_reports_each_tiers_cold_chunks(capsys, tmp_path):
    config = dram_lmdb_config(tmp_path)
    argv = [str(SYNTHETIC), "--config", str(config), "--limit", LIMIT, "--hints", "turns"]
    status, data, _ = run_cli(capsys, *argv, "--block-bytes", "layout")
    assert status == 0
    hinted = next(run for run in data["runs"] if run["policy"].endswith("+turns"))
    for tier in hinted["tiers"]:  # the policy counts for dram, lmdb counts its own
        measured = tier["measured"]
        assert 0 < measured["cold_puts"] <= measured["puts"], tier["name"]
        assert 0 <= measured["cold_hits"] <= measured["hits"], tier["name"]


def test_promotions_are_not_evicted_by_the_demotions_they_cause(capsys, tmp_path):
    # Both tiers full: promoting lmdb hits into dram demotes dram's victims into lmdb
    # (write-back), and lmdb, evicting by itself, must not make that room from the chunks
    # the same load is about to read (before the cache touched them first, one load here
    # came up short).
    config = dram_lmdb_config(tmp_path, dram="100KiB", lmdb="800KiB", write_policy="write_back")
    argv = [str(SYNTHETIC), "--config", str(config), "--limit", "1000", "--block-bytes", "layout"]
    status, data, _ = run_cli(capsys, *argv)
    assert status == 0
    run = data["runs"][0]
    assert run["tiers"][1]["hits"] > 0
    assert run["short_loads"] == 0
    assert run["verify_failures"] == 0


def test_corrupt_lmdb_entries_are_misses_not_failures(capsys, tmp_path, monkeypatch):
    pack = _lmdb_format.pack_value_into

    def corrupting(*args, **kwargs):
        value = pack(*args, **kwargs)
        value[-1] ^= 0xFF  # after the checksum: the tier must find it on read
        return value

    monkeypatch.setattr(_lmdb_format, "pack_value_into", corrupting)
    config = dram_lmdb_config(tmp_path)
    status, data, _ = run_cli(capsys, str(SYNTHETIC), "--config", str(config), "--limit", LIMIT)
    assert status == 0
    run = data["runs"][0]
    assert run["short_loads"] > 0
    assert run["tiers"][1]["hits"] == 0
    assert run["tiers"][1]["measured"]["corrupt"] > 0
    assert run["verify_failures"] == 0
    assert run["hits"] < run["index_only_hits"]


def test_wrong_bytes_fail_verification(capsys, tmp_path, monkeypatch):
    get = LMDBTier.get

    async def flipping(self, keys, dsts):
        found = await get(self, keys, dsts)
        for dst, ok in zip(dsts, found, strict=True):
            if ok:
                dst.reshape(-1)[7] ^= 1
        return found

    monkeypatch.setattr(LMDBTier, "get", flipping)
    config = dram_lmdb_config(tmp_path)
    status, data, err = run_cli(capsys, str(SYNTHETIC), "--config", str(config), "--limit", LIMIT)
    assert status == 1
    run = data["runs"][0]
    assert run["verify_failures"] == run["tiers"][1]["hits"] > 0
    assert "other bytes than were stored" in err


def test_full_json_keeps_the_index_only_shape(capsys):
    argv = [str(SYNTHETIC), "--limit", "100", "--capacity", "5%", "--policy", "lru,arc"]
    status, data, _ = run_cli(capsys, *argv)
    assert status == 0
    assert main(["replay", *argv, "--json", "--no-progress"]) == 0
    index = json.loads(capsys.readouterr().out)
    assert set(index) <= set(data)
    assert [r["policy"] for r in data["runs"]] == ["lru", "arc"]
    for run, simulated in zip(data["runs"], index["runs"], strict=True):
        assert set(simulated) <= set(run)
        assert run["index_only_hits"] == simulated["hits"]
        assert run["lookup_load_s"]["p90"] >= run["lookup_load_s"]["median"] >= 0
        assert run["store_s"]["median"] > 0
    assert data["runs"][0]["hits"] == index["runs"][0]["hits"]
    assert data["optimum"] == index["optimum"]


def test_text_report_names_the_full_mode(capsys):
    argv = ["replay", str(SYNTHETIC), "--full", "--limit", "50", "--capacity", "20"]
    assert main([*argv, "--policy", "lru", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "full mode  TieredCache, 4.00 KiB blocks" in out
    assert "\nlru     20 " in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-bytes", "4KiB"], "--block-bytes: only with --full"),
        (["--full", "--block-bytes", "1000"], "not a multiple of 1,024"),
        (["--full", "--block-bytes", "layout"], "needs a --config with a [layout]"),
    ],
)
def test_bad_full_arguments_are_refused(capsys, argv, message):
    assert main(["replay", str(SYNTHETIC), "--limit", "5", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_sandbox_moves_stores_into_the_work_dir(tmp_path):
    base = load_config(
        {
            "tiers": [
                {"kind": "dram", "capacity": "1MiB"},
                {"kind": "lmdb", "path": "/srv/kv", "capacity": "1TiB", "map_size": "2TiB"},
                {
                    "kind": "remote",
                    "url": "s3://pool/prod",
                    "capacity": "1TiB",
                    "storage_options": {"endpoint_url": "http://127.0.0.1:9000"},
                    "ttl": 60,
                },
            ]
        }
    )
    specs = [
        TierSpec("dram", 10, "arc"),
        TierSpec("lmdb", 20, "lru", "lmdb"),
        TierSpec("remote", 30, "lru", "remote"),
    ]
    config = sandbox_config(specs, LAYOUT, tmp_path, base)
    dram, lmdb, remote = config.tiers
    assert (dram.capacity_bytes, dram.eviction) == (10 * 1024, "arc")
    assert dict(lmdb.options) == {"path": str(tmp_path / "tier1-lmdb")}
    assert 20 * 1024 < lmdb.capacity_bytes < 20 * 2048
    assert dict(remote.options) == {"url": (tmp_path / "tier2-remote").as_uri(), "ttl": 60}
    assert config.metrics is None


def test_sandbox_refuses_stores_it_cannot_move(tmp_path):
    with pytest.raises(ConfigError, match="cannot keep a 'redis' tier off its store"):
        sandbox_config([TierSpec("pool", 10, "lru", "redis")], LAYOUT, tmp_path)


def test_blocks_past_the_machines_memory_are_refused_before_the_replay(capsys):
    argv = ["replay", str(SYNTHETIC), "--limit", "5", "--no-progress", "--full"]
    line = one_line_error(capsys, main([*argv, "--block-bytes", "1TiB"]), status=2)
    assert "--full: blocks of 1.00 TiB need about" in line
    assert "give a smaller --block-bytes, --capacity or --limit" in line


def test_a_buffer_that_cannot_be_allocated_is_a_one_line_error(capsys, monkeypatch):
    from kvtiers import _cli_replay_full

    async def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 4.00 KiB")

    monkeypatch.setattr(_cli_replay_full, "replay_full", no_memory)
    code = main(["replay", str(SYNTHETIC), "--limit", "5", "--no-progress", "--full"])
    line = one_line_error(capsys, code, status=2)
    assert "--full: cannot allocate buffers for blocks of 4.00 KiB" in line
