"""StagePool: reused host buffers, from the given allocator (pinned memory on a GPU)."""

from __future__ import annotations

import numpy as np

from kvtiers._stages import StagePool


def test_kept_buffers_come_from_the_allocator_once_and_are_reused() -> None:
    sizes: list[int] = []

    def allocate(num_bytes: int) -> np.ndarray:
        sizes.append(num_bytes)
        return np.zeros(num_bytes, np.uint8)

    pool = StagePool(1024, max_bytes=4096, keep=1, allocate=allocate)
    assert pool.rows == 4
    with pool.take(3) as first:
        assert first.shape == (3, 1024)
    with pool.take(4) as again:
        assert again.base is first.base  # the same buffer
    assert sizes == [4096]


def test_a_batch_past_its_rows_gets_a_one_off_plain_buffer() -> None:
    pool = StagePool(1024, max_bytes=4096, allocate=lambda n: 1 / 0)  # never called
    with pool.take(5) as big:
        assert big.shape == (5, 1024)
    with pool.take(5) as other:
        assert other is not big


def test_buffers_taken_at_once_are_distinct_and_at_most_keep_are_kept() -> None:
    pool = StagePool(16, max_bytes=64, keep=1)
    with pool.take(2) as a, pool.take(2) as b:
        assert not np.shares_memory(a, b)
    with pool.take(1) as c:
        assert np.shares_memory(c, b) or np.shares_memory(c, a)
    assert len(pool._free) == 1
