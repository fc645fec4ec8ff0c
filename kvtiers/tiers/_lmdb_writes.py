"""The lmdb tier's writes: recency that reads recorded, and new values.

Reads keep the keys they hit in memory (`PendingTouches`), so a read needs no write
transaction; the next write transaction records them first (`record_touches`). A batch's
new values go in by `store_new`, which evicts the oldest entries to make room and packs
each value into a buffer its thread reuses (`ValuePacker`). Both functions run inside a
write transaction and block; the tier runs them in its thread pool.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvtiers.core.keys import ChunkKey
from kvtiers.tiers import _lmdb_format as fmt
from kvtiers.tiers._lmdb_format import Writer
from kvtiers.tiers.base import Buffer

__all__ = [
    "PendingTouches",
    "Stored",
    "ValuePacker",
    "last_touches",
    "record_touches",
    "store_new",
]

_MAX_TOUCHED = 4096
"""Touched keys held in memory before a read flushes them itself."""


class PendingTouches:
    """Touched keys, in batches, held until a write transaction records them.

    Safe to use from several threads at once (the tier's pool and the event loop).
    """

    def __init__(self) -> None:
        self._batches: list[list[ChunkKey]] = []
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._batches)

    def add(self, keys: Sequence[ChunkKey]) -> bool:
        """Hold `keys` as one batch; return whether a read should flush them now."""
        with self._lock:
            self._batches.append(list(keys))
            return sum(map(len, self._batches)) >= _MAX_TOUCHED

    def take(self) -> list[list[ChunkKey]]:
        """Return the batches held, oldest first, and hold none."""
        with self._lock:
            batches, self._batches = self._batches, []
        return batches

    def put_back(self, batches: list[list[ChunkKey]]) -> None:
        """Hold `batches` again, before those added since (a write aborted)."""
        with self._lock:
            self._batches[:0] = batches

    def clear(self) -> None:
        """Drop every batch held."""
        with self._lock:
            self._batches.clear()


def record_touches(writer: Writer, batches: list[list[ChunkKey]]) -> int:
    """Touch the keys of `batches` that `writer` holds, in the order touched.

    Returns:
        How many of them were parked (stored cold, not read since) until now.
    """
    unparked = 0
    for batch in last_touches(batches):
        held = [(key, size) for key in batch if (size := writer.size(key)) is not None]
        unparked += writer.touch([key for key, _ in held], [size for _, size in held])
    return unparked


def last_touches(batches: list[list[ChunkKey]]) -> list[list[ChunkKey]]:
    """Keep each key only in the last batch that touched it, in order.

    Touching batches in order leaves each key at the recency of its last touch; dropping its
    earlier touches leaves every key in the same relative order, with less to write (hot
    prefixes are read again and again between two writes).
    """
    seen: set[ChunkKey] = set()
    out: list[list[ChunkKey]] = []
    for batch in reversed(batches):
        kept: list[ChunkKey] = []
        for key in reversed(batch):
            if key not in seen:
                seen.add(key)
                kept.append(key)
        if kept:
            out.append(kept[::-1])
    return out[::-1]


class ValuePacker:
    """Pack chunks into values, each thread into a buffer of its own.

    Args:
        fingerprint: the layout's fingerprint, written into every header.
        value_len: bytes of one value (header and payload).
        auth_key: the integrity secret that tags each value; `None` when off.
    """

    def __init__(self, fingerprint: bytes, value_len: int, auth_key: bytes | None) -> None:
        self.fingerprint, self.value_len, self.auth_key = fingerprint, value_len, auth_key
        self._local = threading.local()  # per thread: a reused buffer to pack a value into

    def buffer(self) -> memoryview:
        """Return this thread's buffer for one value, made on its first write."""
        out: memoryview | None = getattr(self._local, "pack", None)
        if out is None:
            out = self._local.pack = memoryview(bytearray(self.value_len))
        return out

    def pack(self, out: memoryview, key: bytes, src: Buffer) -> memoryview:
        """Pack chunk `src` under `key` into `out`; return the value in `out`."""
        flat = np.ascontiguousarray(src).reshape(-1)
        return fmt.pack_value_into(out, self.fingerprint, key, flat.data, auth_key=self.auth_key)


class Stored(NamedTuple):
    """What a batch's write (`store_new`) left in the tier."""

    held: set[bytes]
    """The batch's keys the tier holds after the write."""
    new: int
    """Keys written, the cold ones included."""
    declined: int
    """Keys not written for want of room."""
    parked: int
    """Of `new`, keys written cold (first in line for eviction)."""


def store_new(
    writer: Writer,
    keys: Sequence[ChunkKey],
    srcs: Sequence[Buffer],
    packer: ValuePacker,
    limit: int,
    cold: frozenset[bytes] = frozenset(),
) -> Stored:
    """Write the batch's new keys that fit, evicting the oldest entries first.

    The tier holds at most `limit` bytes of values; `packer` packs each new chunk. New keys
    in `cold` (a reuse hint: none is expected) go first in line for eviction, and take
    room only from free space and other such entries (else they are declined, with every
    deeper key); the batch's other keys become the most recently used.

    Returns:
        What the batch left: see `Stored`.
    """
    value_len = packer.value_len
    srcs_by_key = dict(zip(keys, srcs, strict=True))
    kept: dict[bytes, int] = {}  # key -> its value's size
    new: list[bytes] = []
    held, full = 0, False
    for key in srcs_by_key:
        size = writer.size(key)
        if size is None:
            # NOTE: once a chunk does not fit, no deeper chunk is stored without it.
            full = full or held + value_len > limit
            if full:
                continue
            new.append(key)
            size = value_len
        kept[key] = size
        held += size
    num_warm = sum(1 for key in new if key not in cold)
    writer.evict(num_warm * value_len, keep=set(kept))
    if num_warm < len(new):
        writer.evict(len(new) * value_len, keep=set(kept), cold_only=True)
    while new and writer.used + len(new) * value_len > limit:
        del kept[new.pop()]  # what is left is held by this batch or unaccounted
    out = packer.buffer()
    for new_key in new:
        value = packer.pack(out, new_key, srcs_by_key[ChunkKey(new_key)])
        writer.insert(new_key, value)  # LMDB copies it: `out` is free again
        kept[new_key] = len(value)
    parked = {key: kept.pop(key) for key in new if key in cold} if cold else {}
    writer.touch(list(kept), list(kept.values()))
    writer.park(list(parked), list(parked.values()))
    declined = len(srcs_by_key) - len(kept) - len(parked)
    return Stored(set(kept) | set(parked), len(new), declined, len(parked))
