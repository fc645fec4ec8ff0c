"""What the remote tier knows of its namespace: object names, recency, and scans.

A namespace is `<root>/<layout fingerprint hex>`. Below it:

- `<key[:2] hex>/<key hex>`: one object per chunk (16-byte key, so 4 and 32 hex digits);
- `<key[:2] hex>/.<key hex>.<random>.tmp` (and `._layout.<random>.tmp`): a write in
  progress on a filesystem that renames (local); a scan deletes those left behind by a
  crash after an hour;
- `_access/<writer id>`: one access log per process (see `AccessLog`);
- `_layout`: the layout's record, a label for `kvtiers inspect` (see `_layout_record`).

Recency (the "last access" LRU and the TTL act on) is shared through the access logs: each
process records the chunks it reads in memory and writes its own log object now and then
(on scans and on close). A log has one writer, so no two processes ever write one object,
and no read-modify-write race exists; a scan merges every log with the objects' own
modification times (their last write). Listing alone would only know writes, so a chunk
read all day on other nodes but written once would look old.

A log is trusted only so far: one over `MAX_LOG_BYTES` or not in the format is no log (its
records are ignored), and no access counts as later than `CLOCK_SLACK` after the log's own
modification time, so a node whose clock runs ahead (or a damaged log) cannot keep chunks
young forever.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import msgpack

from kvtiers.tiers import _layout_record as layout_record

if TYPE_CHECKING:
    from kvtiers.tiers._remote_io import ObjectStore

__all__ = [
    "ACCESS_DIR",
    "CLOCK_SLACK",
    "MAX_LOG_BYTES",
    "AccessLog",
    "Catalog",
    "Listing",
    "StoredObject",
    "classify",
    "modified_time",
    "object_path",
    "read_logs",
    "scan",
]

ACCESS_DIR = "_access"
_LOG_MAGIC = b"KVTA"
_LOG_VERSION = 1
_MAX_LOG_ENTRIES = 100_000  # the oldest go first; a log stays a few MiB at most
MAX_LOG_BYTES = 8 << 20
"""Bytes of the longest access log read (this process's own stay under 3 MiB)."""
CLOCK_SLACK = 300.0
"""Seconds an access in a log may postdate the log's modification time: nodes' clocks
differ a little from the store's, and S3 keeps whole seconds only."""
_TIE = 1e-6  # seconds between chunks of one batch, so a prefix is more recent than its suffix
_OBJECT = re.compile(r"([0-9a-f]{4})/([0-9a-f]{32})")
_TEMP = re.compile(
    rf"(?:[0-9a-f]{{4}}/\.[0-9a-f]{{32}}|\.{re.escape(layout_record.REMOTE_NAME)})\.[0-9a-f]+\.tmp"
)


def object_path(namespace: str, key: bytes) -> str:
    """Return the path of `key`'s object in `namespace`."""
    return f"{namespace}/{key[:2].hex()}/{key.hex()}"


def modified_time(info: Mapping[str, Any]) -> float:
    """Return an object's modification time in Unix seconds from fsspec details (0 if none)."""
    for name in ("LastModified", "mtime", "last_modified", "updated", "created", "mtime_ns"):
        value = info.get(name)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value / 1e9 if name == "mtime_ns" else float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One chunk object found by a scan."""

    key: bytes
    path: str
    size: int
    modified: float
    """Its last write, Unix seconds."""
    last_access: float
    """Its last read or write by any process whose access log was read, Unix seconds."""


@dataclass(slots=True)
class Listing:
    """A namespace as one scan saw it."""

    objects: dict[bytes, StoredObject] = field(default_factory=dict)
    access_logs: dict[str, float] = field(default_factory=dict)
    """Path -> modification time of each process's access log."""
    temps: dict[str, float] = field(default_factory=dict)
    """Path -> modification time of each write in progress (or left by a crash)."""
    layout_record: str | None = None
    """Path of the namespace's layout record (see `_layout_record`), if there is one."""
    others: list[str] = field(default_factory=list)
    """Paths that are none of the above (not ours; left alone)."""

    @property
    def used_bytes(self) -> int:
        """Return the bytes of all chunk objects."""
        return sum(obj.size for obj in self.objects.values())


def classify(namespace: str, found: Mapping[str, Mapping[str, Any]]) -> Listing:
    """Sort the output of `find(namespace, detail=True)` into a `Listing`.

    Last access is the modification time here; `AccessLog.merge` adds the logs.
    """
    listing = Listing()
    prefix = namespace.rstrip("/") + "/"
    for path, info in found.items():
        rel = path[len(prefix) :] if path.startswith(prefix) else path
        if info.get("type", "file") != "file":
            continue
        mtime = modified_time(info)
        if rel.startswith(ACCESS_DIR + "/"):
            listing.access_logs[path] = mtime
        elif (match := _OBJECT.fullmatch(rel)) and match.group(2).startswith(match.group(1)):
            key = bytes.fromhex(match.group(2))
            size = int(info.get("size") or 0)
            listing.objects[key] = StoredObject(key, path, size, mtime, mtime)
        elif _TEMP.fullmatch(rel):
            listing.temps[path] = mtime
        elif rel == layout_record.REMOTE_NAME:
            listing.layout_record = path
        else:
            listing.others.append(path)
    return listing


class AccessLog:
    """This process's record of the chunks it read, shared through one object per process.

    The object is msgpack `[b"KVTA", 1, {key: last access in Unix seconds}]`.
    """

    def __init__(self) -> None:
        self.times: dict[bytes, float] = {}
        self.dirty = False  # changed since it was last written

    def record(self, keys: Sequence[bytes], now: float) -> None:
        """Record reads of `keys` (prefix first) at `now`; the prefix counts as more recent."""
        n = len(keys)
        for i, key in enumerate(keys):
            self.times.pop(key, None)  # re-inserted last: the dict stays oldest-first
            self.times[key] = now + (n - 1 - i) * _TIE
        self.dirty = self.dirty or n > 0
        while len(self.times) > _MAX_LOG_ENTRIES:
            del self.times[next(iter(self.times))]

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drop the records of `keys` (deleted objects)."""
        for key in keys:
            self.times.pop(key, None)

    def prune(self, before: float) -> None:
        """Drop the records older than `before`."""
        for key in [k for k, t in self.times.items() if t < before]:
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
        return {
            k: min(float(t), written + CLOCK_SLACK)
            for k, t in times.items()
            if isinstance(k, bytes)
            and isinstance(t, int | float)
            and not isinstance(t, bool)
            and math.isfinite(t)
        }

    @staticmethod
    def merge(listing: Listing, logs: Iterable[Mapping[bytes, float]]) -> None:
        """Raise each object's last access in `listing` to the latest time in `logs`."""
        for times in logs:
            for key, when in times.items():
                obj = listing.objects.get(key)
                if obj is not None and when > obj.last_access:
                    listing.objects[key] = StoredObject(
                        obj.key, obj.path, obj.size, obj.modified, when
                    )


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


_CHANGES_KEPT = 65_536  # keys whose last change a check in flight compares against


@dataclass(slots=True)
class _Entry:
    size: int
    last_access: float


class Catalog:
    """The chunk objects this process knows of, least recently used first.

    Filled by scans and kept current by this process's own reads, writes and deletes;
    objects other processes write or delete are learnt at the next scan, or when a read
    or `contains` meets them.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.used_bytes = 0
        self.changes = 0
        """Objects added or removed so far: a check of the store notes it as it begins."""
        # NOTE: a dict as a bounded insertion-ordered map: the oldest change goes first.
        self._changed: dict[bytes, int] = {}
        """Per key changed lately, `changes` just after its last change."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def size_of(self, key: bytes) -> int | None:
        """Return the size of `key`'s object, `None` if unknown."""
        entry = self._entries.get(key)
        return None if entry is None else entry.size

    def add(self, key: bytes, size: int, now: float) -> None:
        """Record an object as present and most recently used."""
        self._pop(key)
        self._entries[key] = _Entry(size, now)
        self.used_bytes += size
        self._note_change(key)

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        """Make the known `keys` the most recently used, the last key the oldest of them."""
        n = len(keys)
        for i in range(n - 1, -1, -1):
            entry = self._entries.get(keys[i])
            if entry is not None:
                entry.last_access = now + (n - 1 - i) * _TIE
                self._entries.move_to_end(keys[i])

    def remove(self, key: bytes) -> bool:
        """Forget `key`'s object; return whether it was known."""
        self._note_change(key)
        return self._pop(key)

    def _pop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.size
        return entry is not None

    def _note_change(self, key: bytes) -> None:
        self.changes += 1
        changed = self._changed
        changed.pop(key, None)
        changed[key] = self.changes
        if len(changed) > _CHANGES_KEPT:
            del changed[next(iter(changed))]

    def learn(
        self, keys: Sequence[bytes], sizes: Sequence[int | None], now: float, since: int
    ) -> None:
        """Record what a check of the store found: per key, its object's size or `None`.

        An object found is known from now on (if it was not); one found absent is forgotten.
        `since` is `changes` when the check began: a key this process added or removed
        meanwhile is left as it is, since the check may have seen the store before that
        (a read that began before a delete would bring the deleted object back).
        """
        changed = self._changed
        for key, size in zip(keys, sizes, strict=True):
            if changed.get(key, 0) > since:
                continue
            if size is None:
                self.remove(key)
            elif key not in self._entries:
                self.add(key, size, now)

    def reset(self, objects: Iterable[StoredObject], since: int) -> None:
        """Replace the contents with a scan's `objects`, oldest access first.

        `since` is `changes` when the scan began: a key this process added or removed
        meanwhile stays as it is (the listing may predate the change), the most recent.
        """
        changed = self._changed
        recent = {k: e for k, e in self._entries.items() if changed.get(k, 0) > since}
        self._entries.clear()
        self.used_bytes = 0
        for obj in sorted(objects, key=lambda o: o.last_access):
            if changed.get(obj.key, 0) <= since:
                self._entries[obj.key] = _Entry(obj.size, obj.last_access)
                self.used_bytes += obj.size
        for key, entry in recent.items():
            self._entries[key] = entry
            self.used_bytes += entry.size

    def victims(self, need: int, capacity: int, keep: set[bytes]) -> list[bytes]:
        """Return the least recently used keys to delete so that `need` more bytes fit."""
        victims, freed = [], 0
        for key, entry in self._entries.items():
            if self.used_bytes - freed + need <= capacity:
                break
            if key not in keep:
                victims.append(key)
                freed += entry.size
        return victims
