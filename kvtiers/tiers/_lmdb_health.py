"""When an lmdb tier's writes fail: a full map or a full disk, logged once per episode.

A full disk or map fails every write batch until space frees; a log line per batch would
bury everything else. `WriteHealth` warns at the first failure of an episode, and again
only if a new episode starts `REWARN_SECONDS` later: a nearly full disk lets a write
through now and then, which must not restart the warnings. The tier counts each declined
chunk (`declined`) and failed batch (`errors`).
"""

from __future__ import annotations

import logging
import math
import threading
import time

__all__ = ["WriteHealth"]

logger = logging.getLogger("kvtiers")

REWARN_SECONDS = 300.0
"""Least time between two warnings about failing writes."""


class WriteHealth:
    """Whether a tier's writes fail now, and whether its map ever filled up.

    Args:
        name: the tier's name, for logs.
        path: the environment's folder, for logs.
    """

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path
        self.failing = False
        """A write failed, and no write stored anything since."""
        self.map_was_full = False
        self._warned_at = -math.inf
        self._lock = threading.Lock()  # writes run in the tier's thread pool

    def failed(self, exc: BaseException) -> None:
        """Record a failed write batch (LMDB reports a full disk as a short write, EIO)."""
        now = time.monotonic()
        with self._lock:
            warn = not self.failing and now - self._warned_at >= REWARN_SECONDS
            self.failing = True
            if warn:
                self._warned_at = now
        if warn:
            logger.warning(
                "kvtiers: lmdb tier %r: writes to %r fail (%s); declining them until one "
                "goes through, reads go on",
                self.name,
                self.path,
                exc,
            )

    def stored(self) -> None:
        """Record a write batch that stored new entries: an episode of failures ends."""
        with self._lock:
            recovered, self.failing = self.failing, False
        if recovered:
            logger.debug("kvtiers: lmdb tier %r: writes go through again", self.name)

    def map_full(self, map_size: int, limit: int) -> None:
        """Record that the map filled up before the capacity; the tier now holds `limit`."""
        with self._lock:
            first, self.map_was_full = not self.map_was_full, True
        if first:
            logger.warning(
                "kvtiers: lmdb tier %r: the map (%d bytes) at %r filled up before the "
                "capacity; holding at most %d bytes from now on (raise map_size)",
                self.name,
                map_size,
                self.path,
                limit,
            )
