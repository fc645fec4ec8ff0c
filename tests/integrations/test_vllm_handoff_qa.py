"""Hostile sequences for the prefill/decode hand-off on the scheduler side.

What vLLM's scheduler can do to a request that carries a producer's announcement: abort
it while it waits, hand it a local prefix hit, preempt it, call it at odd times; and what
a shared tier can do to its lookups: fail, hang, answer partly. Stand-ins only (see
test_vllm_scheduler).
"""

from __future__ import annotations

import random
import time

import pytest

from kvtiers.integrations._vllm_handoff import announce
from kvtiers.integrations._vllm_scheduler import SchedulerSide
from tests.integrations.test_vllm_handoff import consumer_request, side
from tests.integrations.test_vllm_scheduler import Clock, FakeLookup, found, request

BLOCKS = list(range(19))  # 19 blocks of 16 tokens hold the 300-token prompts


def poll(s: SchedulerSide, r, clock: Clock, until: float, step: float = 0.001, computed=0):
    """Ask for `r` every `step` seconds until it is answered or `until`; return the answer."""
    while clock.now <= until:
        answer, _ = s.get_num_new_matched_tokens(r, computed)
        if answer is not None:
            return answer
        clock.now = round(clock.now + step, 6)
    return None


def check_handoff_counts(counts: dict[str, int], announced_requests: int) -> None:
    waits = counts.get("handoff_waits", 0)
    assert waits <= announced_requests
    assert counts.get("handoff_arrived", 0) + counts.get("handoff_timeouts", 0) <= waits


# -- vLLM's side of the sequence -------------------------------------------------------


def test_an_abort_while_waiting_cancels_the_lookup_and_forgets_the_request():
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_poll_ms=10)
    r = consumer_request(256)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    lookup.hit = None  # the next lookup hangs
    clock.now = 0.02
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert s.request_finished(r, ()) == (False, None)
    assert lookup.futures[-1].cancelled()
    counts = s.take_counts()
    assert counts["handoff_waits"] == 1
    assert "handoff_arrived" not in counts and "handoff_timeouts" not in counts
    # The same id coming back (vLLM reuses none, but a client may) starts afresh.
    lookup.hit = 256
    assert s.get_num_new_matched_tokens(consumer_request(256), 0) == (256, False)


def test_an_answer_vllm_could_not_allocate_for_is_kept_without_a_new_lookup():
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer")
    r = consumer_request(256)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    lookup.hit = 256
    clock.now = 0.02
    assert s.get_num_new_matched_tokens(r, 0) == (256, False)
    asked = len(lookup.asked)
    clock.now = 100.0  # no free blocks for a long while: vLLM asks again, steps later
    assert s.get_num_new_matched_tokens(r, 32) == (224, False)
    assert len(lookup.asked) == asked


def test_preemption_after_the_kv_arrived_does_not_wait_again():
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer")
    r = consumer_request(256)
    s.get_num_new_matched_tokens(r, 0)
    lookup.hit, clock.now = 256, 0.02
    assert s.get_num_new_matched_tokens(r, 0) == (256, False)
    s.update_state_after_alloc(r, (BLOCKS,), 256)
    assert len(s.build_plan({"r1": 44}, lambda _: (BLOCKS,)).loads) == 1
    # Preempted: vLLM frees its blocks and asks again with its own (smaller) prefix hit,
    # while the pool has lost the chunks meanwhile.
    lookup.hit, clock.now = 0, 0.03
    assert s.get_num_new_matched_tokens(r, 64) == (0, False)
    s.update_state_after_alloc(r, (), 0)
    lookup.hit = 192
    assert s.get_num_new_matched_tokens(r, 0) == (192, False)  # a fresh lookup
    s.update_state_after_alloc(r, (BLOCKS,), 192)
    (load,) = s.build_plan({"r1": 108}, lambda _: (BLOCKS,)).loads
    assert (load.start, load.end) == (0, 192)
    assert s.take_counts()["handoff_waits"] == 1


def test_after_the_kv_arrived_a_slow_lookup_gets_its_usual_deadline():
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=1, lookup_deadline_s=5)
    r = consumer_request(256)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    lookup.hit, clock.now = 256, 0.02
    assert s.get_num_new_matched_tokens(r, 0) == (256, False)
    s.update_state_after_alloc(r, (BLOCKS,), 256)
    lookup.hit, clock.now = None, 3.0  # preempted long after; the pool is slow now
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    clock.now = 4.0  # past the hand-off's wait, within lookup_deadline_s: still asked
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    lookup.futures[-1].set_result(found(256))
    assert s.get_num_new_matched_tokens(r, 0) == (256, False)
    assert "lookup_timeouts" not in s.take_counts()


def test_local_prefix_hits_covering_the_announcement_are_not_waited_for():
    # The producer announced 128 tokens; vLLM's own prefix cache already holds 192 of the
    # prompt, so there is nothing left to wait for even though the pool has none of it.
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer")
    assert s.get_num_new_matched_tokens(consumer_request(128), 192) == (0, False)
    assert "handoff_waits" not in s.take_counts()


def test_a_local_prefix_hit_that_catches_up_while_waiting_ends_the_wait():
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=5)
    r = consumer_request(128)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    clock.now = 0.05  # another request computed the same prefix meanwhile
    assert poll(s, r, clock, until=0.1, computed=128) == 0
    assert clock.now < 0.1
    # The whole prompt's prefix local: answered at once, whatever the wait.
    r2 = consumer_request(256, num_tokens=300)
    r2.request_id = "r2"
    assert s.get_num_new_matched_tokens(r2, 256) == (0, False)
    counts = s.take_counts()
    assert "handoff_timeouts" not in counts
    check_handoff_counts(counts, 2)


# -- the pool's side --------------------------------------------------------------------


def test_kv_arriving_in_parts_is_waited_for_until_all_of_it_is_there():
    lookup, clock = FakeLookup(hit=64), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_poll_ms=10)
    r = consumer_request(256)
    for now, hit in ((0.0, 64), (0.011, 128), (0.022, 192)):
        clock.now, lookup.hit = now, hit
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    clock.now, lookup.hit = 0.033, 256
    assert s.get_num_new_matched_tokens(r, 0) == (256, False)
    counts = s.take_counts()
    assert counts["handoff_waits"] == 1 and counts["handoff_arrived"] == 1
    assert counts["lookups"] == 4


def test_finding_more_than_announced_is_loaded_in_full():
    s = side(FakeLookup(hit=256), Clock(), "kv_consumer")
    assert s.get_num_new_matched_tokens(consumer_request(128), 0) == (256, False)
    assert "handoff_waits" not in s.take_counts()


def test_failing_lookups_keep_the_request_waiting_then_it_gives_up_in_time():
    lookup, clock = FakeLookup(error=ConnectionResetError("tier down")), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=1, handoff_poll_ms=100)
    r = consumer_request(256)
    assert poll(s, r, clock, until=5.0, step=0.05) == 0
    assert 1.0 <= clock.now <= 1.1
    counts = s.take_counts()
    assert counts["handoff_waits"] == 1 and counts["handoff_timeouts"] == 1
    assert counts["lookup_errors"] == counts["lookups"] <= 11  # one a poll, not one a call


def test_failing_lookups_while_waiting_warn_once(caplog):
    lookup, clock = FakeLookup(error=ConnectionResetError("tier down")), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=1, handoff_poll_ms=10)
    with caplog.at_level("WARNING", logger="kvtiers.vllm"):
        poll(s, consumer_request(256), clock, until=5.0, step=0.01)
    failed = [r for r in caplog.records if "a lookup failed" in r.getMessage()]
    assert len(failed) == 1  # the first; the ~100 during the wait are counted
    assert s.take_counts()["lookup_errors"] > 50


def test_a_failed_last_lookup_keeps_what_earlier_lookups_found():
    lookup, clock = FakeLookup(hit=128), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=1, handoff_poll_ms=400)
    r = consumer_request(256)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    lookup.hit, lookup.error = None, ConnectionResetError("tier down")
    assert poll(s, r, clock, until=5.0, step=0.05) == 128
    assert s.take_counts()["handoff_timeouts"] == 1


def test_a_hung_lookup_while_waiting_ends_with_the_wait():
    # The first lookup misses; the next one hangs. The request gives up when its wait is
    # over, with what it found, not when the hung lookup reaches lookup_deadline_s.
    lookup, clock = FakeLookup(hit=128), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=1, lookup_deadline_s=30)
    r = consumer_request(256)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    lookup.hit = None
    assert poll(s, r, clock, until=40.0, step=0.05) == 128
    assert 1.0 <= clock.now <= 1.1
    assert lookup.futures[-1].cancelled()
    counts = s.take_counts()
    assert counts["handoff_waits"] == 1 and counts["handoff_timeouts"] == 1


def test_a_hung_first_lookup_is_a_miss_at_lookup_deadline_s_then_the_wait_starts():
    lookup, clock = FakeLookup(), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=1, lookup_deadline_s=2)
    r = consumer_request(256)
    lookup_done = poll(s, r, clock, until=10.0, step=0.25)
    assert lookup_done == 0 and 3.0 <= clock.now <= 3.25  # 2 s lookup, then 1 s wait
    counts = s.take_counts()
    assert counts["lookup_timeouts"] >= 1 and counts["handoff_timeouts"] == 1
    check_handoff_counts(counts, 1)


def test_polls_while_waiting_never_block_the_scheduler():
    # Each waiting request is looked up again every poll; vLLM's scheduler thread must not
    # wait lookup_wait_ms on each of them, step after step, while the pool is slow.
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer", lookup_wait_ms=200, handoff_poll_ms=10)
    waiting = [consumer_request(256) for _ in range(4)]
    for i, r in enumerate(waiting):
        r.request_id = f"r{i}"
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    lookup.hit = None  # the pool is slow now: lookups stay pending
    clock.now = 0.02
    started = time.monotonic()
    for r in waiting:
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert time.monotonic() - started < 0.1
    assert len(lookup.futures) == 8
    for future in lookup.futures[4:]:
        future.set_result(found(256))  # the next step finds them done
    assert [s.get_num_new_matched_tokens(r, 0)[0] for r in waiting] == [256] * 4


# -- the clock and the settings ---------------------------------------------------------


def test_many_waiting_requests_keep_their_own_deadlines():
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=1, handoff_poll_ms=50)
    reqs = [consumer_request(256) for _ in range(5)]
    gave_up: dict[int, float] = {}
    while len(gave_up) < 5 and clock.now < 5:
        for i, r in enumerate(reqs):
            r.request_id = f"r{i}"
            arrived_at = i * 0.3  # one request comes every 0.3 s
            if clock.now < arrived_at or i in gave_up:
                continue
            answer, _ = s.get_num_new_matched_tokens(r, 0)
            assert answer in (None, 0)
            if answer == 0:
                gave_up[i] = clock.now - arrived_at
        clock.now = round(clock.now + 0.01, 6)
    assert len(gave_up) == 5
    assert all(1.0 <= waited <= 1.06 for waited in gave_up.values()), gave_up
    counts = s.take_counts()
    assert counts["handoff_waits"] == counts["handoff_timeouts"] == 5


def test_a_clock_jump_past_the_deadline_gives_up_at_the_next_call():
    lookup, clock = FakeLookup(hit=64), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=1)
    r = consumer_request(256)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    clock.now = 3600.0  # the engine was stalled, or the host suspended
    assert s.get_num_new_matched_tokens(r, 0) == (64, False)
    assert s.take_counts()["handoff_timeouts"] == 1


def test_a_poll_longer_than_the_wait_still_gives_up_at_handoff_wait_s():
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=0.5, handoff_poll_ms=10_000)
    r = consumer_request(256)
    assert poll(s, r, clock, until=20.0, step=0.05) == 0
    assert clock.now <= 0.55


def test_no_wait_and_no_pause_answer_at_once():
    lookup, clock = FakeLookup(hit=64), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=0, handoff_poll_ms=0)
    assert s.get_num_new_matched_tokens(consumer_request(256), 0) == (64, False)
    check_handoff_counts(s.take_counts(), 1)
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=1, handoff_poll_ms=0)
    r = consumer_request(256)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # looks again at once
    assert len(lookup.asked) == 3


# -- what arrives in kv_transfer_params -------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        [("kvtiers", {"stored_tokens": 256})],
        "kvtiers",
        b"kvtiers",
        42,
        {"other": {"kvtiers": {"stored_tokens": 256}}},
    ],
)
def test_params_of_other_shapes_are_not_ours(params):
    s = side(FakeLookup(hit=0), Clock(), "kv_consumer")
    assert s.get_num_new_matched_tokens(request(kv_transfer_params=params), 0) == (0, False)
    assert s.take_counts().keys() == {"lookups", "lookup_tokens"}


@pytest.mark.parametrize(
    "entry",
    [
        [256],
        "256",
        {"stored_tokens": 256.0},
        {"stored_tokens": "256"},
        {"stored_tokens": None},
        {"stored_tokens": -(10**5000)},  # too long to print: still a clean ValueError
        {"stored_tokens": {"n": 256}},
    ],
)
def test_malformed_entries_are_counted_once_and_never_awaited(entry):
    s = side(FakeLookup(hit=0), Clock(), "kv_consumer")
    r = request(kv_transfer_params={"kvtiers": entry})
    s.on_new_request(r)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    counts = s.take_counts()
    assert counts["handoff_bad_params"] == 1 and "handoff_waits" not in counts


def test_a_huge_announcement_waits_only_for_the_prompt():
    lookup, clock = FakeLookup(hit=192), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=0.1)
    r = consumer_request(10**400)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    lookup.hit, clock.now = 256, 0.05
    assert s.get_num_new_matched_tokens(r, 0) == (256, False)


def test_requests_kvtiers_cannot_key_do_not_wait_for_an_announcement():
    lookup = FakeLookup(hit=0)
    s = side(lookup, Clock(), "kv_consumer")
    r = request(kv_transfer_params=announce(256), mm_features=["image"])
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert lookup.asked == [] and not s.take_counts()


# -- the producer ------------------------------------------------------------------------


def test_a_producer_aborted_mid_prefill_announces_only_the_chunks_it_saved():
    s = side(FakeLookup(hit=0), Clock(), "kv_producer")
    r = request(num_tokens=300)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, (), 0)
    assert s.request_finished(r, (BLOCKS,)) == (False, None)  # aborted before any step
    r = request("r2", num_tokens=300)
    s.on_new_request(r)
    (save,) = s.build_plan({"r2": 200}, lambda _: (BLOCKS,)).saves  # chunked prefill, part 1
    assert (save.start, len(save.tokens) // 8) == (0, 192)
    assert s.request_finished(r, (BLOCKS,)) == (False, announce(192))


def test_a_producer_storing_generated_tokens_announces_all_it_holds():
    s = side(FakeLookup(hit=0), Clock(), "kv_producer", store_generated=True)
    short = request("short", num_tokens=40)
    s.on_new_request(short)
    s.build_plan({"short": 40}, lambda _: ([0, 1, 2],))
    short.num_computed_tokens, short.num_tokens = 40, 41
    assert s.request_finished(short, ([0, 1, 2],)) == (False, None)  # under a chunk
    long = request("long", num_tokens=300)
    s.on_new_request(long)
    (save,) = s.build_plan({"long": 300}, lambda _: (BLOCKS,)).saves
    long.all_token_ids += [7] * 21  # 21 tokens generated; the last one not computed
    long.num_tokens, long.num_computed_tokens = 321, 320
    assert s.request_finished(long, (BLOCKS + [19, 20],)) == (True, announce(320))
    (finished,) = s.build_plan({}, lambda _: None).saves
    assert finished.finished and finished.start == 256
    assert finished.block_ids == (tuple(range(16, 20)),)


def test_a_producer_whose_lookup_found_the_prompt_announces_it_without_saving():
    s = side(FakeLookup(hit=256), Clock(), "kv_producer", store_generated=True)
    r = request(num_tokens=300)
    assert s.get_num_new_matched_tokens(r, 0) == (256, False)
    s.update_state_after_alloc(r, (BLOCKS,), 256)
    assert not s.build_plan({"r1": 44}, lambda _: (BLOCKS,)).saves
    r.num_computed_tokens = 300
    assert s.request_finished(r, (BLOCKS,)) == (False, announce(256))


# -- counters over a random run -----------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_counters_stay_consistent_over_a_random_run(seed):
    rng = random.Random(seed)
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_both", handoff_wait_s=0.2, handoff_poll_ms=20)
    live: dict[str, object] = {}
    arrives_at: dict[str, float] = {}
    announced = 0
    totals: dict[str, int] = {}
    for step in range(400):
        clock.now = round(step * 0.005, 6)
        if rng.random() < 0.2:
            rid = f"r{step}"
            params = rng.choice([announce(rng.choice([0, 64, 256])), None, {"kvtiers": 1}])
            live[rid] = request(rid, num_tokens=300, kv_transfer_params=params)
            arrives_at[rid] = clock.now + rng.uniform(0, 0.4)
            announced += isinstance(params, dict) and params["kvtiers"] != 1
        for rid, r in list(live.items()):
            if rng.random() < 0.05:
                s.request_finished(r, ())
                del live[rid]
                continue
            lookup.hit = 256 if clock.now >= arrives_at[rid] else rng.choice([0, 64])
            answer, _ = s.get_num_new_matched_tokens(r, 0)
            if answer is not None:
                s.update_state_after_alloc(r, (BLOCKS,), answer)
                s.request_finished(r, (BLOCKS,))
                del live[rid]
        for name, value in s.take_counts().items():
            totals[name] = totals.get(name, 0) + value
        check_handoff_counts(totals, announced)
