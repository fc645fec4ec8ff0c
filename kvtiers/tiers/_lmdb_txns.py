"""The lmdb tier's write transactions: the reads' recency first, then the batch's work.

Reads keep the keys they hit in memory (`PendingTouches`); every write transaction records
them first, then runs the tier's work (`Writer` methods), and commits both or neither. A
map that fills up is grown to another process's larger map, or has dead processes' reader
slots freed, and the write is tried once more. Every method blocks; the tier runs them in
its thread pool.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import lmdb

from kvtiers.tiers._lmdb_format import Databases, Writer
from kvtiers.tiers._lmdb_gate import MapGate
from kvtiers.tiers._lmdb_writes import PendingTouches, record_touches

__all__ = ["WriteTransactions"]

_T = TypeVar("_T")
logger = logging.getLogger("kvtiers")


class WriteTransactions:
    """Run a tier's writes, each in one write transaction, after the reads' recency.

    Args:
        name: the tier's name (for logs).
        handles: returns the open environment's gate and databases (raises once closed).
        limit: returns the bytes of values the tier may hold now (it may be lowered).
        committed: called after each commit with the keys the transaction evicted, and
            how many chunks read since the last write were parked (stored cold) until then.
    """

    def __init__(
        self,
        name: str,
        handles: Callable[[], tuple[MapGate, Databases]],
        limit: Callable[[], int],
        committed: Callable[[list[bytes], int], None],
    ) -> None:
        self._name = name
        self._handles = handles
        self._limit = limit
        self._committed = committed
        self.touched = PendingTouches()
        """Hit batches, recorded by the next write."""

    def write(self, fn: Callable[[Writer], _T], cancel: threading.Event) -> _T | None:
        """Run `fn` in one write transaction; `None` if it was cancelled.

        Recency that reads recorded is flushed first, in the same transaction. A map that
        fills up is grown to another process's larger map first, if there is one.
        """
        try:
            return self._write_once(fn, cancel)
        except lmdb.MapFullError:
            if not self._handles()[0].grow():
                raise
            return self._write_once(fn, cancel)

    def _write_once(self, fn: Callable[[Writer], _T], cancel: threading.Event) -> _T | None:
        gate, dbs = self._handles()
        if cancel.is_set():
            return None
        touched = self.touched.take()
        committed = False
        try:
            with gate.begin(write=True) as txn:
                writer = Writer(txn, dbs, self._limit())
                unparked = record_touches(writer, touched)
                result = fn(writer)
                writer.save()
                if not cancel.is_set():
                    txn.commit()
                    committed = True
        finally:
            if not committed:
                self.touched.put_back(touched)
        if not committed:
            return None
        self._committed(writer.evicted, unparked)
        return result

    def write_freeing_dead_readers(
        self, fn: Callable[[Writer], _T], cancel: threading.Event
    ) -> _T | None:
        """`write`; on a full map, free dead processes' reader slots and try once more.

        NOTE: a process killed mid-read leaves its reader slot, which pins the snapshot it
        read: pages freed since cannot be reused, so the map fills although the capacity
        holds. Opening a path frees such slots; a cache that stays open frees them here.
        """
        try:
            return self.write(fn, cancel)
        except lmdb.MapFullError:
            gate, _ = self._handles()
            if not gate.env.reader_check():
                raise
            logger.info("kvtiers: lmdb tier %s freed reader slots of dead processes", self._name)
            return self.write(fn, cancel)
