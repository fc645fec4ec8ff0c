"""The remote tier's access logs: recency shared by every process, and scans that merge it.

Recency (the "last access" LRU and the TTL act on) is shared through the access logs: each
process records the chunks it reads in memory and writes its own log object,
`<namespace>/_access/<writer id>`, now and then (on scans and on close). A log also
records the chunks its process wrote cold (a reuse hint: none is expected,
`Tier.put_hinted`); such an object, until someone reads it, is first in line for eviction
in every process that scans, in the order of the writes. A log has one writer, so no two
processes ever write one object, and no read-modify-write race exists; a scan merges every
log with the objects' own modification times (their last write). Listing alone would only
know writes, so a chunk read all day on other nodes but written once would look old.

A log is trusted only so far: one over `MAX_LOG_BYTES` or not in the format is no log (its
records are ignored), and no access counts as later than `CLOCK_SLACK` after the log's own
modification time, so a node whose clock runs ahead (or a damaged log) cannot keep chunks
young forever.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import msgpack

from kvtiers.tiers._remote_catalog import TIE, Listing, StoredObject, classify

if TYPE_CHECKING:
    from kvtiers.tiers._remote_io import ObjectStore

__all__ = ["CLOCK_SLACK", "MAX_LOG_BYTES", "AccessLog", "read_logs", "scan"]

_LOG_MAGIC = b"KVTA"
_LOG_VERSION = 1
_MAX_LOG_ENTRIES = 100_000  # the oldest go first; a log stays a few MiB at most
MAX_LOG_BYTES = 8 << 20
"""Bytes of the longest access log read (this process's own stay under 3 MiB)."""
CLOCK_SLACK = 300.0
"""Seconds an access in a log may postdate the log's modification time: nodes' clocks
differ a little from the store's, and S3 keeps whole seconds only."""


class AccessLog:
    """This process's record of the chunks it read, shared through one object per process.

    The object is msgpack `[b"KVTA", 1, {key: last access in Unix seconds}]`. A negative
    time `-t` says the process wrote the key's object cold at `t` and has not read it
    since; a reader that predates cold writes takes it for an access older than any
    write, which changes nothing, so the format keeps its version.
    """

    def __init__(self) -> None:
        self.times: dict[bytes, float] = {}
        self.dirty = False  # changed since it was last written

    def record(self, keys: Sequence[bytes], now: float) -> None:
        """Record reads of `keys` (prefix first) at `now`; the prefix counts as more recent."""
        self._stamp(keys, now, 1.0)

    def park(self, keys: Sequence[bytes], now: float) -> None:
        """Record that `keys` (prefix first) were written cold at `now`, the last the oldest."""
        self._stamp(keys, now, -1.0)

    def _stamp(self, keys: Sequence[bytes], now: float, sign: float) -> None:
        n = len(keys)
        for i, key in enumerate(keys):
            self.times.pop(key, None)  # re-inserted last: the dict stays oldest-first
            self.times[key] = sign * (now + (n - 1 - i) * TIE)
        self.dirty = self.dirty or n > 0
        while len(self.times) > _MAX_LOG_ENTRIES:
            del self.times[next(iter(self.times))]

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drop the records of `keys` (deleted objects)."""
        for key in keys:
            self.times.pop(key, None)

    def prune(self, before: float) -> None:
        """Drop the records (reads and cold writes) older than `before`."""
        for key in [k for k, t in self.times.items() if abs(t) < before]:
            del self.times[key]

    def encode(self) -> bytes:
        """Return the log's object."""
        data: bytes = msgpack.packb([_LOG_MAGIC, _LOG_VERSION, self.times], use_bin_type=True)
        return data

    @staticmethod
    def decode(raw: bytes, written: float = math.inf) -> dict[bytes, float]:
        """Return the records of a log object; empty if it is not one.

        Args:
            raw: the object.
            written: its modification time; a record more than `CLOCK_SLACK` later
                counts as made `CLOCK_SLACK` after it.
        """
        if len(raw) > MAX_LOG_BYTES:
            return {}
        try:
            magic, version, times = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException):
            return {}
        if magic != _LOG_MAGIC or version != _LOG_VERSION or not isinstance(times, dict):
            return {}
        latest = written + CLOCK_SLACK
        return {
            k: math.copysign(min(abs(float(t)), latest), t)
            for k, t in times.items()
            if isinstance(k, bytes)
            and isinstance(t, int | float)
            and not isinstance(t, bool)
            and math.isfinite(t)
        }

    @staticmethod
    def merge(listing: Listing, logs: Iterable[Mapping[bytes, float]]) -> None:
        """Raise each object's last access in `listing` to the latest read in `logs`.

        An object is cold if a log records writing it cold since its last write (within
        `CLOCK_SLACK`: the store's clock is not the writer's) and none a later read; its
        last access is then that cold write's time.
        """
        objects = listing.objects
        reads: dict[bytes, float] = {}
        parks: dict[bytes, float] = {}
        for times in logs:
            for key, when in times.items():
                if key in objects:
                    seen = reads if when >= 0 else parks
                    seen[key] = max(seen.get(key, 0.0), abs(when))
        for key in reads.keys() | parks.keys():
            obj = objects[key]
            read, parked = reads.get(key, -math.inf), parks.get(key, -math.inf)
            cold = parked >= obj.modified - CLOCK_SLACK and read <= parked
            access = parked if cold else max(obj.last_access, read)
            if cold or access > obj.last_access:
                objects[key] = StoredObject(obj.key, obj.path, obj.size, obj.modified, access, cold)


async def scan(
    store: ObjectStore,
    namespace: str,
    own: AccessLog | None = None,
    *,
    retries: int | None = None,
    logs: bool = True,
) -> Listing:
    """List `namespace` and merge every access log into the objects' last access.

    Args:
        store: the store to list.
        namespace: `<root>/<fingerprint hex>`.
        own: this process's log, whose latest records may not be written yet.
        retries: retries of the listing after a failure, instead of the configured number.
        logs: read the access logs; without them last access is the last write.

    Raises:
        StoreUnavailable: the listing or a log could not be read; nothing is half-merged.
    """
    listing = classify(namespace, await store.find(namespace, retries=retries))
    if not logs:
        return listing
    records = await read_logs(store, listing)
    if own is not None:
        records.append(own.times)
    AccessLog.merge(listing, records)
    return listing


async def read_logs(store: ObjectStore, listing: Listing) -> list[dict[bytes, float]]:
    """Read and decode the access logs of `listing` (at most `MAX_LOG_BYTES` of each).

    Raises:
        StoreUnavailable: a log could not be read (once every read has ended).
    """
    paths = list(listing.access_logs)
    raws = await asyncio.gather(
        *(store.cat(path, MAX_LOG_BYTES + 1) for path in paths), return_exceptions=True
    )  # NOTE: every read ends before an error is raised
    for raw in raws:
        if isinstance(raw, BaseException):
            raise raw
    # NOTE: a store that gives no modification time (0) leaves the records as they are.
    return [
        AccessLog.decode(raw, listing.access_logs[path] or math.inf)
        for path, raw in zip(paths, raws, strict=True)
        if isinstance(raw, bytes)
    ]
