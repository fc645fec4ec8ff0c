"""What the remote tier knows of its namespace: object names, listings, its catalog.

A namespace is `<root>/<layout fingerprint hex>`. Below it:

- `<key[:2] hex>/<key hex>`: one object per chunk (16-byte key, so 4 and 32 hex digits);
- `<key[:2] hex>/.<key hex>.<random>.tmp` (and `._layout.<random>.tmp`): a write in
  progress on a filesystem that renames (local); a scan deletes those left behind by a
  crash after an hour;
- `_access/<writer id>`: one access log per process (see `_remote_access`);
- `_layout`: the layout's record, a label for `kvtiers inspect` (see `_layout_record`).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvtiers.tiers import _layout_record as layout_record

__all__ = [
    "ACCESS_DIR",
    "TIE",
    "Catalog",
    "Listing",
    "StoredObject",
    "classify",
    "modified_time",
    "object_path",
]

ACCESS_DIR = "_access"
TIE = 1e-6
"""Seconds between the chunks of one batch, so a prefix is more recent than its suffix."""
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
    cold: bool = False
    """It was written cold (no reuse expected) and no log records a read since."""


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


_CHANGES_KEPT = 65_536  # keys whose last change a check in flight compares against


@dataclass(slots=True)
class _Entry:
    size: int
    last_access: float


class Catalog:
    """The chunk objects this process knows of, least recently used first.

    Filled by scans and kept current by this process's own reads, writes and deletes;
    objects other processes write or delete are learnt at the next scan, or when a read
    or `contains` meets them. Cold objects (written with no reuse expected, not read
    since) come before all others, oldest write first.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._cold: OrderedDict[bytes, _Entry] = OrderedDict()
        self.used_bytes = 0
        self.changes = 0
        """Objects added or removed so far: a check of the store notes it as it begins."""
        # NOTE: a dict as a bounded insertion-ordered map: the oldest change goes first.
        self._changed: dict[bytes, int] = {}
        """Per key changed lately, `changes` just after its last change."""

    def __len__(self) -> int:
        return len(self._entries) + len(self._cold)

    def __contains__(self, key: object) -> bool:
        return key in self._entries or key in self._cold

    def size_of(self, key: bytes) -> int | None:
        """Return the size of `key`'s object, `None` if unknown."""
        entry = self._entries.get(key) or self._cold.get(key)
        return None if entry is None else entry.size

    def is_cold(self, key: bytes) -> bool:
        """Return whether `key`'s object is known and cold."""
        return key in self._cold

    def add(self, key: bytes, size: int, now: float) -> None:
        """Record an object as present and most recently used."""
        self._pop(key)
        self._entries[key] = _Entry(size, now)
        self.used_bytes += size
        self._note_change(key)

    def park(self, keys: Sequence[bytes], now: float) -> None:
        """Make the known `keys` (prefix first) the newest cold objects, the last one first.

        Cold objects are evicted before all others, oldest first, until a touch.
        """
        self._stamp(keys, now, self._cold)

    def touch(self, keys: Sequence[bytes], now: float) -> int:
        """Make the known `keys` the most recently used, the last key the oldest of them.

        A cold key touched is cold no more.

        Returns:
            How many of `keys` were cold until now.
        """
        return self._stamp(keys, now, self._entries)

    def _stamp(self, keys: Sequence[bytes], now: float, into: OrderedDict[bytes, _Entry]) -> int:
        """Move the known `keys` to the end of `into`, the last key first, used at `now`.

        Returns:
            How many of `keys` were cold before.
        """
        n, were_cold = len(keys), 0
        for i in range(n - 1, -1, -1):
            entry = self._entries.pop(keys[i], None)
            if entry is None and (entry := self._cold.pop(keys[i], None)) is not None:
                were_cold += 1
            if entry is not None:
                entry.last_access = now + (n - 1 - i) * TIE
                into[keys[i]] = entry
        return were_cold

    def remove(self, key: bytes) -> bool:
        """Forget `key`'s object; return whether it was known."""
        self._note_change(key)
        return self._pop(key)

    def _pop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None) or self._cold.pop(key, None)
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
            elif key not in self:  # a cold one stays cold: the read's touch warms it
                self.add(key, size, now)

    def reset(self, objects: Iterable[StoredObject], since: int) -> None:
        """Replace the contents with a scan's `objects`, oldest access first.

        `since` is `changes` when the scan began: a key this process added or removed
        meanwhile stays as it is (the listing may predate the change), the most recent.
        """
        changed = self._changed
        recent = [
            (k, e, table is self._cold)
            for table in (self._cold, self._entries)
            for k, e in table.items()
            if changed.get(k, 0) > since
        ]
        self._entries.clear()
        self._cold.clear()
        self.used_bytes = 0
        for obj in sorted(objects, key=lambda o: o.last_access):
            if changed.get(obj.key, 0) <= since:
                table = self._cold if obj.cold else self._entries
                table[obj.key] = _Entry(obj.size, obj.last_access)
                self.used_bytes += obj.size
        for key, entry, cold in recent:
            (self._cold if cold else self._entries)[key] = entry
            self.used_bytes += entry.size

    def victims(
        self, need: int, capacity: int, keep: set[bytes], cold_need: int = 0
    ) -> list[bytes]:
        """Return the keys to delete, cold then least recently used, so `need` more fit.

        `cold_need` more bytes, of cold objects, are made room for from cold ones only.
        """
        victims, freed = [], 0
        for table, more in ((self._cold, need + cold_need), (self._entries, need)):
            for key, entry in table.items():
                if self.used_bytes - freed + more <= capacity:
                    break
                if key not in keep:
                    victims.append(key)
                    freed += entry.size
        return victims
