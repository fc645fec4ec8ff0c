"""The scheduler side of the vLLM connector, driven with stand-in requests."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest

from kvtiers import ConfigError, LookupResult
from kvtiers.integrations._vllm_handoff import Role
from kvtiers.integrations._vllm_plan import (
    BlockOrigin,
    ConnectorSettings,
    chunk_size_for,
    tokens_of,
)
from kvtiers.integrations._vllm_scheduler import SchedulerSide
from kvtiers.integrations._vllm_tracked import salt_of

BLOCK, CHUNK = 16, 64


def request(req_id="r1", num_tokens=300, **extra):
    tokens = list(range(100, 100 + num_tokens))
    fields = dict(
        request_id=req_id,
        all_token_ids=tokens,
        num_tokens=num_tokens,
        num_prompt_tokens=num_tokens,
        num_computed_tokens=0,
        cache_salt=None,
        lora_request=None,
        mm_features=[],
        prompt_embeds=None,
    )
    fields.update(extra)
    return SimpleNamespace(**fields)


class FakeLookup:
    """Lookups that answer `hit` (in `tier`), or stay pending (a slow tier)."""

    def __init__(self, hit=None, error=None, tier="dram"):
        self.hit, self.error, self.tier = hit, error, tier
        self.asked: list = []
        self.futures: list[concurrent.futures.Future] = []

    def __call__(self, tokens, salt):
        self.asked.append((tokens.tolist(), salt))
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.error is not None:
            future.set_exception(self.error)
        elif self.hit is not None:
            future.set_result(found(self.hit, self.tier))
        self.futures.append(future)
        return future


def found(hit, tier="dram"):
    """A lookup's answer: `hit` tokens, every chunk in `tier`."""
    return LookupResult(hit, (tier,) * (hit // CHUNK))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def side(
    lookup, clock=None, kv_role="kv_both", *, kv_events=False, block=BLOCK, chunk=CHUNK, **settings
):
    """A scheduler side on `lookup`; the scheduler, hand-off and prompt tests share it."""
    settings.setdefault("lookup_wait_ms", 0)
    return SchedulerSide(
        ConnectorSettings(**settings),
        block,
        chunk,
        lambda: lookup,
        clock=clock or Clock(),
        kv_events=kv_events,
        role=Role.of(kv_role),
    )


def test_answers_beyond_what_vllm_computed_and_never_the_last_token():
    lookup = FakeLookup(hit=256)
    s = side(lookup)
    r = request(num_tokens=257)
    assert s.get_num_new_matched_tokens(r, 0) == (256, False)
    assert lookup.asked[0][0] == r.all_token_ids[:256]
    assert s.get_num_new_matched_tokens(r, 128) == (128, False)  # no second lookup
    assert len(lookup.asked) == 1
    whole = request("r2", num_tokens=256)  # every chunk cached: all but the last token
    assert s.get_num_new_matched_tokens(whole, 0) == (255, False)
    assert lookup.asked[1][0] == whole.all_token_ids[:256]
    assert s.get_num_new_matched_tokens(whole, 240) == (15, False)
    assert s.get_num_new_matched_tokens(whole, 255) == (0, False)
    short = request("r3", num_tokens=63)
    assert s.get_num_new_matched_tokens(short, 0) == (0, False)  # no full chunk to offer
    assert len(lookup.asked) == 2


def test_a_whole_cached_prompt_loads_its_last_block_too():
    s = side(FakeLookup(hit=128))
    r = request(num_tokens=128)
    assert s.get_num_new_matched_tokens(r, 0) == (127, False)
    blocks = list(range(500, 508))
    s.update_state_after_alloc(r, (blocks,), 127)
    (load,) = s.build_plan({}, lambda _: None).loads
    assert (load.start, load.end) == (0, 128)
    assert load.block_ids == (tuple(blocks),)
    assert not s.build_plan({"r1": 1}, lambda _: (blocks,)).saves  # already stored


def test_a_slow_lookup_asks_again_later_then_gives_up():
    clock = Clock()
    lookup = FakeLookup()  # never finishes by itself
    s = side(lookup, clock, lookup_deadline_s=5.0)
    r = request()
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    clock.now = 1.0
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert len(lookup.asked) == 1  # the same lookup is awaited, not restarted
    plan = s.build_plan({}, lambda _: None)
    assert plan.idle and plan.waiting  # the workers may pause this empty step
    lookup.futures[0].set_result(found(128))
    assert s.get_num_new_matched_tokens(r, 0) == (128, False)
    assert not s.build_plan({}, lambda _: None).waiting
    r2 = request("r2")
    assert s.get_num_new_matched_tokens(r2, 0) == (None, False)
    clock.now = 10.0
    assert s.get_num_new_matched_tokens(r2, 0) == (0, False)  # past the deadline: a miss
    assert lookup.futures[1].cancelled()
    counts = s.take_counts()
    assert counts["lookup_timeouts"] == 1 and counts["lookup_retries"] == 3


def test_a_failed_lookup_is_a_miss():
    s = side(FakeLookup(error=ConnectionRefusedError("no worker")))
    assert s.get_num_new_matched_tokens(request(), 0) == (0, False)
    assert s.take_counts()["lookup_errors"] == 1


def test_requests_kvtiers_cannot_key_are_never_looked_up():
    lookup = FakeLookup(hit=256)
    s = side(lookup)
    assert s.get_num_new_matched_tokens(request(mm_features=["image"]), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request("r2", prompt_embeds=object()), 0) == (0, False)
    assert lookup.asked == []


def test_salts_separate_tenants_and_adapters():
    assert salt_of(request()) is None
    assert salt_of(request(cache_salt="a")) != salt_of(request(cache_salt="b"))
    lora = SimpleNamespace(lora_name="adapter")
    assert salt_of(request(lora_request=lora)) != salt_of(request())


def test_accepted_tokens_become_a_load_of_whole_blocks():
    s = side(FakeLookup(hit=256))
    r = request()
    assert s.get_num_new_matched_tokens(r, 64) == (192, False)
    blocks = list(range(1000, 1019))  # 19 blocks of 16 tokens hold 300 tokens
    s.update_state_after_alloc(r, (blocks,), 192)
    plan = s.build_plan({}, lambda _: None)
    (load,) = plan.loads
    assert (load.start, load.end) == (64, 256)
    assert load.block_ids == (tuple(blocks[4:16]),)
    assert tokens_of(load.tokens).tolist() == r.all_token_ids[:256]
    assert not s.build_plan({}, lambda _: None)  # a plan is handed out once


def test_an_accepted_load_is_counted_by_the_tier_of_each_chunk():
    lookup = FakeLookup()
    s = side(lookup)
    r, whole = request(), request("whole", num_tokens=256)
    for req, computed in ((r, 80), (whole, 0)):
        assert s.get_num_new_matched_tokens(req, computed) == (None, False)
        lookup.futures[-1].set_result(LookupResult(256, ("dram", "dram", "lmdb", "pool")))
    # vLLM holds 80 tokens itself: the load starts inside the second chunk.
    assert s.get_num_new_matched_tokens(r, 80) == (176, False)
    s.update_state_after_alloc(r, (list(range(19)),), 176)
    assert s.take_load_tiers(r) == {"dram": 48, "lmdb": 64, "pool": 64}
    assert s.take_load_tiers(r) == {}  # taken once
    # A prompt cached whole: vLLM computes its last token, which is not counted.
    assert s.get_num_new_matched_tokens(whole, 0) == (255, False)
    s.update_state_after_alloc(whole, (list(range(16)),), 255)
    assert s.take_load_tiers(whole) == {"dram": 128, "lmdb": 64, "pool": 63}
    assert s.take_load_tiers(request("unknown")) == {}


def test_a_hit_longer_than_its_named_tiers_counts_the_rest_as_unknown():
    # A hand-off's answer can come from an earlier lookup than the tiers do.
    lookup = FakeLookup()
    s = side(lookup)
    r = request()
    s.get_num_new_matched_tokens(r, 0)
    lookup.futures[-1].set_result(LookupResult(192, ("lmdb",)))
    assert s.get_num_new_matched_tokens(r, 0) == (192, False)
    s.update_state_after_alloc(r, (list(range(19)),), 192)
    assert s.take_load_tiers(r) == {"lmdb": 64, "": 128}


def test_nothing_is_loaded_when_vllm_takes_no_external_tokens():
    s = side(FakeLookup(hit=256))
    r = request()
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, (), 0)
    assert not s.build_plan({}, lambda _: None).loads


def test_each_step_saves_the_prompt_chunks_its_forward_pass_completes():
    s = side(FakeLookup(hit=0))
    r = request(num_tokens=300)  # four full chunks (256 tokens) and a 44-token tail
    s.on_new_request(r)
    blocks = (list(range(19)), list(range(100, 119)))  # two KV-cache groups
    (first,) = s.build_plan({"r1": 200}, lambda _: blocks).saves  # chunked prefill, part 1
    assert tokens_of(first.tokens).tolist() == r.all_token_ids[:192]
    assert first.start == 0
    assert first.block_ids == (tuple(range(12)), tuple(range(100, 112)))
    r.num_computed_tokens = 200
    (save,) = s.build_plan({"r1": 100}, lambda _: blocks).saves
    assert tokens_of(save.tokens).tolist() == r.all_token_ids[:256]
    assert save.start == 192 and not save.finished
    assert save.block_ids == (tuple(range(12, 16)), tuple(range(112, 116)))
    r.num_computed_tokens = 300
    assert not s.build_plan({"r1": 1}, lambda _: blocks).saves  # saved once


def test_a_reset_forgets_answers_and_requests_live_then_save_nothing_more():
    lookup = FakeLookup(hit=128)
    s = side(lookup, store_generated=True)
    live, pending, finished = request("live"), request("pending"), request("finished")
    assert s.get_num_new_matched_tokens(live, 0) == (128, False)  # answered, not allocated
    lookup.hit = None
    assert s.get_num_new_matched_tokens(pending, 0) == (None, False)  # lookup in flight
    s.on_new_request(finished)
    finished.num_computed_tokens = 300
    assert s.request_finished(finished, (list(range(19)),)) == (True, None)  # a save planned
    s.reset()
    assert lookup.futures[-1].cancelled()
    plan = s.build_plan({}, lambda _: None)
    assert not plan.saves  # the planned save is dropped, and its request reported finished
    assert plan.released == ["finished"] and plan
    # The live requests' KV may predate the reset: none of it is saved any more.
    blocks = (list(range(19)),)
    assert not s.build_plan({"live": 300, "pending": 300}, lambda _: blocks).saves
    # Their next questions are looked up afresh (what is stored after the reset loads).
    lookup.hit = 64
    assert s.get_num_new_matched_tokens(live, 0) == (64, False)
    live.num_computed_tokens = 300
    assert s.request_finished(live, blocks) == (False, None)  # no save of generated tokens
    # A request that arrives after the reset is saved as usual.
    fresh = request("fresh")
    s.on_new_request(fresh)
    assert s.build_plan({"fresh": 300}, lambda _: blocks).saves
    assert s.take_counts()["resets"] == 1


def test_chunks_kvtiers_already_holds_are_not_saved_again():
    s = side(FakeLookup(hit=256))
    r = request()
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, (list(range(19)),), 256)
    plan = s.build_plan({"r1": 44}, lambda _: (list(range(19)),))
    assert plan.loads and not plan.saves


def test_generated_tokens_are_saved_at_finish_only_when_configured():
    r = request(num_tokens=300)
    r.num_prompt_tokens = 200
    r.num_computed_tokens = 299
    plain = side(FakeLookup(hit=0))
    plain.on_new_request(r)
    assert plain.request_finished(r, (list(range(19)),)) == (False, None)
    keeping = side(FakeLookup(hit=0), store_generated=True)
    keeping.on_new_request(r)
    assert keeping.request_finished(r, (list(range(19)),)) == (True, None)
    (save,) = keeping.build_plan({}, lambda _: None).saves
    assert save.finished and len(tokens_of(save.tokens)) == 256
    assert save.start == 0 and save.block_ids == (tuple(range(16)),)


def test_settings_are_validated_by_name():
    with pytest.raises(ConfigError, match="kv_connector_extra_config.chunksize"):
        ConnectorSettings.from_extra({"chunksize": 64})
    with pytest.raises(ConfigError, match="lookup_wait_ms"):
        ConnectorSettings.from_extra({"lookup_wait_ms": -1})
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="load_timeout_s: expected a non-negative finite"):
            ConnectorSettings.from_extra({"load_timeout_s": bad})
    with pytest.raises(ConfigError, match="on_load_error"):
        ConnectorSettings.from_extra({"on_load_error": "ignore"})
    with pytest.raises(ConfigError, match="event_chunks: expected a positive integer"):
        ConnectorSettings.from_extra({"event_chunks": 0})
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="staging_keep_mib: expected a non-negative"):
            ConnectorSettings.from_extra({"staging_keep_mib": bad})
    assert ConnectorSettings.from_extra({"staging_keep_mib": 0}).staging_keep_mib == 0
    assert ConnectorSettings.from_extra(None).tiers_source()["tiers"][0]["kind"] == "dram"


def test_chunk_size_follows_the_block_size():
    assert chunk_size_for(16, None) == 256
    assert chunk_size_for(128, None) == 256
    assert chunk_size_for(48, None) == 240
    assert chunk_size_for(512, None) == 512
    assert chunk_size_for(32, 64) == 64
    with pytest.raises(ConfigError, match="multiple of vLLM's block size 32"):
        chunk_size_for(32, 80)


def test_loads_and_saves_carry_vllm_block_hashes_only_with_kv_events():
    hashes = [bytes([i]) * 32 for i in range(18)]  # the full blocks of 300 tokens
    lora = SimpleNamespace(lora_name="sql", adapter_id=4, name="sql")
    settings = ConnectorSettings(lookup_wait_ms=0, store_generated=True)
    s = SchedulerSide(settings, BLOCK, CHUNK, lambda: FakeLookup(hit=128), kv_events=True)
    loaded = request(block_hashes=hashes, lora_request=lora)
    s.get_num_new_matched_tokens(loaded, 0)
    s.update_state_after_alloc(loaded, (list(range(19)),), 128)
    saved = request("r2", block_hashes=hashes)
    s.on_new_request(saved)
    plan = s.build_plan({"r2": 300}, lambda _: (list(range(19)),))
    assert plan.loads[0].origin == BlockOrigin(tuple(hashes[:8]), 4, "sql")
    assert plan.saves[0].origin == BlockOrigin(tuple(hashes[:16]))
    plain = side(FakeLookup(hit=128))
    plain.get_num_new_matched_tokens(loaded, 0)
    plain.update_state_after_alloc(loaded, (list(range(19)),), 128)
    assert plain.build_plan({}, lambda _: None).loads[0].origin is None


def test_hybrid_loads_are_asynchronous_and_a_failed_one_is_not_retried():
    """With several KV-cache groups vLLM takes no block-level load errors, so loads are
    asynchronous; a request whose load failed is recomputed whole and loads nothing
    more (a lookup would find the same chunks again)."""
    settings = ConnectorSettings(lookup_wait_ms=0)
    s = SchedulerSide(settings, BLOCK, CHUNK, lambda: FakeLookup(hit=256), async_loads=True)
    r = request()
    assert s.get_num_new_matched_tokens(r, 0) == (256, True)
    blocks = (list(range(19)), [0] * 12 + list(range(200, 207)))  # window: nulls behind it
    s.update_state_after_alloc(r, blocks, 256)
    plan = s.build_plan({}, lambda _: None)  # the request waits for its chunks
    (load,) = plan.loads
    assert load.block_ids == (tuple(range(16)), (0,) * 12 + tuple(range(200, 204)))
    assert plan.idle  # no token computed: the workers may wait for the load
    assert not s.build_plan({"r9": 1}, lambda _: None).idle
    s.load_failed({"r1", "unknown"})
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.take_counts()["load_failed_requests"] == 1
    other = request("r2")
    assert s.get_num_new_matched_tokens(other, 0) == (256, True)
    assert s.get_num_new_matched_tokens(request("r3", num_tokens=40), 0) == (0, False)


def test_a_sliding_window_bounds_the_chunk_size():
    """Every block of a chunk must still be allocated in the step that completes it:
    `chunk <= window + block - 1`."""
    assert chunk_size_for(16, None, window=64) == 64
    assert chunk_size_for(16, None, window=4096) == 256
    assert chunk_size_for(32, None, window=64) == 64
    assert chunk_size_for(32, None, window=65) == 96
    assert chunk_size_for(16, None, window=8) == 16  # at least one block
    assert chunk_size_for(16, 64, window=64) == 64
    with pytest.raises(ConfigError, match="exceeds 64.*64-token sliding window"):
        chunk_size_for(16, 128, window=64)


def test_chunked_local_attention_needs_a_chunk_that_divides_the_attention_chunk():
    """vLLM frees a request's blocks of earlier attention chunks: a chunk dividing the
    attention chunk never straddles that boundary, so its blocks are live when saved."""
    assert chunk_size_for(32, None, attention_chunk=8192) == 256  # Llama 4
    assert chunk_size_for(32, None, attention_chunk=192) == 192
    assert chunk_size_for(32, None, attention_chunk=96) == 96
    assert chunk_size_for(32, None, attention_chunk=320) == 160  # the largest <= 256
    assert chunk_size_for(16, None, window=64, attention_chunk=192) == 64
    assert chunk_size_for(32, 64, attention_chunk=192) == 64
    with pytest.raises(ConfigError, match="128 does not divide 192"):
        chunk_size_for(32, 128, attention_chunk=192)
    with pytest.raises(ConfigError, match="block size 32 does not divide 48"):
        chunk_size_for(32, None, attention_chunk=48)
