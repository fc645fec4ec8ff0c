"""The mooncake tier's record of its pool: recency, admission and the capacity bound."""

from __future__ import annotations

from kvtiers.tiers._mooncake_catalog import KnownChunks


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _known(max_entries: int, *keys: bytes) -> KnownChunks:
    known = KnownChunks(max_entries)
    for key in keys:
        known.add(key)
    return known


def test_admit_holds_known_keys_and_evicts_the_least_recent_for_new_ones() -> None:
    known = _known(3, _key(1), _key(2), _key(3))
    order = [_key(2), _key(4)]
    held = dict.fromkeys(order, False)
    new, victims = known.admit(order, held)
    assert held == {_key(2): True, _key(4): False}
    assert new == [_key(4)]
    assert victims == [_key(1)]  # the least recent; 2 was just refreshed


def test_admit_declines_new_keys_past_the_capacity_and_every_deeper_one() -> None:
    known = KnownChunks(2)
    order = [_key(1), _key(2), _key(3)]
    new, victims = known.admit(order, dict.fromkeys(order, False))
    assert (new, victims) == ([_key(1), _key(2)], [])


def test_reads_refresh_hits_forget_misses_and_stay_within_the_bound() -> None:
    known = _known(2, _key(1), _key(2))
    known.note_reads([_key(1), _key(2), _key(3)], [True, False, True])
    assert len(known) == 2
    known.forget(_key(1))
    assert len(known) == 1
    known.note_reads([_key(4), _key(5)], [True, True])  # others' chunks: the oldest is forgotten
    order = [_key(3)]
    _, victims = known.admit(order, dict.fromkeys(order, False))
    assert victims == [_key(4)]
