from collections.abc import Hashable, Sequence

import pytest

from kvtiers.eviction import (
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    available_policies,
    make_policy,
)
from kvtiers.eviction.arc import ARCListSizes
from kvtiers.testing.eviction import EvictionPolicyTests


class TestARCPolicy(EvictionPolicyTests):
    policy_cls = ARCPolicy

    def check_invariants(self, policy: EvictionPolicy) -> None:
        assert isinstance(policy, ARCPolicy)
        c = policy.capacity
        t1, t2, b1, b2 = policy.list_sizes()
        assert t1 + t2 == len(policy)
        assert t1 + b1 <= c
        assert t1 + t2 + b1 + b2 <= 2 * c
        assert 0 <= policy.p <= c
        ghosts = list(policy.ghosts())
        assert len(ghosts) == b1 + b2
        assert len(set(ghosts)) == len(ghosts)
        assert not any(key in policy for key in ghosts)
        assert set(ghosts).isdisjoint(policy.candidates())


def _filled(capacity: int, keys: str) -> ARCPolicy:
    policy = ARCPolicy(capacity)
    for key in keys:
        policy.insert(key)
    return policy


def test_new_keys_go_to_t1_and_hits_to_t2():
    policy = _filled(4, "abc")
    assert policy.list_sizes() == ARCListSizes(t1=3, t2=0, b1=0, b2=0)
    policy.touch("b")
    assert policy.list_sizes() == ARCListSizes(t1=2, t2=1, b1=0, b2=0)
    policy.touch("b")
    policy.insert("a")  # a resident key: a hit, not a new entry
    assert policy.list_sizes() == ARCListSizes(t1=1, t2=2, b1=0, b2=0)


def test_evicted_keys_become_ghosts_of_their_list():
    policy = _filled(4, "abcd")
    policy.touch("d")
    policy.evicted("a")
    policy.evicted("d")
    assert policy.list_sizes() == ARCListSizes(t1=2, t2=0, b1=1, b2=1)
    assert list(policy.ghosts()) == ["a", "d"]


def test_ghost_hit_in_b1_raises_p_and_enters_t2():
    policy = _filled(4, "abcd")
    policy.evicted("a")
    assert policy.p == 0
    policy.insert("a")
    assert policy.p == 1  # |B2| / |B1| = 0, so the step is 1
    assert policy.list_sizes() == ARCListSizes(t1=3, t2=1, b1=0, b2=0)
    assert list(policy.candidates())[-1] == "a"


def test_ghost_hit_in_b1_steps_by_b2_over_b1():
    policy = _filled(8, "abcdefgh")
    for key in "defg":
        policy.touch(key)
    for key in "defg":
        policy.evicted(key)
    policy.evicted("a")
    assert policy.list_sizes() == ARCListSizes(t1=3, t2=0, b1=1, b2=4)
    policy.insert("a")
    assert policy.p == 4


def test_ghost_hit_in_b2_lowers_p():
    policy = _filled(8, "abcdefgh")
    for key in "abc":
        policy.evicted(key)
    for key in "abc":
        policy.insert(key)  # three B1 hits: p = 3
    assert policy.p == 3
    policy.evicted("a")  # from T2 to B2
    for key in "def":
        policy.evicted(key)  # from T1 to B1
    assert policy.list_sizes() == ARCListSizes(t1=2, t2=2, b1=3, b2=1)
    policy.insert("a")
    assert policy.p == 0  # step |B1| / |B2| = 3
    assert policy.list_sizes() == ARCListSizes(t1=2, t2=3, b1=3, b2=0)


def test_p_is_capped_at_capacity_and_floored_at_zero():
    policy = ARCPolicy(2)
    for _ in range(5):
        policy.insert("a")
        policy.evicted("a")
        policy.insert("a")  # B1 hit
        policy.remove("a")
    assert policy.p == 2
    for _ in range(5):
        policy.insert("b")
        policy.touch("b")
        policy.evicted("b")
        policy.insert("b")  # B2 hit
        policy.remove("b")
    assert policy.p == 0


def test_candidates_take_t1_first_while_above_target():
    policy = _filled(4, "abcd")
    policy.touch("c")
    policy.touch("a")
    # |T1| = 2 > p = 0: T1 from its LRU end, then T2 from its LRU end.
    assert list(policy.candidates()) == ["b", "d", "c", "a"]


def test_candidates_take_t2_first_once_t1_is_within_target():
    policy = _filled(4, "abcd")
    for key in "ab":
        policy.evicted(key)
        policy.insert(key)  # two B1 hits: p = 2, T1 = {c, d}, T2 = [a, b]
    assert policy.p == 2
    assert list(policy.candidates()) == ["a", "b", "c", "d"]


def test_candidates_break_the_tie_by_the_last_b2_hit():
    policy = _filled(4, "abcd")
    for key in "ab":
        policy.evicted(key)
        policy.insert(key)  # p = 2, T1 = [c, d], T2 = [a, b]
    policy.evicted("a")  # B2 = [a]
    policy.insert("x")  # T1 = [c, d, x]
    policy.evicted("x")  # B1 = [x]
    policy.evicted("b")  # B2 = [a, b]
    policy.insert("a")  # B2 hit: p = 2 - max(1 / 2, 1) = 1, T2 = [a]
    policy.evicted("c")  # |T1| = 1 == p
    assert policy.p == 1
    assert list(policy.candidates()) == ["d", "a"]
    policy.insert("y")  # not a B2 hit: |T1| = 2 > p still takes T1 first
    policy.evicted("y")
    assert list(policy.candidates()) == ["a", "d"]


def test_remove_forgets_ghosts():
    policy = _filled(4, "abcd")
    policy.evicted("a")
    policy.remove("a")
    assert list(policy.ghosts()) == []
    policy.insert("a")
    assert policy.p == 0
    assert policy.list_sizes() == ARCListSizes(t1=4, t2=0, b1=0, b2=0)


def test_ghost_lists_are_trimmed_from_their_lru_ends():
    policy = ARCPolicy(2)
    for key in range(10):
        if len(policy) == policy.capacity:
            policy.evicted(next(policy.candidates()))
        policy.insert(key)
    assert policy.list_sizes() == ARCListSizes(t1=2, t2=0, b1=0, b2=0)
    policy.evicted(8)
    assert list(policy.ghosts()) == [8]


def _hit_ratio(policy: EvictionPolicy, trace: Sequence[Hashable]) -> float:
    """Return the hit ratio of a cache of `policy.capacity` entries on `trace`."""
    hits = 0
    for key in trace:
        if key in policy:
            hits += 1
            policy.touch(key)
            continue
        if len(policy) >= policy.capacity:
            policy.evicted(next(policy.candidates()))
        policy.insert(key)
    return hits / len(trace)


def _hot_set_with_scans(capacity: int) -> list[int]:
    """Return a trace that re-reads a hot set between one-time scans longer than the cache."""
    hot = list(range(capacity // 2))
    trace: list[int] = []
    next_scan_key = 1_000_000
    for _ in range(20):
        trace += hot * 2
        trace += range(next_scan_key, next_scan_key + 2 * capacity)
        next_scan_key += 2 * capacity
    return trace


def test_arc_resists_scans_better_than_lru():
    capacity = 64
    trace = _hot_set_with_scans(capacity)
    arc = _hit_ratio(ARCPolicy(capacity), trace)
    lru = _hit_ratio(LRUPolicy(capacity), trace)
    print(f"hit ratio on hot set + scans, capacity {capacity}: ARC {arc:.3f}, LRU {lru:.3f}")
    assert arc > lru + 0.05


def test_make_policy_builds_arc():
    policy = make_policy("arc", 8)
    assert isinstance(policy, ARCPolicy)
    assert policy.capacity == 8
    assert policy.name == "arc"


def test_available_policies_lists_builtins():
    assert available_policies() == ["2q", "arc", "lru"]
    for name in available_policies():
        assert make_policy(name, 2).name == name


def test_make_policy_unknown_name_raises():
    with pytest.raises(KeyError):
        make_policy("no-such-policy", 8)
