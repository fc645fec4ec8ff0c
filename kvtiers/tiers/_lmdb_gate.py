"""Beginning the lmdb tier's transactions in a path that other processes share.

Every transaction of the tier begins through `MapGate`, which adopts what other processes
sharing the path changed: a map they grew past this process's, reader slots they died in.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import lmdb

__all__ = ["MapGate", "map_size_over", "reader_pins_pages"]


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

    @contextlib.contextmanager
    def try_read(self, db: lmdb._Database) -> Iterator[lmdb.Transaction[memoryview] | None]:
        """Yield a read transaction that began without waiting, or `None`.

        `None` where `begin` could wait: a remap is under way (it waits for every
        transaction of the process), or beginning needs one (the map grew) or a reader
        slot freed. For a caller that must not block, the event loop: it goes the slow way.

        Raises:
            lmdb.Error: the environment is closed.
        """
        txn = None
        if self._enter(wait=False):
            try:
                txn = self.env.begin(db=db, buffers=True)
            except lmdb.Error:
                self._leave()
        if txn is None:
            yield None
            return
        try:
            yield txn
        finally:
            txn.abort()
            self._leave()

    def close(self) -> None:
        """Close the environment once this process's transactions end; refuse new ones."""
        with self._cond:
            self._closed = True
            while self._active:
                self._cond.wait()
            self.env.close()

    def _enter(self, wait: bool = True) -> bool:
        """Count a transaction in; without `wait`, return `False` where that would wait."""
        # NOTE: a remap holds the lock while it runs: not even the check may wait for it.
        if not self._cond.acquire(blocking=wait):
            return False
        try:
            while self._remapping:
                if not wait:
                    return False
                self._cond.wait()
            if self._closed:
                raise lmdb.Error("the environment is closed")
            self._active += 1
            return True
        finally:
            self._cond.release()

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
