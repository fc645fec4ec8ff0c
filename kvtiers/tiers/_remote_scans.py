"""The remote tier's scans: when they run, the access log they write, what they delete.

A scan writes this process's access log if it changed, lists the namespace with every
process's log merged in (`_remote_access.scan`), and deletes what is past its time: objects
idle for longer than `ttl`, temporaries left by a crashed write, and the access logs of
processes long gone. The tier then refills its catalog from what is left and evicts what
is over its capacity (see the `remote` module docstring for why scans exist at all).
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtiers.core.stats import TierCounters
from kvtiers.tiers._remote_access import AccessLog, scan
from kvtiers.tiers._remote_breaker import StoreUnavailable, gather_all
from kvtiers.tiers._remote_catalog import ACCESS_DIR, Catalog, Listing, StoredObject
from kvtiers.tiers._remote_io import ObjectStore
from kvtiers.tiers._remote_options import RemoteOptions

__all__ = ["Scanner", "Sweep"]

logger = logging.getLogger("kvtiers")

_TEMP_AGE = 3600.0  # seconds after which a scan deletes a temporary file left by a crash
_LOG_AGE = 86400.0  # seconds after which a scan deletes another process's idle access log


@dataclass(frozen=True, slots=True)
class Sweep:
    """What one scan left and what it expired."""

    kept: list[StoredObject]
    """The chunk objects left in the namespace."""
    expired: list[bytes]
    """The keys of the chunk objects it deleted for their age (`ttl`)."""


class Scanner:
    """Scan one tier's namespace now and then; write this process's access log.

    Args:
        store: the store the namespace is in.
        log: this process's access log.
        options: the tier's options (`scan_interval`, `ttl`).
        counters: the tier's counters, where failed scans and deletes are counted.
        name: the tier's name, for logs.
    """

    def __init__(
        self,
        store: ObjectStore,
        log: AccessLog,
        options: RemoteOptions,
        counters: TierCounters,
        name: str,
    ) -> None:
        self._store, self._log, self._options = store, log, options
        self._counters, self._name = counters, name
        host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]
        self.writer_id = f"{host}-{os.getpid()}-{secrets.token_hex(4)}"
        """Names this process's access log."""
        self.next_scan = math.inf
        """When the next scan is due, `time.monotonic()` seconds."""
        self._failing = False  # the last scan failed (warned once per run of failures)

    def due(self) -> bool:
        """Return whether the next scan is due."""
        return time.monotonic() >= self.next_scan

    async def contains(
        self,
        namespace: str,
        keys: Sequence[bytes],
        catalog: Catalog,
        clock: Callable[[], float],
    ) -> list[bool]:
        """Answer a `contains` of `keys` from one listing of `namespace`, without the logs.

        `catalog` learns what the listing shows of the keys. A failed listing is counted
        and answers misses.
        """
        since = catalog.changes
        try:
            listing = await scan(self._store, namespace, logs=False)
        except StoreUnavailable as exc:
            self._counters.fail(timed_out=exc.timed_out)
            return [False] * len(keys)
        objs = [listing.objects.get(key) for key in keys]
        catalog.learn(keys, [o.size if o else None for o in objs], clock(), since)
        return [obj is not None for obj in objs]

    async def sweep(
        self, namespace: str, now: float, *, retries: int | None = None
    ) -> Sweep | None:
        """Scan `namespace` at `now` (Unix seconds); delete what is past its time.

        Also sets when the next scan is due, and writes this process's access log if it
        changed. A failed delete is counted and left for the next scan.

        Args:
            namespace: `<root>/<fingerprint hex>`.
            now: the tier's wall-clock time.
            retries: retries of the listing after a failure, instead of the configured number.

        Returns:
            What is left and what expired; `None` if the store failed or the breaker
            refused, which leaves things as they were (the catalog too: a listing that
            could not read part of the namespace fails whole, so it never shrinks it).

        Side effects:
            A failed scan counts one error (`TierCounters.fail`), and the first of a run
            of them logs a warning (later ones log at debug level until one succeeds); a
            refused one counts as `unavailable`.
        """
        interval = self._options.scan_interval * random.uniform(0.9, 1.1)  # nodes drift apart
        self.next_scan = time.monotonic() + interval if interval > 0 else math.inf
        if not self._store.available:  # the breaker refuses: it logged the outage
            self._counters.unavailable += 1
            return None
        try:
            if self._log.dirty:
                await self.write_log(namespace)
            listing = await scan(self._store, namespace, self._log, retries=retries)
        except StoreUnavailable as exc:
            self._failed(exc)
            return None
        if self._failing:
            self._failing = False
            logger.info("kvtiers: remote tier %r: scans succeed again", self._name)
        if self._options.ttl is not None:
            self._log.prune(now - self._options.ttl)
        doomed = self._doomed(namespace, listing, now)
        expired = [o.key for o in listing.objects.values() if o.path in doomed]
        if doomed:
            await gather_all(self._rm_quietly(path) for path in doomed)
            self._log.forget(expired)
        return Sweep([o for o in listing.objects.values() if o.path not in doomed], expired)

    async def write_log(self, namespace: str) -> None:
        """Write this process's access log into `namespace`; it is dirty again if that fails.

        Raises:
            StoreUnavailable: the store failed.
        """
        self._log.dirty = False
        try:
            await self._store.write(self._log_path(namespace), self._log.encode(), lambda: None)
        except BaseException:
            self._log.dirty = True
            raise

    async def remove_log(self, namespace: str) -> None:
        """Forget every access this process recorded and delete its log from `namespace`.

        Raises:
            StoreUnavailable: the store failed; the log object (if written) stays.
        """
        self._log.forget(list(self._log.times))
        self._log.dirty = False
        await self._store.rm(self._log_path(namespace))

    async def discard_log(self, namespace: str) -> bool:
        """Do `remove_log`; return `False` (counted) if the store failed."""
        try:
            await self.remove_log(namespace)
        except StoreUnavailable as exc:
            self._counters.fail(timed_out=exc.timed_out)
            return False
        return True

    def _failed(self, exc: StoreUnavailable) -> None:
        """Count a failed scan; warn only at the first of a run (scans repeat its cause)."""
        self._counters.fail(timed_out=exc.timed_out)
        if self._failing:
            logger.debug("kvtiers: remote tier %r: scan failed again: %s", self._name, exc)
            return
        self._failing = True
        logger.warning(
            "kvtiers: remote tier %r: scan failed, usage and expiry as of the last one: %s",
            self._name,
            exc,
        )

    def _doomed(self, namespace: str, listing: Listing, now: float) -> set[str]:
        """Return the paths a scan deletes: expired objects, stale temporaries and logs."""
        ttl = self._options.ttl
        doomed = {p for p, t in listing.temps.items() if t < now - _TEMP_AGE}
        own = self._log_path(namespace)
        horizon = max(ttl or 0.0, _LOG_AGE)
        doomed.update(p for p, t in listing.access_logs.items() if t < now - horizon and p != own)
        if ttl is not None:
            doomed.update(o.path for o in listing.objects.values() if o.last_access < now - ttl)
        return doomed

    async def _rm_quietly(self, path: str) -> None:
        try:
            await self._store.rm(path)
        except StoreUnavailable as exc:
            self._counters.fail(timed_out=exc.timed_out)

    def _log_path(self, namespace: str) -> str:
        return f"{namespace}/{ACCESS_DIR}/{self.writer_id}"
