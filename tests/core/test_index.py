"""Tests of the prefix index (`kvtiers.core.index`)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtiers.core.index import MatchResult, PrefixIndex, _Node
from kvtiers.core.keys import ChunkKey


def key(*path: int) -> ChunkKey:
    """Return a distinct 16-byte key for a path in a small tree (branch choices from the root)."""
    assert 1 <= len(path) <= 14 and all(0 <= b < 255 for b in path)
    return ChunkKey(bytes([len(path), *path]).ljust(16, b"\xff"))


def chain(*path: int) -> list[ChunkKey]:
    """Return the keys of every prefix of `path`, first chunk first."""
    return [key(*path[: i + 1]) for i in range(len(path))]


class TestPrefixIndex:
    def test_empty(self) -> None:
        index = PrefixIndex(2)
        assert len(index) == 0
        assert index.match(chain(0, 1)) == MatchResult(0, ())
        assert index.match([]) == MatchResult(0, ())
        assert index.tiers_of(key(0)) == 0
        assert key(0) not in index
        assert index.parent_of(key(0)) is None
        assert index.is_leaf(key(0), 0)
        assert list(index.keys_in(0)) == []

    def test_add_full_chain(self) -> None:
        index = PrefixIndex(2)
        keys = chain(0, 1, 2)
        for i in range(3):
            assert index.add(keys, i, 0)
        assert len(index) == 3
        assert index.match(keys) == MatchResult(3, (1, 1, 1))
        assert index.parent_of(keys[0]) is None
        assert index.parent_of(keys[1]) == keys[0]
        assert index.parent_of(keys[2]) == keys[1]

    def test_add_is_idempotent_per_tier(self) -> None:
        index = PrefixIndex(3)
        keys = chain(0)
        assert index.add(keys, 0, 1)
        assert not index.add(keys, 0, 1)
        assert index.add(keys, 0, 2)
        assert index.tiers_of(keys[0]) == 0b110
        assert index.match(keys) == MatchResult(1, (0b110,))

    def test_add_deep_creates_non_resident_path(self) -> None:
        index = PrefixIndex(1)
        keys = chain(0, 1, 2, 3)
        assert index.add(keys, 3, 0)
        assert len(index) == 4
        assert [index.tiers_of(k) for k in keys] == [0, 0, 0, 1]
        # The path exists, but a non-resident first chunk means no cached prefix.
        assert index.match(keys) == MatchResult(0, ())
        assert index.parent_of(keys[3]) == keys[2]

    def test_add_below_existing_ancestor(self) -> None:
        index = PrefixIndex(1)
        keys = chain(0, 1, 2, 3)
        index.add(keys, 0, 0)
        index.add(keys, 3, 0)
        assert len(index) == 4
        assert index.match(keys) == MatchResult(1, (1,))
        index.add(keys, 1, 0)
        index.add(keys, 2, 0)
        assert index.match(keys) == MatchResult(4, (1, 1, 1, 1))

    def test_match_stops_at_first_gap(self) -> None:
        index = PrefixIndex(2)
        keys = chain(0, 1, 2, 3)
        index.add(keys, 0, 0)
        index.add(keys, 1, 1)
        index.add(keys, 3, 0)
        assert index.match(keys) == MatchResult(2, (0b01, 0b10))
        assert index.match(keys[:1]) == MatchResult(1, (0b01,))

    def test_match_unknown_first_key(self) -> None:
        index = PrefixIndex(1)
        index.add(chain(0, 1), 1, 0)
        assert index.match(chain(1, 1)) == MatchResult(0, ())

    def test_discard(self) -> None:
        index = PrefixIndex(2)
        keys = chain(0)
        index.add(keys, 0, 0)
        index.add(keys, 0, 1)
        assert index.discard(keys[0], 0)
        assert not index.discard(keys[0], 0)
        assert index.tiers_of(keys[0]) == 0b10
        assert index.discard(keys[0], 1)
        assert len(index) == 0
        assert keys[0] not in index

    def test_discard_unknown(self) -> None:
        index = PrefixIndex(1)
        assert not index.discard(key(9), 0)
        index.add(chain(0), 0, 0)
        assert not index.discard(key(9), 0)
        assert len(index) == 1

    def test_discard_leaf_prunes_non_resident_ancestors(self) -> None:
        index = PrefixIndex(1)
        keys = chain(0, 1, 2, 3)
        index.add(keys, 0, 0)
        index.add(keys, 3, 0)
        assert index.discard(keys[3], 0)
        # keys[1] and keys[2] held nothing and had nothing below them.
        assert len(index) == 1
        assert keys[0] in index
        assert index.is_leaf(keys[0], 0)

    def test_discard_inner_node_keeps_it_for_children(self) -> None:
        index = PrefixIndex(1)
        keys = chain(0, 1, 2)
        for i in range(3):
            index.add(keys, i, 0)
        assert index.discard(keys[1], 0)
        assert keys[1] in index
        assert index.tiers_of(keys[1]) == 0
        assert index.match(keys) == MatchResult(1, (1,))
        assert index.discard(keys[2], 0)
        assert keys[2] not in index
        assert keys[1] not in index  # pruned with its last child
        assert keys[0] in index

    def test_pruning_stops_at_shared_ancestor(self) -> None:
        index = PrefixIndex(1)
        a, b = chain(0, 0, 0), chain(0, 1)
        index.add(a, 2, 0)
        index.add(b, 1, 0)
        assert len(index) == 4  # (0), (0,0), (0,0,0), (0,1)
        index.discard(a[2], 0)
        assert set(index.keys_in(0)) == {b[1]}
        assert len(index) == 2
        assert index.parent_of(b[1]) == b[0]
        index.discard(b[1], 0)
        assert len(index) == 0

    def test_is_leaf_per_tier(self) -> None:
        index = PrefixIndex(2)
        keys = chain(0, 1)
        index.add(keys, 0, 0)
        index.add(keys, 0, 1)
        index.add(keys, 1, 1)
        assert index.is_leaf(keys[0], 0)
        assert not index.is_leaf(keys[0], 1)
        assert index.is_leaf(keys[1], 1)
        index.discard(keys[1], 1)
        assert index.is_leaf(keys[0], 1)

    def test_keys_in(self) -> None:
        index = PrefixIndex(3)
        a, b = chain(0, 1), chain(1)
        index.add(a, 0, 0)
        index.add(a, 1, 2)
        index.add(b, 0, 0)
        assert set(index.keys_in(0)) == {a[0], b[0]}
        assert set(index.keys_in(1)) == set()
        assert set(index.keys_in(2)) == {a[1]}


# --- state machine ------------------------------------------------------------------------

_BRANCHING = 3
_DEPTH = 4
_NUM_TIERS = 3

Path = tuple[int, ...]

_ALL_PATHS: list[Path] = [
    p for d in range(1, _DEPTH + 1) for p in itertools.product(range(_BRANCHING), repeat=d)
]
_FULL_PATHS: list[Path] = [p for p in _ALL_PATHS if len(p) == _DEPTH]
# Precomputed, so the invariants (checked after every step) stay cheap.
_KEY: dict[Path, ChunkKey] = {p: key(*p) for p in _ALL_PATHS}
_CHAIN: dict[Path, list[ChunkKey]] = {p: chain(*p) for p in _ALL_PATHS}

paths = st.lists(st.integers(0, _BRANCHING - 1), min_size=1, max_size=_DEPTH).map(tuple)
tiers = st.integers(0, _NUM_TIERS - 1)


class PrefixIndexMachine(RuleBasedStateMachine):
    """Drive a `PrefixIndex` with random adds and discards and compare with a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(_NUM_TIERS)
        # Reference model: path -> tiers it is resident in (non-empty sets only).
        self.resident: dict[Path, set[int]] = {}

    def _mask(self, path: Path) -> int:
        return sum(1 << t for t in self.resident.get(path, ()))

    @rule(path=paths, idx_seed=st.integers(0, _DEPTH - 1), tier=tiers)
    def add(self, path: Path, idx_seed: int, tier: int) -> None:
        idx = idx_seed % len(path)
        target = path[: idx + 1]
        expected = tier not in self.resident.get(target, set())
        assert self.index.add(_CHAIN[path], idx, tier) is expected
        self.resident.setdefault(target, set()).add(tier)

    @rule(path=paths, tier=tiers)
    def discard(self, path: Path, tier: int) -> None:
        expected = tier in self.resident.get(path, set())
        assert self.index.discard(_KEY[path], tier) is expected
        if expected:
            self.resident[path].discard(tier)
            if not self.resident[path]:
                del self.resident[path]

    @precondition(lambda self: bool(self.resident))
    @rule(data=st.data())
    def discard_resident(self, data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(sorted(self.resident)))
        tier = data.draw(st.sampled_from(sorted(self.resident[path])))
        self.discard(path, tier)

    @invariant()
    def nodes_match_model(self) -> None:
        expected = {p[:i] for p in self.resident for i in range(1, len(p) + 1)}
        assert len(self.index) == len(expected)
        for path in _ALL_PATHS:
            assert (_KEY[path] in self.index) is (path in expected), path
            assert self.index.tiers_of(_KEY[path]) == self._mask(path)

    @invariant()
    def node_structure(self) -> None:
        nodes = self.index._nodes
        children: dict[ChunkKey, list[_Node]] = {k: [] for k in nodes}
        for k, node in nodes.items():
            assert node.key == k
            if node.parent is not None:
                # Every non-root node's parent is itself in the index.
                assert nodes.get(node.parent.key) is node.parent
                children[node.parent.key].append(node)
            # A node that holds nothing and has no children must have been pruned.
            assert node.tiers or node.num_children
        for k, node in nodes.items():
            kids = children[k]
            assert node.num_children == len(kids)
            # The children a branch is evicted with are exactly the nodes under it.
            linked = list(node.children())
            assert len(linked) == len(kids) and {id(c) for c in linked} == {id(c) for c in kids}
            for t in range(_NUM_TIERS):
                resident_kids = sum(1 for c in kids if c.tiers >> t & 1)
                assert node.child_tiers[t] == resident_kids
                assert self.index.is_leaf(k, t) is (resident_kids == 0)

    @invariant()
    def parents(self) -> None:
        for path in _ALL_PATHS:
            k = _KEY[path]
            if k not in self.index or len(path) == 1:
                assert self.index.parent_of(k) is None
            else:
                assert self.index.parent_of(k) == _KEY[path[:-1]]

    @invariant()
    def keys_in_matches_model(self) -> None:
        for t in range(_NUM_TIERS):
            expected = {_KEY[p] for p, ts in self.resident.items() if t in ts}
            found = list(self.index.keys_in(t))
            assert len(found) == len(expected)
            assert set(found) == expected

    @invariant()
    def match_is_longest_resident_prefix(self) -> None:
        for path in _FULL_PATHS:
            masks = []
            for i in range(1, len(path) + 1):
                mask = self._mask(path[:i])
                if not mask:
                    break
                masks.append(mask)
            assert self.index.match(_CHAIN[path]) == MatchResult(len(masks), tuple(masks))


PrefixIndexMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
TestPrefixIndexMachine = PrefixIndexMachine.TestCase


def test_key_helper_is_injective() -> None:
    assert len({key(*p) for p in _ALL_PATHS}) == len(_ALL_PATHS)


@pytest.mark.parametrize("tier", [0, 1])
def test_readd_after_full_discard(tier: int) -> None:
    index = PrefixIndex(2)
    keys = chain(2, 2)
    index.add(keys, 1, tier)
    index.discard(keys[1], tier)
    assert len(index) == 0
    assert index.add(keys, 1, tier)
    assert index.parent_of(keys[1]) == keys[0]
    assert not index.is_leaf(keys[0], tier)


def test_attach_links_a_piece_to_its_prefix() -> None:
    index = PrefixIndex(num_tiers=2)
    keys = chain(0, 1, 2, 3)
    index.add(keys, 1, 0)  # the prefix: chunks 0 and 1
    index.add(keys[2:], 0, 0)  # the continuation, indexed without its prefix
    index.add(keys[2:], 1, 0)
    assert index.parent_of(keys[2]) is None
    assert index.is_leaf(keys[1], 0)
    assert index.attach(keys[2], keys[1])
    assert index.parent_of(keys[2]) == keys[1]
    assert not index.is_leaf(keys[1], 0) and index.children_in(keys[1], 0) == 1
    assert not index.attach(keys[2], keys[1])  # already linked
    assert not index.attach(keys[0], keys[3])  # would close a cycle
    assert not index.attach(key(9), keys[1])  # unknown key
    # pruning still works through the link
    for k in reversed(keys):
        index.discard(k, 0)
    assert len(index) == 0


def test_pick_leaves_takes_a_candidate_with_its_branch_deepest_first() -> None:
    index = PrefixIndex(num_tiers=2)
    a, b = chain(0, 1, 2), chain(0, 1, 3)  # a fork after two shared chunks
    for keys in (a, b):
        for i in range(3):
            index.add(keys, i, 0)
    index.add(chain(0, 1, 2, 4), 3, 1)  # a child in another tier holds nothing back
    root, mid = a[0], a[1]
    # The first candidate's branch goes first: its children first, the older one first.
    assert index.pick_leaves([root, a[2]], 0, 4) == [a[2], b[2], mid, root]
    assert index.pick_leaves([mid, root], 0, 1) == [a[2]]
    assert index.pick_leaves([b[2], a[2], mid], 0, 2) == [b[2], a[2]]
    # A refused descendant keeps its ancestors; a refused candidate keeps its branch.
    assert index.pick_leaves([mid], 0, 3, skip=lambda k: k == b[2]) == [a[2]]
    assert index.pick_leaves([mid, b[2]], 0, 3, skip=lambda k: k == mid) == [b[2]]
