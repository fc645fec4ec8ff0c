"""The conformance suite every `EvictionPolicy` must pass.

A policy's test module subclasses `EvictionPolicyTests` and sets `policy_cls`:

    class TestLRUPolicy(EvictionPolicyTests):
        policy_cls = LRUPolicy

Policies with extra state override `check_invariants`, which the random-operation test calls
after every step.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers.eviction.base import EvictionPolicy

__all__ = ["EvictionPolicyTests"]

_OPS = ("insert", "touch", "evicted", "evict_first", "remove")
_NUM_KEYS = 12


class EvictionPolicyTests:
    """Tests that every eviction policy must pass.

    Subclasses set `policy_cls`; pytest collects them when their name starts with `Test`.
    """

    policy_cls: ClassVar[type[EvictionPolicy]]

    def make(self, capacity: int = 4) -> EvictionPolicy:
        """Return a new policy of the class under test.

        Args:
            capacity: how many entries the tier holds when full.

        Returns:
            The new, empty policy.
        """
        return self.policy_cls(capacity)

    def check_invariants(self, policy: EvictionPolicy) -> None:
        """Assert policy-specific invariants; the default checks nothing.

        Args:
            policy: the policy after an operation, never over capacity.
        """

    def test_name_is_set(self) -> None:
        assert self.policy_cls.name
        assert self.policy_cls.name == self.policy_cls.name.lower()

    @pytest.mark.parametrize("capacity", [0, -1])
    def test_capacity_below_one_raises(self, capacity: int) -> None:
        with pytest.raises(ValueError, match="capacity"):
            self.make(capacity)

    def test_capacity_is_kept(self) -> None:
        assert self.make(7).capacity == 7

    def test_new_policy_is_empty(self) -> None:
        policy = self.make()
        assert len(policy) == 0
        assert "a" not in policy
        assert list(policy.candidates()) == []

    def test_insert_makes_resident(self) -> None:
        policy = self.make()
        policy.insert("a")
        policy.insert("b")
        assert len(policy) == 2
        assert "a" in policy
        assert "b" in policy
        assert "c" not in policy

    def test_insert_twice_keeps_one_entry(self) -> None:
        policy = self.make()
        policy.insert("a")
        policy.insert("a")
        assert len(policy) == 1
        assert list(policy.candidates()) == ["a"]

    def test_touch_keeps_resident_set(self) -> None:
        policy = self.make()
        for key in "abc":
            policy.insert(key)
        policy.touch("b")
        policy.touch("b")
        assert len(policy) == 3
        assert set(policy.candidates()) == {"a", "b", "c"}
        assert len(list(policy.candidates())) == 3

    def test_touch_unknown_is_ignored(self) -> None:
        policy = self.make()
        policy.insert("a")
        policy.touch("zzz")
        assert "zzz" not in policy
        assert list(policy.candidates()) == ["a"]

    def test_evicted_drops_resident(self) -> None:
        policy = self.make()
        policy.insert("a")
        policy.insert("b")
        policy.evicted("a")
        assert "a" not in policy
        assert len(policy) == 1
        assert list(policy.candidates()) == ["b"]

    def test_evicted_unknown_is_ignored(self) -> None:
        policy = self.make()
        policy.insert("a")
        policy.evicted("zzz")
        policy.evicted("a")
        policy.evicted("a")
        assert len(policy) == 0

    def test_remove_drops_resident(self) -> None:
        policy = self.make()
        policy.insert("a")
        policy.insert("b")
        policy.remove("b")
        assert "b" not in policy
        assert len(policy) == 1
        assert list(policy.candidates()) == ["a"]

    def test_remove_unknown_is_ignored(self) -> None:
        policy = self.make()
        policy.insert("a")
        policy.remove("zzz")
        assert list(policy.candidates()) == ["a"]

    def test_reinsert_after_evicted_is_resident(self) -> None:
        policy = self.make()
        policy.insert("a")
        policy.evicted("a")
        policy.insert("a")
        assert "a" in policy
        assert len(policy) == 1

    def test_candidates_yield_each_resident_once(self) -> None:
        policy = self.make(capacity=8)
        keys: list[Hashable] = [1, "two", (3, 4), b"five", 6.5]
        for key in keys:
            policy.insert(key)
        policy.touch("two")
        policy.touch(1)
        yielded = list(policy.candidates())
        assert len(yielded) == len(keys)
        assert set(yielded) == set(keys)

    def test_candidates_never_yield_ghosts(self) -> None:
        policy = self.make(capacity=4)
        for key in range(4):
            policy.insert(key)
        policy.touch(1)
        policy.evicted(0)
        policy.evicted(1)
        policy.remove(2)
        assert set(policy.candidates()) == {3}
        for key in range(10, 13):
            policy.insert(key)
        assert set(policy.candidates()) == {3, 10, 11, 12}
        assert 0 not in policy
        assert 1 not in policy

    def test_owner_loop_respects_capacity(self) -> None:
        policy = self.make(capacity=3)
        for key in [1, 2, 3, 1, 4, 5, 1, 6, 2, 7, 1]:
            if key in policy:
                policy.touch(key)
                continue
            if len(policy) == policy.capacity:
                policy.evicted(next(policy.candidates()))
            policy.insert(key)
            assert len(policy) <= policy.capacity
            self.check_invariants(policy)

    def test_random_ops_keep_invariants(self) -> None:
        # NOTE: @given wraps a nested function, not this method: every subclass inherits the
        # method, and Hypothesis refuses one @given test run from several classes.
        @settings(max_examples=150, deadline=None)
        @given(
            capacity=st.integers(min_value=1, max_value=6),
            ops=st.lists(
                st.tuples(st.sampled_from(_OPS), st.integers(min_value=0, max_value=_NUM_KEYS - 1)),
                max_size=60,
            ),
        )
        def run(capacity: int, ops: list[tuple[str, int]]) -> None:
            self._run_ops(self.make(capacity), ops)

        run()

    def _run_ops(self, policy: EvictionPolicy, ops: list[tuple[str, int]]) -> None:
        """Apply `ops` as a tier owner would, checking against a reference set."""
        resident: set[Hashable] = set()
        for op, key in ops:
            if op == "insert":
                # Make room first, as a tier owner does, so the policy is never over capacity.
                if key not in resident and len(resident) == policy.capacity:
                    victim = next(policy.candidates())
                    policy.evicted(victim)
                    resident.discard(victim)
                policy.insert(key)
                resident.add(key)
            elif op == "touch":
                policy.touch(key)
            elif op == "evicted":
                policy.evicted(key)
                resident.discard(key)
            elif op == "evict_first":
                if resident:
                    victim = next(policy.candidates())
                    assert victim in resident
                    policy.evicted(victim)
                    resident.discard(victim)
            else:
                policy.remove(key)
                resident.discard(key)
            yielded = list(policy.candidates())
            assert len(yielded) == len(resident)
            assert set(yielded) == resident
            assert len(policy) == len(resident)
            assert all((k in policy) == (k in resident) for k in range(_NUM_KEYS))
            self.check_invariants(policy)
