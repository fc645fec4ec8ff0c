from kvtiers.eviction import LRUPolicy, make_policy
from kvtiers.testing.eviction import EvictionPolicyTests


class TestLRUPolicy(EvictionPolicyTests):
    policy_cls = LRUPolicy


def test_candidates_are_least_recently_used_first():
    policy = LRUPolicy(4)
    for key in "abcd":
        policy.insert(key)
    assert list(policy.candidates()) == ["a", "b", "c", "d"]


def test_touch_moves_to_most_recent():
    policy = LRUPolicy(4)
    for key in "abcd":
        policy.insert(key)
    policy.touch("a")
    policy.touch("c")
    assert list(policy.candidates()) == ["b", "d", "a", "c"]


def test_reinsert_moves_to_most_recent():
    policy = LRUPolicy(4)
    for key in "abc":
        policy.insert(key)
    policy.insert("a")
    assert list(policy.candidates()) == ["b", "c", "a"]


def test_evicted_keeps_order_of_the_rest():
    policy = LRUPolicy(4)
    for key in "abcd":
        policy.insert(key)
    policy.evicted("b")
    policy.remove("d")
    assert list(policy.candidates()) == ["a", "c"]


def test_evicted_key_comes_back_as_most_recent():
    policy = LRUPolicy(3)
    for key in "abc":
        policy.insert(key)
    policy.evicted("a")
    policy.insert("a")
    assert list(policy.candidates()) == ["b", "c", "a"]


def test_make_policy_builds_lru():
    policy = make_policy("lru", 8)
    assert isinstance(policy, LRUPolicy)
    assert policy.capacity == 8
