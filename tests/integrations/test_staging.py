"""The host staging pool (reuse, best fit, the bound on idle memory) and a worker's tensors."""

from __future__ import annotations

import concurrent.futures
import itertools

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtiers.integrations._staging import StagingPool, StagingTensors, _rounded
from tests.conftest import small_layout

MIB = 1 << 20
_BOUND = 1 << 20  # the machine's pool: 1 MiB idle at most


def test_a_returned_buffer_serves_the_next_take_of_any_shape_that_fits():
    pool = StagingPool(64 * MIB)
    first = pool.take((2, 3, 1000, 4), torch.float16)
    assert first.shape == (2, 3, 1000, 4) and first.dtype == torch.float16
    assert first.is_contiguous()
    first.fill_(1)
    pointer = first.data_ptr()
    pool.give(first)
    assert pool.idle_bytes >= first.nbytes
    second = pool.take((500, 7), torch.bfloat16)  # smaller, another dtype
    assert second.data_ptr() == pointer and second.shape == (500, 7)
    assert pool.idle_bytes == 0
    third = pool.take((500, 7), torch.bfloat16)  # nothing idle: new memory
    assert third.data_ptr() != pointer


def test_the_smallest_idle_buffer_that_fits_is_taken():
    pool = StagingPool(64 * MIB)
    big, small = pool.take((4 * MIB,), torch.uint8), pool.take((MIB,), torch.uint8)
    ptrs = {big.data_ptr(): "big", small.data_ptr(): "small"}
    pool.give(big)
    pool.give(small)
    assert ptrs.get(pool.take((MIB // 2,), torch.uint8).data_ptr()) == "small"
    assert ptrs.get(pool.take((2 * MIB,), torch.uint8).data_ptr()) == "big"
    assert ptrs.get(pool.take((MIB,), torch.uint8).data_ptr()) is None


def test_sizes_are_rounded_to_a_quarter_of_a_power_of_two():
    pool = StagingPool(64 * MIB)
    t = pool.take((5 * MIB + 1,), torch.uint8)
    pool.give(t)
    assert pool.idle_bytes == 6 * MIB  # 5 MiB + 1 rounds up to the next 1 MiB (4 MiB / 4)
    assert pool.take((6 * MIB,), torch.uint8).data_ptr() == t.data_ptr()
    for need in (1, 1 << 16, (1 << 16) + 1, 3 << 20, (4 << 20) + 1, (8 << 20) - 1, 1 << 30):
        size = _rounded(need)
        assert need <= size and (size <= 1 << 16 or size - need < need / 4), need


def test_idle_memory_stays_within_the_bound():
    pool = StagingPool(3 * MIB)
    a, b = pool.take((2 * MIB,), torch.uint8), pool.take((2 * MIB,), torch.uint8)
    pool.give(a)
    pool.give(b)  # would make 4 MiB idle: freed instead
    assert pool.idle_bytes == 2 * MIB
    none = StagingPool(0)
    none.give(none.take((10,), torch.uint8))
    assert none.idle_bytes == 0


def test_a_buffer_too_big_to_keep_is_not_rounded_up():
    pool = StagingPool(4 * MIB)
    big = pool.take((5 * MIB + 1,), torch.uint8)
    assert big.untyped_storage().nbytes() == 5 * MIB + 1
    pool.give(big)
    assert pool.idle_bytes == 0
    kept = pool.take((3 * MIB + 1,), torch.uint8)  # rounds to 3.5 MiB, within the bound
    assert kept.untyped_storage().nbytes() == 7 * MIB // 2


def _ended(result: int = 0, error: Exception | None = None) -> concurrent.futures.Future[int]:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future


def test_a_worker_s_staging_is_shaped_by_its_layout_and_reused():
    layout = small_layout()
    staging = StagingTensors(layout, pinned=False, keep_bytes=64 * MIB)
    tensor = staging.take(48)
    assert tensor.shape == layout.kv_shape(48) and tensor.dtype == torch.float16
    pointer = tensor.data_ptr()
    staging.release(tensor)  # nothing can use it: kept
    assert staging.idle_bytes >= tensor.nbytes
    assert staging.take(32).data_ptr() == pointer


def test_staging_of_a_load_or_save_that_did_not_end_well_is_not_kept():
    staging = StagingTensors(small_layout(), pinned=False, keep_bytes=64 * MIB)
    running: concurrent.futures.Future[int] = concurrent.futures.Future()
    cancelled: concurrent.futures.Future[int] = concurrent.futures.Future()
    cancelled.cancel()
    for done in (running, cancelled, _ended(error=RuntimeError("tier down"))):
        staging.release(staging.take(16), done)  # a read or write may still be in flight
        assert staging.idle_bytes == 0
    staging.release(staging.take(16), _ended(16))
    assert staging.idle_bytes > 0


class StagingPoolMachine(RuleBasedStateMachine):
    """Takes and gives in any order: tensors in use never share memory, idle stays bounded."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = StagingPool(_BOUND)
        self.in_use: list[torch.Tensor] = []

    @rule(num_bytes=st.integers(1, 3 * _BOUND // 2), fill=st.integers(0, 255))
    def take(self, num_bytes: int, fill: int) -> None:
        tensor = self.pool.take((num_bytes,), torch.uint8)
        assert tensor.shape == (num_bytes,) and tensor.is_contiguous()
        tensor.fill_(fill)
        self.in_use.append(tensor)

    @precondition(lambda self: self.in_use)
    @rule(data=st.data())
    def give(self, data: st.DataObject) -> None:
        tensor = self.in_use.pop(data.draw(st.integers(0, len(self.in_use) - 1)))
        before = self.pool.idle_bytes
        self.pool.give(tensor)
        kept = self.pool.idle_bytes - before
        assert kept == 0 or kept >= tensor.nbytes

    @invariant()
    def bounded_and_disjoint(self) -> None:
        assert 0 <= self.pool.idle_bytes <= _BOUND
        spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in self.in_use)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start


StagingPoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestStagingPoolMachine = StagingPoolMachine.TestCase
