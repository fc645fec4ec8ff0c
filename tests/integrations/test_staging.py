"""The host staging pool: reuse, best fit, and the bound on idle memory."""

from __future__ import annotations

import torch

from kvtiers.integrations._staging import StagingPool

MIB = 1 << 20


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
    assert pool.idle_bytes == 6 * MIB  # 5 MiB + 1 rounds to the next 2 MiB step of 8 MiB
    assert pool.take((6 * MIB,), torch.uint8).data_ptr() == t.data_ptr()


def test_idle_memory_stays_within_the_bound():
    pool = StagingPool(3 * MIB)
    a, b = pool.take((2 * MIB,), torch.uint8), pool.take((2 * MIB,), torch.uint8)
    pool.give(a)
    pool.give(b)  # would make 4 MiB idle: freed instead
    assert pool.idle_bytes == 2 * MIB
    none = StagingPool(0)
    none.give(none.take((10,), torch.uint8))
    assert none.idle_bytes == 0
