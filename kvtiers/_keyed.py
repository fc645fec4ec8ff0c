"""The key-level half of `TieredCache`, for engines that hash their own pages.

An engine that already names its pages by chained hashes (SGLang's HiCache) maps them to
chunk keys under the layout fingerprint (`chunk_keys`) and then looks up, reads and writes
chunks by key, through the same tiers, index and checksums as the token-level calls.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvtiers._activity import Activity, tracked
from kvtiers._endpoints import ChunkSink, ChunkSource, Copies
from kvtiers._movement import Mover
from kvtiers._streaming import OnLayers, gather_layerwise
from kvtiers._tally import CallTally
from kvtiers._tensors import check_chunks, keep_hint
from kvtiers.core.errors import InvalidInputError, TokenError
from kvtiers.core.index import PrefixIndex
from kvtiers.core.keys import KEY_BYTES, ChunkHasher, ChunkKey
from kvtiers.core.layout import KVLayout

__all__ = ["KeyLevelAPI", "Salt"]

Salt = str | bytes | None


class KeyLevelAPI:
    """Look up, read and write chunks by key; mixed into `TieredCache`, whose state it uses."""

    layout: KVLayout
    _hasher: ChunkHasher
    _index: PrefixIndex
    _mover: Mover
    _tally: CallTally
    _activity: Activity
    _copies: Copies

    if TYPE_CHECKING:  # provided by TieredCache

        def _ensure_open(self) -> None: ...

        def _record_load(self, num_chunks: int, start: float) -> None: ...

        def _record_store(self, new_chunks: int, start: float) -> int: ...

    def chunk_keys(self, hashes: Any, *, salt: Salt = None) -> list[ChunkKey]:
        """Return the chunk keys of an engine's own chained page hashes, in order.

        Each hash is taken under the layout fingerprint and `salt`, so another model, shard
        or tenant never shares a key. One engine page is one chunk: the engine's page size
        must equal the layout's `chunk_size`.

        Raises:
            TokenError: `hashes` is not a sequence, or a hash is not a non-empty `str` or
                `bytes`.
        """
        if isinstance(hashes, str | bytes | bytearray) or not hasattr(hashes, "__iter__"):
            raise TokenError(
                f"hashes: expected a sequence of str or bytes, got {type(hashes).__name__}"
            )
        return self._hasher.keys_of_hashes(list(hashes), salt)

    @tracked
    async def lookup_keys(self, keys: Any) -> int:
        """Return how many leading `keys` (a chain, prefix first) some tier holds.

        The key-level form of `lookup`, with the same semantics and stats.

        Raises:
            InvalidInputError: a key is not 16 bytes.
        """
        start = time.perf_counter()
        keys = _check_keys(keys)
        num_chunks = await self._mover.lookup(keys)
        size = self.layout.chunk_size
        self._tally.lookup(len(keys) * size, num_chunks * size, time.perf_counter() - start)
        return num_chunks

    @tracked
    async def contains_keys(self, keys: Any) -> list[bool]:
        """Return, for each key on its own, whether some tier holds its chunk.

        Unlike `lookup_keys`, the keys need not be a chain: a gap does not end the answer.
        For engines that keep per-page side data (the state of a hybrid model's recurrent
        layers at some page boundaries only). No stats are counted.

        Raises:
            InvalidInputError: a key is not 16 bytes.
        """
        return await self._mover.contains(_check_keys(keys))

    @tracked
    async def get_chunks(
        self,
        keys: Any,
        dsts: Any,
        *,
        parent: ChunkKey | None = None,
        on_layers: OnLayers | None = None,
    ) -> list[bool]:
        """Fill `dsts[i]` with the chunk of `keys[i]` wherever some tier holds it.

        The keys need not be a prefix; each is served from the highest tier holding it and
        lower-tier hits are promoted, as in `load`. Entries that fail their checksum are
        misses. A destination is left untouched where its result is `False`, except in a
        layer-wise read: a chunk whose later wave failed keeps its earlier waves' layers.

        Args:
            keys: chunk keys (`chunk_keys` or `keys`).
            dsts: one chunk per key: a tensor of the layout's dtype and
                `kv_shape(chunk_size)` (a permuted view of an engine's host pool is fine), or
                a uint8 NumPy array of `chunk_bytes` bytes in payload order; host memory is
                filled by the tiers directly.
            parent: the key of the chunk before `keys[0]` in its chain, if any.
            on_layers: makes the read layer-wise, as for `load`; `num_tokens` then counts
                the leading run of `keys` (times `chunk_size`) whose layers are final.
                Pass only keys expected to hit: a missing key holds the waves back.

        Returns:
            Per key, whether its chunk was delivered.

        Raises:
            InvalidInputError: a key is not 16 bytes.
            LayoutMismatch: a destination has the wrong dtype or shape, or the counts differ.
        """
        start = time.perf_counter()
        keys = _check_keys(keys)
        _check_parent(parent)
        tensors = check_chunks(self.layout, dsts, len(keys), "dsts", writable=True)
        sink = ChunkSink(self.layout, tensors, self._copies)
        if on_layers is not None:
            found = await gather_layerwise(self._mover, keys, sink, self.layout, on_layers)
        else:
            found = await self._mover.gather(keys, sink)
        if parent is not None and keys:
            self._index.attach(keys[0], parent)
        self._record_load(sum(found), start)
        return found

    @tracked
    async def put_chunks(
        self,
        keys: Any,
        srcs: Any,
        *,
        parent: ChunkKey | None = None,
        keep_chunks: int | None = None,
    ) -> list[bool]:
        """Cache the chunk `srcs[i]` under `keys[i]`, as `store` does for token chunks.

        `keys` is a piece of a chain in prefix order; `parent`, the key of the chunk
        before `keys[0]`, links the piece to its prefix so eviction stays leaf-first.
        `keep_chunks` is the reuse hint (`store`'s `keep_tokens`), counted in the piece's
        leading chunks.

        Returns:
            Per key, whether a tier holds it now.

        Raises:
            InvalidInputError: a key is not 16 bytes, or a bad `keep_chunks`.
            LayoutMismatch: a source has the wrong dtype or shape, or the counts differ.
        """
        start = time.perf_counter()
        keys = _check_keys(keys)
        _check_parent(parent)
        keep = keep_hint("keep_chunks", keep_chunks)
        tensors = check_chunks(self.layout, srcs, len(keys), "srcs")
        source = ChunkSource(self.layout, tensors, self._copies)
        new_chunks = await self._mover.store(keys, source, keep) if keys else 0
        if parent is not None and keys:
            self._index.attach(keys[0], parent)
        self._record_store(new_chunks, start)
        return self._mover.held(keys)


def _check_keys(keys: Any) -> list[ChunkKey]:
    if isinstance(keys, bytes | str) or not hasattr(keys, "__iter__"):
        raise InvalidInputError("keys: expected a sequence of 16-byte chunk keys")
    out = list(keys)
    for i, key in enumerate(out):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidInputError(f"keys[{i}]: expected {KEY_BYTES} bytes, got {key!r:.40}")
    return out


def _check_parent(parent: Any) -> None:
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES):
        raise InvalidInputError(f"parent: expected {KEY_BYTES} bytes or None, got {parent!r:.40}")
