"""Tests of the block allocator (`kvtiers.core.blockpool`)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtiers.core.blockpool import BlockPool


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    """Return everything observable about a pool, to check that a failed call changed nothing."""
    ids = range(pool.num_blocks)
    return (
        pool.num_free_blocks,
        pool.num_used_blocks,
        tuple(pool.is_free(b) for b in ids),
        tuple(pool.pin_count(b) for b in ids),
        pool.total_pins(),
    )


class TestBlockPool:
    def test_new_pool_is_all_free(self) -> None:
        pool = BlockPool(4)
        assert (pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks) == (4, 4, 0)
        assert all(pool.is_free(b) for b in range(4))
        assert pool.total_pins() == 0

    def test_empty_pool(self) -> None:
        pool = BlockPool(0)
        assert pool.allocate() is None
        assert pool.allocate_many(1) is None
        assert pool.allocate_many(0) == []

    def test_negative_size(self) -> None:
        with pytest.raises(ValueError, match="num_blocks"):
            BlockPool(-1)

    def test_allocate_until_exhausted(self) -> None:
        pool = BlockPool(3)
        ids = [pool.allocate() for _ in range(3)]
        assert sorted(ids) == [0, 1, 2]  # type: ignore[type-var]
        assert pool.allocate() is None
        assert pool.num_free_blocks == 0
        assert not any(pool.is_free(b) for b in range(3))

    def test_allocates_low_ids_first(self) -> None:
        pool = BlockPool(3)
        assert [pool.allocate() for _ in range(3)] == [0, 1, 2]

    def test_free_block_is_reused_first(self) -> None:
        pool = BlockPool(4)
        pool.allocate_many(3)
        pool.free(1)
        assert pool.allocate() == 1

    def test_allocate_many_all_or_nothing(self) -> None:
        pool = BlockPool(4)
        first = pool.allocate_many(3)
        assert first is not None and len(set(first)) == 3
        before = snapshot(pool)
        assert pool.allocate_many(2) is None
        assert snapshot(pool) == before
        assert pool.allocate_many(1) is not None
        assert pool.num_free_blocks == 0

    def test_double_free(self) -> None:
        pool = BlockPool(2)
        b = pool.allocate()
        assert b is not None
        pool.free(b)
        before = snapshot(pool)
        with pytest.raises(ValueError, match="free"):
            pool.free(b)
        assert snapshot(pool) == before

    def test_pinned_block_cannot_be_freed(self) -> None:
        pool = BlockPool(2)
        b = pool.allocate()
        assert b is not None
        pool.pin(b)
        pool.pin(b)
        assert pool.pin_count(b) == 2
        before = snapshot(pool)
        with pytest.raises(ValueError, match="pinned"):
            pool.free(b)
        assert snapshot(pool) == before
        pool.unpin(b)
        with pytest.raises(ValueError, match="pinned"):
            pool.free(b)
        pool.unpin(b)
        pool.free(b)
        assert pool.is_free(b)
        assert pool.total_pins() == 0

    def test_pin_free_block(self) -> None:
        pool = BlockPool(2)
        with pytest.raises(ValueError, match="free"):
            pool.pin(0)
        assert pool.pin_count(0) == 0

    def test_unpin_without_pin(self) -> None:
        pool = BlockPool(2)
        b = pool.allocate()
        assert b is not None
        with pytest.raises(ValueError, match="not pinned"):
            pool.unpin(b)
        assert pool.pin_count(b) == 0

    @pytest.mark.parametrize("block_id", [-1, -2, 3, 100])
    def test_out_of_range_ids(self, block_id: int) -> None:
        pool = BlockPool(3)
        pool.allocate_many(3)
        for b in range(3):
            pool.pin(b)
        before = snapshot(pool)
        for op in (pool.free, pool.pin, pool.unpin):
            with pytest.raises(ValueError, match="out of range"):
                op(block_id)
        assert snapshot(pool) == before


# --- state machine ------------------------------------------------------------------------

_MAX_BLOCKS = 8


class BlockPoolMachine(RuleBasedStateMachine):
    """Drive a `BlockPool` with random calls and compare with a set-and-dict model."""

    pool: BlockPool

    @initialize(num_blocks=st.integers(0, _MAX_BLOCKS))
    def create(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.used: set[int] = set()
        self.pins: dict[int, int] = {}

    def _any_id(self) -> st.SearchStrategy[int]:
        return st.integers(-2, self.pool.num_blocks + 1)

    def _expect_value_error(self, call: object, block_id: int) -> None:
        before = snapshot(self.pool)
        with pytest.raises(ValueError):
            call(block_id)  # type: ignore[operator]
        assert snapshot(self.pool) == before

    @rule()
    def allocate(self) -> None:
        block_id = self.pool.allocate()
        if len(self.used) == self.pool.num_blocks:
            assert block_id is None
            return
        assert block_id is not None
        assert 0 <= block_id < self.pool.num_blocks
        assert block_id not in self.used
        self.used.add(block_id)

    @rule(count=st.integers(0, _MAX_BLOCKS + 1))
    def allocate_many(self, count: int) -> None:
        before = snapshot(self.pool)
        ids = self.pool.allocate_many(count)
        if count > self.pool.num_blocks - len(self.used):
            assert ids is None
            assert snapshot(self.pool) == before
            return
        assert ids is not None
        assert len(ids) == count == len(set(ids))
        assert all(0 <= b < self.pool.num_blocks for b in ids)
        assert self.used.isdisjoint(ids)
        self.used.update(ids)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        block_id = data.draw(self._any_id())
        if block_id in self.used and not self.pins.get(block_id):
            self.pool.free(block_id)
            self.used.discard(block_id)
        else:
            self._expect_value_error(self.pool.free, block_id)

    @precondition(lambda self: bool(self.used))
    @rule(data=st.data())
    def free_used(self, data: st.DataObject) -> None:
        # Biased towards ids that exist, so frees succeed often enough to matter.
        block_id = data.draw(st.sampled_from(sorted(self.used)))
        if self.pins.get(block_id):
            self._expect_value_error(self.pool.free, block_id)
        else:
            self.pool.free(block_id)
            self.used.discard(block_id)

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(sorted(self.used)) if self.used else self._any_id())
        if block_id in self.used:
            self.pool.pin(block_id)
            self.pins[block_id] = self.pins.get(block_id, 0) + 1
        else:
            self._expect_value_error(self.pool.pin, block_id)

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        block_id = data.draw(self._any_id())
        if self.pins.get(block_id):
            self.pool.unpin(block_id)
            self.pins[block_id] -= 1
        else:
            self._expect_value_error(self.pool.unpin, block_id)

    @invariant()
    def accounting(self) -> None:
        pool = self.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_used_blocks == len(self.used)
        assert pool.total_pins() == sum(self.pins.values())
        for b in range(pool.num_blocks):
            assert pool.is_free(b) is (b not in self.used)
            assert pool.pin_count(b) >= 0
            assert pool.pin_count(b) == self.pins.get(b, 0)
            if pool.is_free(b):
                assert pool.pin_count(b) == 0


BlockPoolMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
