"""HostCopier: batches of host copies spread over threads, done when `copy` returns."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers._host_copies import HostCopier, _pieces, default_copy_threads

MIB = 2**20


def _copy_threads_alive() -> int:
    return sum(t.name.startswith("kvtiers-copy") for t in threading.enumerate())


def _strided_pairs(rng: np.random.Generator, num: int, rows: int) -> tuple[np.ndarray, list]:
    """Return a destination and `num` (view of it, source) pairs; the views are strided."""
    out = np.zeros((rows, num * 4, 1024), dtype=np.uint8)
    srcs = [rng.integers(0, 256, (rows, 4, 1024), dtype=np.uint8) for _ in range(num)]
    return out, [(out[:, 4 * i : 4 * i + 4], src) for i, src in enumerate(srcs)]


async def test_a_large_batch_is_copied_whole_on_several_threads() -> None:
    rng = np.random.default_rng(0)
    out, pairs = _strided_pairs(rng, num=16, rows=256)  # 16 MiB
    async with HostCopier(2) as copier:
        copier.copy(pairs)
        assert _copy_threads_alive() == 1  # the calling thread copied too
    for dst, src in pairs:
        assert np.array_equal(dst, src)
    assert _copy_threads_alive() == 0  # leaving the copier shut its pool down


async def test_a_small_batch_is_copied_on_the_calling_thread_alone() -> None:
    rng = np.random.default_rng(1)
    _, pairs = _strided_pairs(rng, num=4, rows=8)  # 128 KiB, below 8 MiB
    async with HostCopier(4) as copier:
        copier.copy(pairs)
        assert _copy_threads_alive() == 0  # no thread was started
    for dst, src in pairs:
        assert np.array_equal(dst, src)


async def test_one_thread_or_a_closed_copier_copies_alone() -> None:
    rng = np.random.default_rng(2)
    _, pairs = _strided_pairs(rng, num=16, rows=256)
    copier = HostCopier(1, min_bytes=0)
    copier.copy(pairs)
    copier.close()
    many = HostCopier(3, min_bytes=0)
    many.close()
    many.close()  # idempotent
    many.copy(pairs[::-1])
    assert _copy_threads_alive() == 0
    for dst, src in pairs:
        assert np.array_equal(dst, src)


@pytest.mark.parametrize("min_bytes", [0, 2**30], ids=["threads", "alone"])
async def test_a_shape_mismatch_raises_before_any_copy(min_bytes: int) -> None:
    good = np.zeros((64, 1024), dtype=np.uint8)
    dst = np.zeros((64, 1024), dtype=np.uint8)
    src = np.ones((1, 1024), dtype=np.uint8)  # NumPy alone would broadcast it
    async with HostCopier(2, min_bytes=min_bytes) as copier:
        with pytest.raises(ValueError, match="shape"):
            copier.copy([(good, np.ones_like(good)), (dst, src)])
    assert not good.any() and not dst.any()


async def test_a_failing_piece_raises_after_the_pieces_taken_are_done() -> None:
    class Boom(Exception):
        pass

    good = np.zeros((64, 1024), dtype=np.uint8)
    source = np.full((64, 1024), 7, dtype=np.uint8)

    class Exploding(np.ndarray):
        def __array_function__(self, *args: object, **kwargs: object) -> object:
            raise Boom

    bad = np.zeros((64, 1024), dtype=np.uint8).view(Exploding)
    async with HostCopier(2, min_bytes=0) as copier:
        with pytest.raises(Boom):
            copier.copy([(good, source), (bad, source)])
    assert np.array_equal(good, source) or not good.any()  # whole pieces only


def test_pieces_cut_large_pairs_along_the_first_axis() -> None:
    dst = np.zeros((32, 2, 256, 1024), dtype=np.uint8)  # 16 MiB
    src = np.ones_like(dst)
    pieces = _pieces([(dst, src), (dst[:1], src[:1])], 2 * MIB)
    assert [p[0].shape[0] for p in pieces] == [4] * 8 + [1]
    assert all(p[0].shape == p[1].shape for p in pieces)
    flat = np.zeros(3 * MIB + 5, dtype=np.uint8)
    assert [p[0].size for p in _pieces([(flat, flat)], 2 * MIB)] == [1572867, 1572866]
    scalar = np.zeros((), dtype=np.uint8)
    assert len(_pieces([(scalar, scalar)], 1)) == 1


def test_default_threads_are_the_cores_at_most_four() -> None:
    assert 1 <= default_copy_threads() <= 4


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 3), st.integers(1, 300)),
        min_size=1,
        max_size=6,
    ),
    threads=st.integers(1, 4),
    piece=st.integers(1, 5000),
)
def test_any_batch_copies_exactly_what_one_copyto_each_would(
    shapes: list[tuple[int, int, int]], threads: int, piece: int
) -> None:
    rng = np.random.default_rng(len(shapes) * 31 + threads)
    pairs = []
    for shape in shapes:
        wide = np.zeros((shape[0], shape[1] * 2, shape[2]), dtype=np.uint8)
        pairs.append((wide[:, ::2], rng.integers(0, 256, shape, dtype=np.uint8)))
    copier = HostCopier(threads, min_bytes=0, piece_bytes=piece)
    try:
        copier.copy(pairs)
    finally:
        copier.close()
    for dst, src in pairs:
        assert np.array_equal(dst, src)
