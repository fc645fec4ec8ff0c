"""SaltWitness: which chain roots recent stores used, by their first chunk."""

from __future__ import annotations

import numpy as np

from kvtiers._salts import SaltWitness

CHUNK = 4


def toks(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def test_a_first_chunk_stored_under_another_root_only_is_reported() -> None:
    witness = SaltWitness(CHUNK)
    witness.stored(toks(1, 2, 3, 4, 5), b"a")
    assert witness.other_root(toks(1, 2, 3, 4, 9, 9), b"b")  # only the first chunk counts
    assert not witness.other_root(toks(1, 2, 3, 4), b"a")
    assert not witness.other_root(toks(9, 2, 3, 4), b"b")  # never stored


def test_a_root_that_also_stored_it_is_not_another_root() -> None:
    witness = SaltWitness(CHUNK)
    witness.stored(toks(1, 2, 3, 4), b"a")
    witness.stored(toks(1, 2, 3, 4), b"b")
    assert not witness.other_root(toks(1, 2, 3, 4), b"a")
    assert not witness.other_root(toks(1, 2, 3, 4), b"b")
    assert witness.other_root(toks(1, 2, 3, 4), b"c")


def test_only_the_latest_four_roots_of_a_chunk_are_kept() -> None:
    witness = SaltWitness(CHUNK)
    for root in (b"a", b"b", b"c", b"d", b"e"):
        witness.stored(toks(1, 2, 3, 4), root)
    assert witness.other_root(toks(1, 2, 3, 4), b"a")  # forgotten
    assert not witness.other_root(toks(1, 2, 3, 4), b"e")


def test_the_oldest_first_chunk_is_forgotten_past_the_limit() -> None:
    witness = SaltWitness(CHUNK, limit=2)
    witness.stored(toks(1, 1, 1, 1), b"a")
    witness.stored(toks(2, 2, 2, 2), b"a")
    witness.stored(toks(1, 1, 1, 1), b"a")  # touched: now the newest
    witness.stored(toks(3, 3, 3, 3), b"a")
    assert witness.other_root(toks(1, 1, 1, 1), b"b")
    assert not witness.other_root(toks(2, 2, 2, 2), b"b")  # forgotten
    assert witness.other_root(toks(3, 3, 3, 3), b"b")


def test_prompts_shorter_than_a_chunk_are_not_recorded() -> None:
    witness = SaltWitness(CHUNK)
    witness.stored(toks(1, 2, 3), b"a")
    assert not witness.other_root(toks(1, 2, 3), b"b")
