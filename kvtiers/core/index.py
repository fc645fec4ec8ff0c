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
        up.num_children += 1
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
        """Return up to `need` of `candidates`, in their order, that may leave `tier` together.

        Only leaves of the tier go, so no tier holds a suffix without its prefix; a parent
        counts as a leaf once all its children in the tier are already picked. Candidates
        for which `skip` is true are passed over. Both the cache and the replay evict so.
        """
        gone: Counter[ChunkKey] = Counter()
        victims: list[ChunkKey] = []
        for candidate in candidates:
            key = cast(ChunkKey, candidate)
            if (skip is not None and skip(key)) or self.children_in(key, tier) > gone[key]:
                continue
            victims.append(key)
            parent = self.parent_of(key)
            if parent is not None:
                gone[parent] += 1
            if len(victims) >= need:
                break
        return victims

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
                parent.num_children += 1
            parent = node
        assert node is not None
        return node

    def _prune(self, node: _Node | None) -> None:
        while node is not None and not node.tiers and not node.num_children:
            del self._nodes[node.key]
            parent = node.parent
            if parent is not None:
                parent.num_children -= 1
            node = parent
