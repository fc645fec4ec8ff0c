"""kvtiers' KV events named in vLLM's terms: origins, the worker's drain, the rank quorum."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from kvtiers import TieredCache
from kvtiers.core.events import ChunkRemoved, ChunkStored
from kvtiers.integrations._runtime import CacheRegistry
from kvtiers.integrations._vllm_events import (
    BlocksRemoved,
    BlocksStored,
    ChunkOrigins,
    EventQuorum,
    TierMedium,
    WorkerEvents,
    block_origin,
    kv_events_on,
    tier_medium,
)
from kvtiers.integrations._vllm_plan import (
    BlockOrigin,
    ConnectorSettings,
    LoadSpec,
    SaveSpec,
    StepPlan,
)
from kvtiers.integrations._vllm_plan import tokens_to_bytes as packed
from tests.conftest import make_config, make_kv, small_layout

BLOCK = 8
LAYOUT = small_layout()  # chunks of 16 tokens: two blocks each
CHUNK = LAYOUT.chunk_size
DRAM = TierMedium("CPU", "LOCAL", "kvtiers:dram")


def vllm_hashes(tokens: list[int]) -> tuple[bytes, ...]:
    """Chained block hashes of the full blocks, as vLLM's sha256 hashing makes them."""
    out, parent = [], b""
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(parent + packed(tokens[i * BLOCK : (i + 1) * BLOCK])).digest()
        out.append(parent)
    return tuple(out)


def prompt(conv: int, num_tokens: int = 3 * CHUNK) -> list[int]:
    return [conv * 1000 + t for t in range(num_tokens)]


def test_origins_name_each_chunk_by_its_blocks_and_the_block_before_it():
    tokens = prompt(0)
    hashes = vllm_hashes(tokens)
    origins = ChunkOrigins(max_chunks=8, block_size=BLOCK, chunk_size=CHUNK)
    origins.record([b"k0", b"k1", b"k2"], packed(tokens), BlockOrigin(hashes, 7, "adapter"))
    first, third = origins.get(b"k0"), origins.get(b"k2")
    assert first is not None and third is not None
    assert first.block_hashes == hashes[0:2] and first.parent_block_hash is None
    assert third.block_hashes == hashes[4:6] and third.parent_block_hash == hashes[3]
    assert third.token_ids == packed(tokens[2 * CHUNK :])
    assert (third.lora_id, third.lora_name) == (7, "adapter")


def test_chunks_past_the_known_hashes_are_not_remembered():
    tokens = prompt(0)
    origins = ChunkOrigins(max_chunks=8, block_size=BLOCK, chunk_size=CHUNK)
    short = BlockOrigin(vllm_hashes(tokens)[:3])  # a chunk and a half
    origins.record([b"k0", b"k1", b"k2"], packed(tokens), short)
    assert len(origins) == 1 and origins.get(b"k1") is None


def test_origins_are_bounded_and_forget_the_least_recently_used():
    origins = ChunkOrigins(max_chunks=2, block_size=BLOCK, chunk_size=CHUNK)
    for conv in range(2):
        tokens = prompt(conv, CHUNK)
        origins.record([f"k{conv}".encode()], packed(tokens), BlockOrigin(vllm_hashes(tokens)))
    assert origins.get(b"k0") is not None  # k1 is now the least recently used
    tokens = prompt(2, CHUNK)
    origins.record([b"k2"], packed(tokens), BlockOrigin(vllm_hashes(tokens)))
    assert len(origins) == 2 and origins.forgotten == 1
    assert origins.get(b"k1") is None and origins.get(b"k0") is not None


def test_tiers_are_named_with_vllm_media_and_the_kvtiers_tier():
    assert tier_medium("dram", "dram") == DRAM
    assert tier_medium("hbm", "gpu0") == TierMedium("GPU", "LOCAL", "kvtiers:gpu0")
    assert tier_medium("lmdb", "nvme") == TierMedium("STORAGE", "LOCAL", "kvtiers:nvme")
    assert tier_medium("remote", "s3") == TierMedium("STORAGE", "REMOTE", "kvtiers:s3")
    assert tier_medium("redis", "redis") == TierMedium("CPU", "REMOTE", "kvtiers:redis")
    assert tier_medium("plugin", "x") == TierMedium("STORAGE", None, "kvtiers:x")


def test_block_origin_takes_the_request_hashes_and_adapter():
    tokens = prompt(0)
    lora = SimpleNamespace(adapter_id=3, name="sql")
    request = SimpleNamespace(block_hashes=list(vllm_hashes(tokens)), lora_request=lora)
    origin = block_origin(request, 2 * CHUNK, BLOCK)
    assert origin == BlockOrigin(vllm_hashes(tokens)[:4], 3, "sql")
    assert block_origin(SimpleNamespace(), CHUNK, BLOCK) == BlockOrigin(())


@pytest.fixture
def registry():
    return CacheRegistry()


def events_of(registry, dram_chunks: int = 32, events: int = 100) -> WorkerEvents:
    config = {**make_config(dram_chunks=dram_chunks), "events": events}
    entry = registry.acquire("k", lambda: TieredCache.from_config(config))
    return WorkerEvents(entry, max_chunks=64, block_size=BLOCK, chunk_size=CHUNK)


def store(worker: WorkerEvents, tokens: list[int], salt: str | None = None) -> None:
    entry = worker._entry
    kv = make_kv(LAYOUT, len(tokens))
    entry.loop.run(entry.cache.store(tokens, kv, salt=salt), 30)


def save_plan(tokens: list[int], salt: str | None = None) -> StepPlan:
    origin = BlockOrigin(vllm_hashes(tokens))
    return StepPlan(saves=[SaveSpec("r", packed(tokens), salt, (), origin=origin)])


def test_a_saved_chunk_becomes_block_stored_with_its_tokens_and_parent(registry):
    worker = events_of(registry)
    tokens = prompt(0)
    hashes = vllm_hashes(tokens)
    worker.record(save_plan(tokens, salt="tenant"))
    store(worker, tokens, salt="tenant")
    worker.take()  # starts the drain; its events come with the next call
    events = worker.take(wait=30)
    assert events == [
        BlocksStored(
            block_hashes=hashes[2 * i : 2 * i + 2],
            parent_block_hash=hashes[2 * i - 1] if i else None,
            token_ids=tuple(tokens[i * CHUNK : (i + 1) * CHUNK]),
            block_size=BLOCK,
            lora_id=None,
            lora_name=None,
            where=DRAM,
        )
        for i in range(3)
    ]
    assert worker.take_counts() == {"kv_events": 3}
    registry.release(worker._entry)


def test_an_eviction_becomes_block_removed(registry):
    worker = events_of(registry, dram_chunks=3)
    first, second = prompt(0), prompt(1, CHUNK)
    worker.record(save_plan(first))
    worker.record(save_plan(second))
    store(worker, first)
    store(worker, second)  # the DRAM tier holds three chunks: the deepest one goes
    worker.take()
    events = worker.take(wait=30)
    removed = [e for e in events if isinstance(e, BlocksRemoved)]
    assert removed == [BlocksRemoved(block_hashes=vllm_hashes(first)[4:6], where=DRAM)]
    assert isinstance(events[-1], BlocksStored)
    assert events[-1].token_ids == tuple(second)
    registry.release(worker._entry)


def test_loaded_chunks_are_remembered_too(registry):
    worker = events_of(registry)
    tokens = prompt(0)
    load = LoadSpec("r", packed(tokens), None, (), 0, 0, origin=BlockOrigin(vllm_hashes(tokens)))
    worker.record(StepPlan(loads=[load]))
    key = worker._entry.cache.keys(tokens)[1]
    assert worker.name([ChunkRemoved("dram", key, CHUNK)]) == [
        BlocksRemoved(vllm_hashes(tokens)[2:4], DRAM)
    ]
    registry.release(worker._entry)


def test_events_of_chunks_vllm_never_named_are_dropped_and_counted(registry):
    worker = events_of(registry)
    store(worker, prompt(0))  # stored by someone else: no origin recorded
    worker.take()
    assert worker.take(wait=30) == []
    assert worker.name([ChunkStored("dram", b"unknown", CHUNK)]) == []
    assert worker.take_counts() == {"kv_events_unnamed": 4}
    assert worker.take_counts() == {}
    registry.release(worker._entry)


def test_one_rank_passes_events_straight_through():
    quorum: EventQuorum[str] = EventQuorum(num_ranks=1, max_pending=1)
    quorum.add(["a", "b", "a"])
    assert quorum.take() == ["a", "b", "a"]
    assert quorum.take() == []


def test_an_event_passes_once_every_rank_reported_it():
    quorum: EventQuorum[str] = EventQuorum(num_ranks=2, max_pending=8)
    quorum.add(["a", "b", "a"])  # rank 0 reported a and b, rank 1 a
    assert quorum.take() == ["a"]
    quorum.add(["c"])
    assert quorum.take() == []
    quorum.add(["c", "b"])  # rank 1 catches up a step later
    assert quorum.take() == ["c", "b"]


def test_events_a_rank_never_reports_are_dropped_past_the_bound():
    quorum: EventQuorum[str] = EventQuorum(num_ranks=2, max_pending=2)
    quorum.add(["a", "b", "c"])  # rank 0; only two may wait for rank 1
    assert quorum.dropped == 1
    quorum.add(["b", "c"])
    assert quorum.take() == ["b", "c"]
    quorum.add(["a"])  # a came too late: it waits again
    assert quorum.take() == []


def test_events_are_on_only_when_vllm_publishes_and_kvtiers_queues_them(caplog):
    def vllm_config(enabled: bool | None) -> SimpleNamespace:
        events = None if enabled is None else SimpleNamespace(enable_kv_cache_events=enabled)
        return SimpleNamespace(kv_events_config=events)

    queued = ConnectorSettings(config={**make_config(), "events": 16})
    assert kv_events_on(vllm_config(True), queued)
    assert not kv_events_on(vllm_config(False), queued)
    assert not kv_events_on(vllm_config(None), queued)
    assert not kv_events_on(vllm_config(True), ConnectorSettings(config=make_config()))
    assert "`events` is 0" in caplog.text
