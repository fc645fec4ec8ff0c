"""Prefill/decode hand-off through the pool: roles, announcements, a consumer's wait.

Driven with the stand-in requests of test_vllm_scheduler; the real-engine hand-off is
`test_vllm_engine.py::test_prefill_and_decode_instances_hand_off_through_the_pool`.
"""

from __future__ import annotations

import pytest

from kvtiers import ConfigError
from kvtiers.integrations._vllm_handoff import (
    RequestParams,
    Role,
    announce,
    announced_tokens,
    request_params,
)
from kvtiers.integrations._vllm_plan import ConnectorSettings, tokens_of
from tests.integrations.test_vllm_scheduler import Clock, FakeLookup, request, side


def consumer_request(announced, num_tokens=300):
    return request(num_tokens=num_tokens, kv_transfer_params=announce(announced))


def test_roles_follow_vllm_kv_role():
    assert Role.of("kv_both") == Role(saves=True, announces=False)
    assert Role.of(None) == Role(saves=True, announces=False)
    assert Role.of("kv_producer") == Role(saves=True, announces=True)
    assert Role.of("kv_consumer") == Role(saves=False, announces=False)
    with pytest.raises(ConfigError, match="kv_role: expected one of"):
        Role.of("kv_decoder")


@pytest.mark.parametrize(
    "params, expected",
    [
        (None, None),
        ({}, None),
        ({"do_remote_decode": True}, None),  # another connector's params
        (announce(256), 256),
        ({"kvtiers": {"stored_tokens": 0}}, 0),
    ],
)
def test_announced_tokens_are_read_from_kv_transfer_params(params, expected):
    assert announced_tokens(params) == expected


@pytest.mark.parametrize(
    "entry", [None, 256, "256", {}, {"stored_tokens": -1}, {"stored_tokens": True}, {"x": 1}]
)
def test_a_malformed_announcement_is_a_value_error(entry):
    with pytest.raises(ValueError, match="stored_tokens"):
        announced_tokens({"kvtiers": entry})


@pytest.mark.parametrize(
    "params, expected",
    [
        (None, RequestParams()),
        ({"kvtiers": {"keep_tokens": 0}}, RequestParams(keep_tokens=0)),
        ({"kvtiers": {"stored_tokens": 64, "keep_tokens": 128}}, RequestParams(64, 128)),
    ],
)
def test_a_reuse_hint_rides_in_the_same_entry(params, expected):
    assert request_params(params) == expected
    assert announced_tokens(params) == expected.stored_tokens


@pytest.mark.parametrize("entry", [{"keep_tokens": -1}, {"keep_tokens": 1.5}, {"keep": 0}])
def test_a_malformed_hint_is_a_value_error(entry):
    with pytest.raises(ValueError, match="'keep_tokens': <int >= 0>"):
        request_params({"kvtiers": entry})


def test_a_requests_hint_goes_with_each_of_its_saves_and_a_bad_one_is_counted():
    s = side(FakeLookup(hit=0), store_generated=True)
    hinted = request("r1", num_tokens=300, kv_transfer_params={"kvtiers": {"keep_tokens": 70}})
    bad = request("r2", num_tokens=300, kv_transfer_params={"kvtiers": {"keep_tokens": "x"}})
    for r in (hinted, bad):
        s.on_new_request(r)
    saves = s.build_plan({"r1": 200, "r2": 200}, lambda _: (list(range(19)),)).saves
    assert [(x.req_id, x.keep_tokens) for x in saves] == [("r1", 70), ("r2", None)]
    hinted.num_computed_tokens = 299
    assert s.request_finished(hinted, (list(range(19)),)) == (True, None)
    (final,) = s.build_plan({}, lambda _: None).saves
    assert final.finished and final.keep_tokens == 70
    assert s.take_counts()["handoff_bad_params"] == 1


def test_a_consumer_waits_for_announced_kv_then_loads_it():
    lookup, clock = FakeLookup(hit=0), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_poll_ms=10)
    r = consumer_request(256)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # within the poll: no lookup
    assert len(lookup.asked) == 1
    clock.now = 0.011
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # looked again: still missing
    assert len(lookup.asked) == 2
    lookup.hit = 256  # the producer's saves reach the pool
    clock.now = 0.03
    assert s.get_num_new_matched_tokens(r, 0) == (256, False)
    assert s.take_counts() == {
        "lookups": 3,
        "lookup_tokens": 3 * 256,
        "lookup_hit_tokens": 256,
        "handoff_waits": 1,
        "handoff_arrived": 1,
        "handoff_wait_ms": 30,  # from the first short lookup to the one that found it all
    }


def test_a_consumer_stops_waiting_after_handoff_wait_s_and_takes_what_it_found():
    lookup, clock = FakeLookup(hit=128), Clock()
    s = side(lookup, clock, "kv_consumer", handoff_wait_s=2, handoff_poll_ms=500)
    r = consumer_request(256)
    for now in (0.0, 0.6, 1.2, 1.8):
        clock.now = now
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    clock.now = 2.4
    assert s.get_num_new_matched_tokens(r, 0) == (128, False)
    counts = s.take_counts()
    assert counts["handoff_waits"] == 1 and counts["handoff_timeouts"] == 1
    assert "handoff_arrived" not in counts
    # Once given up, the request waits no more: its next lookup is answered at once.
    s.update_state_after_alloc(r, (list(range(19)),), 128)
    clock.now = 2.5
    assert s.get_num_new_matched_tokens(r, 128) == (0, False)


def test_without_an_announcement_a_miss_is_answered_at_once():
    for params in (None, {"do_remote_decode": True}):
        s = side(FakeLookup(hit=0), Clock(), "kv_consumer")
        assert s.get_num_new_matched_tokens(request(kv_transfer_params=params), 0) == (0, False)
        assert "handoff_waits" not in s.take_counts()


def test_announced_tokens_beyond_the_prompt_whole_chunks_are_not_awaited():
    s = side(FakeLookup(hit=256), Clock(), "kv_consumer")
    assert s.get_num_new_matched_tokens(consumer_request(10_000), 0) == (256, False)
    assert "handoff_waits" not in s.take_counts()


def test_a_malformed_announcement_is_counted_and_not_awaited():
    s = side(FakeLookup(hit=0), Clock(), "kv_consumer")
    r = request(kv_transfer_params={"kvtiers": {"stored_tokens": "all"}})
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.take_counts()["handoff_bad_params"] == 1


def test_a_kv_both_engine_also_waits_for_an_announcement():
    lookup = FakeLookup(hit=0)
    s = side(lookup, Clock(), "kv_both")
    assert s.get_num_new_matched_tokens(consumer_request(256), 0) == (None, False)


def test_a_consumer_plans_no_save_and_announces_nothing():
    s = side(FakeLookup(hit=0), Clock(), "kv_consumer")
    r = request()
    s.on_new_request(r)
    assert not s.build_plan({"r1": 300}, lambda _: (list(range(19)),)).saves
    assert s.request_finished(r, (list(range(19)),)) == (False, None)


def test_a_producer_announces_the_prompt_tokens_it_stored():
    s = side(FakeLookup(hit=0), Clock(), "kv_producer")
    r = request(num_tokens=300)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    (save,) = s.build_plan({"r1": 300}, lambda _: (list(range(19)),)).saves
    assert len(tokens_of(save.tokens)) == 256
    assert s.request_finished(r, (list(range(19)),)) == (False, announce(256))


def test_a_producer_announces_what_it_found_too_and_nothing_for_a_short_prompt():
    s = side(FakeLookup(hit=256), Clock(), "kv_producer")
    found = request(num_tokens=300)
    s.get_num_new_matched_tokens(found, 0)
    s.update_state_after_alloc(found, (list(range(19)),), 256)
    assert not s.build_plan({"r1": 44}, lambda _: (list(range(19)),)).saves
    assert s.request_finished(found, (list(range(19)),)) == (False, announce(256))
    short = request("r2", num_tokens=40)  # less than one chunk: nothing to hand off
    s.on_new_request(short)
    s.build_plan({"r2": 40}, lambda _: (list(range(3)),))
    assert s.request_finished(short, (list(range(3)),)) == (False, None)


def test_a_producer_storing_generated_tokens_announces_them():
    s = side(FakeLookup(hit=0), Clock(), "kv_producer", store_generated=True)
    r = request(num_tokens=300)
    r.num_prompt_tokens, r.num_computed_tokens = 200, 299
    s.on_new_request(r)
    assert s.request_finished(r, (list(range(19)),)) == (True, announce(256))


@pytest.mark.parametrize("name", ["handoff_wait_s", "handoff_poll_ms"])
@pytest.mark.parametrize("bad", [-1, float("inf"), "5", True])
def test_handoff_settings_are_checked(name, bad):
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{name}"):
        ConnectorSettings.from_extra({name: bad})
