"""The on-disk format of the lmdb tier: its four databases and its values.

The environment holds four named databases (see `Databases`); `Writer` keeps them consistent
within one write transaction: the bytes used in `meta`, recency in `lru` and `seqs`, and
each value's size in `seqs` too, so that existence and sizes are known without touching a
value: py-lmdb faults in every page of a value it returns (with the GIL released, so
threads do not stall on it), which for a cold value is a read of it all from the disk.
Entries of releases before sizes were kept in `seqs` (an 8-byte `seqs` value) are still
read: their size is taken from the value. Processes sharing a path should run one release.

Every transaction of the tier begins through `MapGate`, which adopts what other processes
sharing the path changed: a map they grew past this process's, reader slots they died in.

A value is a chunk in the format of `kvtiers.tiers._chunk_format` (shared with the remote
tier), written with six header fields (no per-layer checksums), or eight with an integrity
tag (`integrity = "hmac-sha256"`).
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
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
    "MapGate",
    "ModeMismatch",
    "Verdict",
    "Writer",
    "check_value",
    "check_writemap",
    "default_map_size",
    "entry_size",
    "map_capacity",
    "map_size_over",
    "open_databases",
    "pack_value",
    "pack_value_into",
    "read_used_bytes",
    "reader_pins_pages",
    "value_bytes",
]

_U64 = struct.Struct(">Q")  # big-endian, so the lru database iterates in sequence order
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


def map_size_over(map_size: int, file_bytes: int, writemap: bool) -> int:
    """Return the map size to map a data file of `file_bytes` with, `map_size` asked for.

    A map never ends before the file: with `writemap` LMDB truncates the file to the map's
    size, under the maps of other processes, whose next write past the new end is a SIGBUS.
    Without `writemap` a file past the map leaves no room to write; it gets `map_size` more.
    """
    if file_bytes <= map_size:
        return map_size
    if writemap:  # the file is allocated whole to a map size already: no more of it
        return file_bytes
    return -(-(file_bytes + map_size) // 2**20) * 2**20


def reader_pins_pages(env: lmdb.Environment) -> bool:
    """Return whether a live reader holds a snapshot older than the last two commits.

    LMDB reuses no page freed since the oldest snapshot a reader holds: while such a reader
    lives, the map only fills, and neither evicting nor holding less makes room.
    """
    last = env.info()["last_txnid"]
    for line in env.readers().splitlines()[1:]:  # pid, thread, txnid ("-": slot unused)
        fields = line.split()
        if len(fields) == 3 and fields[2].isdigit() and int(fields[2]) < last - 1:
            return True
    return False


_ATTEMPTS = 3  # begins of one transaction: other processes may act between them


class MapGate:
    """Begin the transactions of one process's environment, recovering from other processes.

    A process that shares the path with a larger map may grow the data past this process's
    map: each begin then fails (`MDB_MAP_RESIZED`) until this process maps more. Processes
    killed mid-read keep their reader slots: once they hold every slot, each read fails
    (`MDB_READERS_FULL`) until the dead ones are freed. The gate does both and begins again.
    LMDB remaps only while no transaction of the process runs, so a transaction holds the
    gate shared and a remap waits for them all, holding new ones back.

    Args:
        env: the open environment.
        map_size: the map size this process asked for (the room a remap leaves).
        writemap: whether the environment was opened with `writemap`.
    """

    def __init__(self, env: lmdb.Environment, map_size: int, writemap: bool) -> None:
        self.env, self.map_size, self.writemap = env, map_size, writemap
        self._data = os.path.join(env.path(), "data.mdb")
        self._cond = threading.Condition()
        self._active = 0  # transactions begun and not yet ended
        self._remapping = False
        self._closed = False

    @contextlib.contextmanager
    def begin(
        self, *, write: bool = False, db: lmdb._Database | None = None
    ) -> Iterator[lmdb.Transaction[memoryview]]:
        """Yield a new transaction, ended (aborted unless committed) on exit.

        Raises:
            lmdb.Error: it cannot begin; a full map or reader table only once recovery
                failed.
        """
        for attempt in range(_ATTEMPTS):
            self._enter()
            try:
                txn = self.env.begin(db=db, write=write, buffers=True)
            except (lmdb.MapResizedError, lmdb.ReadersFullError) as exc:
                self._leave()
                if attempt + 1 == _ATTEMPTS or not self._recover(exc):
                    raise
                continue
            except BaseException:
                self._leave()
                raise
            try:
                yield txn
            finally:
                txn.abort()  # nothing after a commit: a read ends, a write is rolled back
                self._leave()
            return

    def close(self) -> None:
        """Close the environment once this process's transactions end; refuse new ones."""
        with self._cond:
            self._closed = True
            while self._active:
                self._cond.wait()
            self.env.close()

    def _enter(self) -> None:
        with self._cond:
            while self._remapping:
                self._cond.wait()
            if self._closed:
                raise lmdb.Error("the environment is closed")
            self._active += 1

    def _leave(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def grow(self) -> bool:
        """Map as much as another process maps, if that is more; return whether it grew.

        A write that fills this process's map may fit in the map of a process that shares
        the path with a larger one (and grew the data into this one's room).
        """
        return self._alone(self._remap)

    def _recover(self, exc: lmdb.Error) -> bool:
        """Free dead readers' slots or map the grown data; return whether to begin again."""
        if isinstance(exc, lmdb.ReadersFullError):
            return self.env.reader_check() > 0
        self._alone(self._remap)
        return True

    def _alone(self, remap: Callable[[], bool]) -> bool:
        """Run `remap` once no transaction of this process runs, holding new ones back."""
        with self._cond:
            if self._remapping:  # another thread remaps: begin again after it
                while self._remapping:
                    self._cond.wait()
                return True
            self._remapping = True
            try:
                while self._active:
                    self._cond.wait()
                return not self._closed and remap()  # closed meanwhile: begins are refused
            finally:
                self._remapping = False
                self._cond.notify_all()

    def _remap(self) -> bool:
        """Map the pages other processes wrote and the map they use; return if it grew."""
        old = self.env.info()["map_size"]
        pages = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        if self.writemap:  # the file is allocated to the largest map: map it, no more
            size = max(old, pages, os.path.getsize(self._data))
        else:
            self.env.set_mapsize(0)  # the largest map size a process committed with
            adopted = self.env.info()["map_size"]
            size = max(old, adopted, map_size_over(self.map_size, pages, False))
        if size != self.env.info()["map_size"]:
            self.env.set_mapsize(size)
        return size > old


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
        self.next_seq = _read_u64(txn, dbs, _NEXT_SEQ)
        self.evicted: list[bytes] = []  # keys evicted in this transaction

    def save(self) -> None:
        self.txn.put(_USED, _U64.pack(self.used), db=self.dbs.meta)
        self.txn.put(_NEXT_SEQ, _U64.pack(self.next_seq), db=self.dbs.meta)

    def size(self, key: bytes) -> int | None:
        """Return the size of the value under `key`, `None` if there is none.

        Read from `seqs`, not from the value (see the module docstring).
        """
        return entry_size(self.txn, self.dbs, key)

    def touch(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """Make `keys` (values of `sizes` bytes) the most recently used, the last the oldest.

        Keys come prefix-first, so a chain's deepest chunk is evicted before its prefix.
        """
        base, n = self.next_seq, len(keys)
        self.next_seq += n
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            seq = _U64.pack(base + n - 1 - i)
            old = self.txn.get(key, db=self.dbs.seqs)
            if old is not None:
                self.txn.delete(bytes(old[: _U64.size]) + key, db=self.dbs.lru)
            self.txn.put(seq + key, b"", db=self.dbs.lru)
            self.txn.put(key, seq + _U64.pack(size), db=self.dbs.seqs)

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

    def evict(self, need: int, keep: set[bytes], limit: int | None = None) -> None:
        """Remove least recently used entries until `need` more bytes fit.

        Args:
            need: bytes about to be added.
            keep: keys that must stay, whatever their age.
            limit: what `used` plus `need` may reach; the capacity by default.
        """
        limit = self.capacity if limit is None else limit
        victims, freed = [], 0
        with self.txn.cursor(db=self.dbs.lru) as cursor:
            for entry in cursor.iternext(values=False):
                if self.used - freed + need <= limit:
                    break
                key = bytes(entry[_U64.size :])
                if key not in keep:
                    victims.append(key)
                    freed += self.size(key) or 0
        self.evicted += [key for key in victims if self.remove(key)]
