from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers.eviction import ARCPolicy, EvictionPolicy, HintedPolicy, LRUPolicy, make_policy
from kvtiers.testing.eviction import EvictionPolicyTests


class TestHintedLRU(EvictionPolicyTests):
    policy_cls = HintedPolicy

    def make(self, capacity: int = 4) -> EvictionPolicy:
        return HintedPolicy(LRUPolicy(capacity))


class TestHintedARC(TestHintedLRU):
    def make(self, capacity: int = 4) -> EvictionPolicy:
        return HintedPolicy(ARCPolicy(capacity))

    def check_invariants(self, policy: EvictionPolicy) -> None:
        assert isinstance(policy, HintedPolicy)
        sizes = policy.inner.list_sizes()  # type: ignore[attr-defined]
        assert sizes.t1 + sizes.b1 <= policy.capacity


def hinted(*cold: str, kept: str = "") -> HintedPolicy:
    policy = HintedPolicy(LRUPolicy(8))
    for key in kept:
        policy.insert(key)
    for key in cold:
        policy.insert_cold(key)
    return policy


def test_cold_entries_go_first_oldest_first():
    policy = hinted("x", "y", kept="ab")
    assert list(policy.candidates()) == ["x", "y", "a", "b"]
    assert (len(policy), policy.num_cold) == (4, 2)
    assert "x" in policy and "a" in policy


def test_a_hit_moves_a_cold_entry_into_the_wrapped_policy_as_new():
    policy = hinted("x", "y", kept="ab")
    policy.touch("x")
    assert list(policy.candidates()) == ["y", "a", "b", "x"]
    assert policy.num_cold == 1 and "x" in policy.inner


def test_cold_inserts_and_hits_are_counted_once_each():
    policy = hinted("x", "y", kept="ab")
    policy.insert_cold("x")  # already cold: the newest again, not a second insert
    policy.insert_cold("a")  # held by the wrapped policy: stays there
    assert (policy.cold_inserts, policy.cold_hits) == (2, 0)
    policy.touch("y")
    policy.touch("y")  # warm now: an ordinary hit
    policy.touch("b")
    assert (policy.cold_inserts, policy.cold_hits) == (2, 1)


def test_storing_again_without_the_hint_keeps_the_entry():
    policy = hinted("x", kept="a")
    policy.insert("x")
    assert list(policy.candidates()) == ["a", "x"] and policy.num_cold == 0


def test_a_hint_never_demotes_what_the_wrapped_policy_holds():
    policy = hinted(kept="ab")
    policy.insert_cold("a")
    assert list(policy.candidates()) == ["a", "b"] and policy.num_cold == 0
    policy.insert_cold("z")
    policy.insert_cold("y")
    policy.insert_cold("z")  # stored cold again: the newest cold entry
    assert list(policy.candidates()) == ["y", "z", "a", "b"]


def test_evicted_and_removed_cold_entries_leave_no_history():
    policy = HintedPolicy(ARCPolicy(4))
    policy.insert_cold("x")
    policy.insert_cold("y")
    policy.evicted("x")
    policy.remove("y")
    assert len(policy) == 0 and list(policy.inner.ghosts()) == []  # type: ignore[attr-defined]


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(["lru", "arc", "2q"]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "insert_cold", "touch", "evicted", "remove"]),
            st.integers(min_value=0, max_value=9),
        ),
        max_size=80,
    ),
)
def test_cold_and_kept_entries_never_overlap_and_without_cold_the_order_is_the_inner(name, ops):
    policy = HintedPolicy(make_policy(name, 4))
    plain = make_policy(name, 4)
    for op, key in ops:
        if op == "evicted" and key not in policy:
            continue
        getattr(policy, op)(key)
        if op != "insert_cold":
            getattr(plain, op)(key)
        cold = set(policy.candidates()) - set(policy.inner.candidates())
        assert len(cold) == policy.num_cold
        assert not any(key in policy.inner for key in cold)
        assert len(policy) == policy.num_cold + len(policy.inner)
        while len(policy) > policy.capacity:
            victim = next(policy.candidates())
            policy.evicted(victim)
            if victim in plain:
                plain.evicted(victim)
    if not any(op == "insert_cold" for op, _ in ops):
        assert list(policy.candidates()) == list(plain.candidates())
