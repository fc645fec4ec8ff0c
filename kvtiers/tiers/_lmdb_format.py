"""The on-disk format of the lmdb tier: its four databases and its values.

The environment holds four named databases (see `Databases`); `Writer` keeps them consistent
within one write transaction: the bytes used in `meta`, recency in `lru` and `seqs`, and
each value's size in `seqs` too, so that existence and sizes are known without touching a
value: py-lmdb faults in every page of a value it returns (with the GIL released, so
threads do not stall on it), which for a cold value is a read of it all from the disk.
Entries of releases before sizes were kept in `seqs` (an 8-byte `seqs` value) are still
read: their size is taken from the value. Processes sharing a path should run one release.
Recency is a sequence number per entry, the oldest evicted first; sequence 0 marks entries
put with no reuse expected (a reuse hint, `Writer.park`), which therefore go first.

A value is a chunk in the format of `kvtiers.tiers._chunk_format` (shared with the remote
tier), written with six header fields (no per-layer checksums), or eight with an integrity
tag (`integrity = "hmac-sha256"`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import NamedTuple

import lmdb

from kvtiers.core.layout import KVLayout
from kvtiers.tiers import _layout_record as layout_record
from kvtiers.tiers._chunk_format import (
    FORMAT_VERSION,
    MAGIC,
    Verdict,
    check_value,
    pack_value,
    pack_value_into,
    value_bytes,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Databases",
    "ModeMismatch",
    "Verdict",
    "Writer",
    "check_value",
    "check_writemap",
    "default_map_size",
    "entry_size",
    "map_capacity",
    "open_databases",
    "pack_value",
    "pack_value_into",
    "read_used_bytes",
    "value_bytes",
]

_U64 = struct.Struct(">Q")  # big-endian, so the lru database iterates in sequence order
_PARKED = _U64.pack(0)  # the sequence of entries put with no reuse expected
_USED, _NEXT_SEQ = b"used_bytes", b"next_seq"
_PAGE = 4096  # LMDB's page size on the common platforms


def default_map_size(capacity_bytes: int, value_len: int) -> int:
    """Return a map size that holds `capacity_bytes` of `value_len` values."""
    # NOTE: a value over half a page lives on overflow pages (16-byte header each), so it takes
    # whole pages, and each entry has nodes in three B-trees. A quarter more leaves room for the
    # pages copy-on-write frees only at commit; 64 MiB for branch pages and the free list.
    per_value = math.ceil((value_len + 16) / _PAGE) * _PAGE + 256
    size = int(capacity_bytes // value_len * per_value * 1.25) + 64 * 2**20
    return -(-size // 2**20) * 2**20


def map_capacity(map_size: int, value_len: int) -> int:
    """Return the bytes of `value_len` values a map of `map_size` bytes holds safely.

    The inverse of `default_map_size`: a map given explicitly may be smaller than the
    capacity, and a map that fills up fails even deletes (they need free pages too), so
    the tier evicts by this limit instead. Small maps keep half their size in reserve.
    """
    per_value = math.ceil((value_len + 16) / _PAGE) * _PAGE + 256
    usable = map_size - min(64 * 2**20, map_size // 2)
    return int(usable / 1.25) // per_value * value_len


class Databases(NamedTuple):
    """Handles of the environment's named databases."""

    chunks: lmdb._Database  # key -> header-prefixed value
    lru: lmdb._Database  # seq (u64) ‖ key -> b"": iterates least recently used first
    seqs: lmdb._Database  # key -> seq (u64) ‖ value size (u64): finds a key's lru entry
    meta: lmdb._Database  # used_bytes, next_seq -> u64


def open_databases(env: lmdb.Environment) -> Databases:
    """Open (creating if missing) the named databases of `env`."""
    return Databases(*(env.open_db(name.encode()) for name in Databases._fields))


class ModeMismatch(Exception):
    """The environment was created with another `writemap` setting than asked for."""


_WRITEMAP = b"writemap"


def check_writemap(env: lmdb.Environment, dbs: Databases, writemap: bool) -> None:
    """Record the environment's `writemap` setting on first use; refuse another later.

    LMDB forbids processes with and without `MDB_WRITEMAP` on one environment.

    Raises:
        ModeMismatch: the environment records the other setting.
    """
    want = b"1" if writemap else b"0"
    with env.begin(db=dbs.meta) as txn:
        have = txn.get(_WRITEMAP)
    if have is None:
        with env.begin(write=True, db=dbs.meta) as txn:
            have = txn.get(_WRITEMAP)
            if have is None:
                txn.put(_WRITEMAP, want)
                return
    if bytes(have) != want:
        was = "true" if bytes(have) == b"1" else "false"
        raise ModeMismatch(
            f"created with writemap = {was}; every process on a path must use the same"
        )


def record_layout(env: lmdb.Environment, dbs: Databases, layout: KVLayout) -> None:
    """Note `layout` in the environment (see `_layout_record`), unless it is noted already."""
    key = layout_record.LMDB_PREFIX + layout.fingerprint
    with env.begin(db=dbs.meta) as txn:
        if txn.get(key) is not None:
            return
    with env.begin(write=True, db=dbs.meta) as txn:
        txn.put(key, layout_record.encode(layout), overwrite=False)


def entry_size(txn: lmdb.Transaction[memoryview], dbs: Databases, key: bytes) -> int | None:
    """Return the size of the value under `key` as of `txn`, `None` if there is none."""
    meta = txn.get(key, db=dbs.seqs)
    if meta is not None and len(meta) == 2 * _U64.size:
        return int(_U64.unpack_from(meta, _U64.size)[0])
    raw = txn.get(key, db=dbs.chunks)  # an entry of an earlier release: measured from its value
    return None if raw is None else len(raw)


def read_used_bytes(txn: lmdb.Transaction[memoryview], dbs: Databases) -> int:
    """Return the bytes of stored values, as of `txn`."""
    return _read_u64(txn, dbs, _USED)


def _read_u64(txn: lmdb.Transaction[memoryview], dbs: Databases, name: bytes) -> int:
    raw = txn.get(name, db=dbs.meta)
    return 0 if raw is None else int(_U64.unpack(raw)[0])


class Writer:
    """Keep sizes and recency consistent within one write transaction.

    Every method blocks; run them off the event loop.
    """

    def __init__(self, txn: lmdb.Transaction[memoryview], dbs: Databases, capacity: int) -> None:
        self.txn, self.dbs, self.capacity = txn, dbs, capacity
        self.used = _read_u64(txn, dbs, _USED)  # bytes of stored values
        # NOTE: sequence 0 is for entries put with no reuse expected (`park`).
        self.next_seq = max(1, _read_u64(txn, dbs, _NEXT_SEQ))
        self.evicted: list[bytes] = []  # keys evicted in this transaction

    def save(self) -> None:
        self.txn.put(_USED, _U64.pack(self.used), db=self.dbs.meta)
        self.txn.put(_NEXT_SEQ, _U64.pack(self.next_seq), db=self.dbs.meta)

    def size(self, key: bytes) -> int | None:
        """Return the size of the value under `key`, `None` if there is none.

        Read from `seqs`, not from the value (see the module docstring).
        """
        return entry_size(self.txn, self.dbs, key)

    def touch(self, keys: Sequence[bytes], sizes: Sequence[int]) -> int:
        """Make `keys` (values of `sizes` bytes) the most recently used, the last the oldest.

        Keys come prefix-first, so a chain's deepest chunk is evicted before its prefix.

        Returns:
            How many of `keys` were parked (see `park`) until now.
        """
        base, n = self.next_seq, len(keys)
        self.next_seq += n
        return sum(
            self._place(key, size, _U64.pack(base + n - 1 - i))
            for i, (key, size) in enumerate(zip(keys, sizes, strict=True))
        )

    def park(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """Put `keys` first in line for eviction (sequence 0): no reuse is expected.

        A later touch (a read) gives them a sequence of their own again.
        """
        for key, size in zip(keys, sizes, strict=True):
            self._place(key, size, _PARKED)

    def _place(self, key: bytes, size: int, seq: bytes) -> bool:
        """Give `key` (a value of `size` bytes) the recency `seq`; return if it was parked."""
        old = self.txn.get(key, db=self.dbs.seqs)
        was_parked = False
        if old is not None:
            was_parked = old[: _U64.size] == _PARKED
            self.txn.delete(bytes(old[: _U64.size]) + key, db=self.dbs.lru)
        self.txn.put(seq + key, b"", db=self.dbs.lru)
        self.txn.put(key, seq + _U64.pack(size), db=self.dbs.seqs)
        return was_parked

    def insert(self, key: bytes, value: bytes | memoryview) -> None:
        self.txn.put(key, value, db=self.dbs.chunks)
        self.used += len(value)

    def remove(self, key: bytes) -> bool:
        size = self.size(key)
        if size is not None:
            self.txn.delete(key, db=self.dbs.chunks)
            self.used -= size
        # NOTE: no txn.pop: a buffer into a page this transaction changes can be overwritten.
        old = self.txn.get(key, db=self.dbs.seqs)
        if old is not None:
            self.txn.delete(bytes(old[: _U64.size]) + key, db=self.dbs.lru)
            self.txn.delete(key, db=self.dbs.seqs)
        return size is not None

    def discard(
        self,
        keys: Sequence[bytes],
        fingerprint: bytes,
        payload_len: int,
        *,
        auth_key: bytes | None = None,
    ) -> list[Verdict]:
        """Remove the entries under `keys` that fail `check_value`.

        Returns:
            The verdict of each entry removed.
        """
        verdicts: list[Verdict] = []
        for key in keys:
            raw = self.txn.get(key, db=self.dbs.chunks)
            if raw is not None:
                verdict, _ = check_value(
                    raw,
                    fingerprint=fingerprint,
                    key=key,
                    payload_len=payload_len,
                    auth_key=auth_key,
                )
                if verdict is not Verdict.OK:
                    verdicts.append(verdict)
                    self.remove(key)
        return verdicts

    def evict(
        self, need: int, keep: set[bytes], limit: int | None = None, *, cold_only: bool = False
    ) -> None:
        """Remove least recently used entries until `need` more bytes fit.

        Args:
            need: bytes about to be added.
            keep: keys that must stay, whatever their age.
            limit: what `used` plus `need` may reach; the capacity by default.
            cold_only: remove only parked entries (see `park`), which come first.
        """
        limit = self.capacity if limit is None else limit
        victims, freed = [], 0
        with self.txn.cursor(db=self.dbs.lru) as cursor:
            for entry in cursor.iternext(values=False):
                if self.used - freed + need <= limit or (cold_only and entry[:8] != _PARKED):
                    break
                key = bytes(entry[_U64.size :])
                if key not in keep:
                    victims.append(key)
                    freed += self.size(key) or 0
        self.evicted += [key for key in victims if self.remove(key)]
