"""The prefix index: a trie of chunk keys with per-tier residency."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

from kvtiers.core.keys import ChunkKey

__all__ = ["LookupResult", "MatchResult", "PrefixIndex"]


@dataclass(slots=True, eq=False)
class _Node:
    key: ChunkKey
    parent: _Node | None
    # Bit t is set when the chunk is resident in tier t.
    tiers: int = 0
    # Children that exist in the trie (resident somewhere, or holding resident descendants).
    num_children: int = 0
    # child_tiers[t]: children resident in tier t. A node with child_tiers[t] == 0 is a leaf
    # of tier t, so evicting it from t leaves no suffix in t without its prefix.
    child_tiers: list[int] = field(default_factory=list)
    # The children, newest first, as an intrusive doubly linked list (24 bytes a node, where
    # a dict of children would take 184): `pick_leaves` evicts a branch with them.
    first_child: _Node | None = None
    next_sibling: _Node | None = None
    prev_sibling: _Node | None = None

    def children(self) -> Iterator[_Node]:
        """Yield the children, newest first."""
        child = self.first_child
        while child is not None:
            yield child
            child = child.next_sibling

    def __repr__(self) -> str:  # parents are printed by key only, to avoid recursion
        parent = self.parent.key.hex()[:8] if self.parent else None
        return f"_Node({self.key.hex()[:8]}, parent={parent}, tiers={self.tiers:b})"


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest cached prefix of a token sequence, and where each chunk of it is."""

    num_tokens: int
    """Length of the prefix in tokens, a multiple of the chunk size."""
    tiers: tuple[str, ...]
    """Per chunk of the prefix, the name of the tier a load reads it from: the highest
    tier that holds it (by the cache's index, at the time of the lookup)."""
    keys: tuple[ChunkKey, ...] = field(default=(), compare=False, repr=False)
    """The chunk keys of the prefix, prefix first, for the key-level calls
    (`contains_keys`, `get_chunks`) on the same chunks without hashing the tokens again.
    Empty in a result rebuilt from another process's answer (vLLM's lookup channel
    carries the length and tiers only)."""


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The locally known cached prefix of a key sequence."""

    num_chunks: int
    """Leading keys resident in at least one tier."""
    tiers: tuple[int, ...]
    """Residency bit mask (bit t: tier t) of each of the `num_chunks` leading keys."""


class PrefixIndex:
    """Index chunk keys in a trie, tracking in which tiers each chunk is resident.

    Keys are chained, so a key fixes its whole prefix: the trie is a dict from key to node plus
    parent links, and `match` walks it in one pass. A node stays while it is resident in some
    tier or has children; otherwise it is pruned, and its parent with it if that empties it.

    Args:
        num_tiers: number of tiers (bits per residency mask).
    """

    __slots__ = ("_nodes", "num_tiers")

    def __init__(self, num_tiers: int) -> None:
        self.num_tiers = num_tiers
        self._nodes: dict[ChunkKey, _Node] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def match(self, keys: Sequence[ChunkKey]) -> MatchResult:
        """Return how many leading `keys` are resident somewhere, with their tier masks."""
        nodes = self._nodes
        masks: list[int] = []
        for key in keys:
            node = nodes.get(key)
            if node is None or not node.tiers:
                break
            masks.append(node.tiers)
        return MatchResult(len(masks), tuple(masks))

    def tiers_of(self, key: ChunkKey) -> int:
        """Return the residency mask of `key` (0 when unknown)."""
        node = self._nodes.get(key)
        return node.tiers if node else 0

    def add(self, keys: Sequence[ChunkKey], idx: int, tier: int) -> bool:
        """Mark `keys[idx]` resident in `tier`, creating the path to it as needed.

        `keys` is the chain from the first chunk, so `keys[idx - 1]` is the parent.

        Returns:
            Whether the residency is new.
        """
        node = self._ensure_path(keys, idx)
        bit = 1 << tier
        if node.tiers & bit:
            return False
        node.tiers |= bit
        if node.parent is not None:
            node.parent.child_tiers[tier] += 1
        return True

    def mark(self, key: ChunkKey, tier: int) -> bool:
        """Mark a key already in the index resident in `tier`.

        Returns:
            Whether the residency is new (`False` also when the key is unknown).
        """
        node = self._nodes.get(key)
        bit = 1 << tier
        if node is None or node.tiers & bit:
            return False
        node.tiers |= bit
        if node.parent is not None:
            node.parent.child_tiers[tier] += 1
        return True

    def discard(self, key: ChunkKey, tier: int) -> bool:
        """Mark `key` no longer resident in `tier`; prune nodes left empty.

        Returns:
            Whether it was resident there.
        """
        node = self._nodes.get(key)
        bit = 1 << tier
        if node is None or not node.tiers & bit:
            return False
        node.tiers &= ~bit
        if node.parent is not None:
            node.parent.child_tiers[tier] -= 1
        self._prune(node)
        return True

    def attach(self, key: ChunkKey, parent: ChunkKey) -> bool:
        """Make `parent` the parent of `key`, where `key` was indexed without one.

        For chains indexed in pieces (an engine that hashes its own pages stores a
        continuation without repeating its prefix): the link keeps leaf-first eviction
        exact across the pieces.

        Returns:
            Whether the link was made (both known, `key` parentless, no cycle).
        """
        node = self._nodes.get(key)
        up = self._nodes.get(parent)
        if node is None or up is None or node.parent is not None:
            return False
        ancestor: _Node | None = up
        while ancestor is not None:
            if ancestor is node:
                return False
            ancestor = ancestor.parent
        node.parent = up
        _link(up, node)
        for tier in range(self.num_tiers):
            if node.tiers >> tier & 1:
                up.child_tiers[tier] += 1
        return True

    def is_leaf(self, key: ChunkKey, tier: int) -> bool:
        """Return whether no child of `key` is resident in `tier`."""
        node = self._nodes.get(key)
        return node is None or node.child_tiers[tier] == 0

    def children_in(self, key: ChunkKey, tier: int) -> int:
        """Return how many children of `key` are resident in `tier`."""
        node = self._nodes.get(key)
        return node.child_tiers[tier] if node is not None else 0

    def parent_of(self, key: ChunkKey) -> ChunkKey | None:
        """Return the parent key of `key`, or `None` for a first chunk or an unknown key."""
        node = self._nodes.get(key)
        return node.parent.key if node is not None and node.parent is not None else None

    def pick_leaves(
        self,
        candidates: Iterable[Hashable],
        tier: int,
        need: int,
        skip: Callable[[ChunkKey], bool] | None = None,
    ) -> list[ChunkKey]:
        """Return up to `need` chunks to evict from `tier`, in the order of `candidates`.

        Only leaves of the tier go, so no tier holds a suffix without its prefix. A
        candidate with children in the tier goes with its branch: its descendants in the
        tier first, each after its own children, older sub-branches first, then itself (a
        policy ranks a branch by its root, and a suffix is of no use without it).
        Candidates `skip` refuses are passed over, with their branches; a descendant it
        refuses keeps its ancestors. Both the cache and the replay evict so.
        """
        picking = _Picking(tier, need, skip)
        for candidate in candidates:
            node = self._nodes.get(cast(ChunkKey, candidate))
            if node is None or node.key in picking.picked:
                continue
            if skip is not None and skip(node.key):
                continue
            picking.branch(node)
            if len(picking.victims) >= need:
                break
        return picking.victims

    def keys_in(self, tier: int) -> Iterator[ChunkKey]:
        """Yield every key resident in `tier` (no order)."""
        bit = 1 << tier
        for key, node in self._nodes.items():
            if node.tiers & bit:
                yield key

    def _ensure_path(self, keys: Sequence[ChunkKey], idx: int) -> _Node:
        nodes = self._nodes
        node = nodes.get(keys[idx])
        if node is not None:
            return node
        # Find the deepest existing ancestor, then create the missing nodes below it.
        start = idx
        while start > 0 and keys[start - 1] not in nodes:
            start -= 1
        parent = nodes[keys[start - 1]] if start > 0 else None
        for i in range(start, idx + 1):
            node = _Node(keys[i], parent, child_tiers=[0] * self.num_tiers)
            nodes[keys[i]] = node
            if parent is not None:
                _link(parent, node)
            parent = node
        assert node is not None
        return node

    def _prune(self, node: _Node | None) -> None:
        while node is not None and not node.tiers and not node.num_children:
            del self._nodes[node.key]
            parent = node.parent
            if parent is not None:
                parent.num_children -= 1
                _unlink(parent, node)
            node = parent


def _link(parent: _Node, child: _Node) -> None:
    """Make `child` the newest of `parent`'s children."""
    parent.num_children += 1
    child.next_sibling = parent.first_child
    if parent.first_child is not None:
        parent.first_child.prev_sibling = child
    parent.first_child = child


def _unlink(parent: _Node, child: _Node) -> None:
    """Take `child` out of `parent`'s children."""
    if child.prev_sibling is not None:
        child.prev_sibling.next_sibling = child.next_sibling
    else:
        parent.first_child = child.next_sibling
    if child.next_sibling is not None:
        child.next_sibling.prev_sibling = child.prev_sibling
    child.prev_sibling = child.next_sibling = None


class _Picking:
    """The victims of one `PrefixIndex.pick_leaves` call, picked branch by branch."""

    __slots__ = ("bit", "gone", "need", "picked", "skip", "tier", "victims")

    def __init__(self, tier: int, need: int, skip: Callable[[ChunkKey], bool] | None) -> None:
        self.tier, self.bit, self.need, self.skip = tier, 1 << tier, need, skip
        self.victims: list[ChunkKey] = []
        self.picked: set[ChunkKey] = set()
        self.gone: Counter[ChunkKey] = Counter()  # per parent, its children picked

    def _stays(self, node: _Node) -> bool:
        """Return whether a child of `node` in the tier is not picked (yet)."""
        return node.child_tiers[self.tier] > self.gone[node.key]

    def branch(self, root: _Node) -> None:
        """Pick `root`'s branch in the tier, until `need` victims are picked.

        In post-order, the children of a node oldest first (in the order they were
        indexed), so a branch's older sub-branches go first.
        """
        stack: list[tuple[_Node, bool]] = [(root, False)]
        while stack and len(self.victims) < self.need:
            node, expanded = stack.pop()
            if not expanded and self._stays(node):
                stack.append((node, True))
                stack.extend(  # newest first onto the stack: the oldest is taken first
                    (child, False)
                    for child in node.children()
                    if child.tiers & self.bit and child.key not in self.picked
                )
                continue
            if self._stays(node) or node.key in self.picked:
                continue  # something below it stays
            if node is not root and self.skip is not None and self.skip(node.key):
                continue
            self.victims.append(node.key)
            self.picked.add(node.key)
            if node.parent is not None:
                self.gone[node.parent.key] += 1
