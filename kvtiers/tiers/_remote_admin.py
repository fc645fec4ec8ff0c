"""Listing and purging a remote tier's pool, for `kvtiers remote ls` and `purge`.

Neither opens the tier itself: opening runs a scan that evicts and expires, and `ls` must
change nothing. Both read the same layout as the tier (see `_remote_catalog` and `_remote_access`).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.core.layout import KVLayout
from kvtiers.tiers import _layout_record as layout_record
from kvtiers.tiers._remote_access import AccessLog, read_logs, scan
from kvtiers.tiers._remote_breaker import StoreUnavailable, gather_all
from kvtiers.tiers._remote_catalog import Listing, StoredObject, classify
from kvtiers.tiers._remote_io import ObjectStore
from kvtiers.tiers._remote_options import RemoteOptions

__all__ = [
    "Namespace",
    "PurgeResult",
    "is_fingerprint",
    "list_pool",
    "open_store",
    "purge_namespace",
]

_FINGERPRINT = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class Namespace:
    """The objects of one layout fingerprint under a remote tier's URL."""

    fingerprint: str
    """The directory name: a layout fingerprint in hex (anything else is listed as such)."""
    listing: Listing
    current: bool
    """Whether it belongs to the config's layout."""
    layout: dict[str, Any] | None = None
    """The fields of its layout record (`KVLayout.to_dict`); `None` without one."""

    @property
    def objects(self) -> list[StoredObject]:
        """Return the chunk objects in eviction order: cold, then least recently accessed."""
        return sorted(self.listing.objects.values(), key=lambda o: (not o.cold, o.last_access))


@dataclass(frozen=True, slots=True)
class PurgeResult:
    """What `purge_namespace` deleted (or, with `dry_run`, would delete)."""

    num_objects: int
    num_bytes: int
    num_other_files: int
    """Access logs, temporaries and the layout record (purging everything); files that are
    not the tier's (`Listing.others`) are never deleted."""
    num_kept: int


@asynccontextmanager
async def open_store(config: TierConfig) -> AsyncIterator[ObjectStore]:
    """Open the tier's object store without opening the tier (no scan, no eviction)."""
    options = RemoteOptions.from_config(config)
    ObjectStore.check_protocol(options.url, config.where)
    store = ObjectStore(options, config.name)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def list_pool(config: TierConfig, layout: KVLayout | None) -> list[Namespace]:
    """Return every namespace below the tier's URL, the config layout's first.

    Raises:
        ConfigError: the tier's options are invalid.
        TierIOError: the store cannot be listed.
    """
    current = None if layout is None else layout.fingerprint.hex()
    async with open_store(config) as store:
        try:
            found = await store.find(store.root)
            groups: dict[str, dict[str, Any]] = {}
            for path, info in found.items():
                rel = path[len(store.root) + 1 :] if path.startswith(store.root + "/") else path
                groups.setdefault(rel.partition("/")[0], {})[path] = info
            namespaces = []
            for name, files in sorted(groups.items(), key=lambda item: item[0] != current):
                listing = classify(f"{store.root}/{name}", files)
                await _merge_logs(store, listing)
                record = listing.layout_record
                fields = None if record is None else layout_record.decode(await store.cat(record))
                namespaces.append(Namespace(name, listing, name == current, fields))
        except StoreUnavailable as exc:
            raise TierIOError(f"{config.name}: cannot list the pool: {exc}") from None
    return namespaces


async def _merge_logs(store: ObjectStore, listing: Listing) -> None:
    AccessLog.merge(listing, await read_logs(store, listing))


async def purge_namespace(
    config: TierConfig,
    fingerprint: str,
    *,
    older_than: float | None,
    dry_run: bool = False,
    now: float | None = None,
) -> PurgeResult:
    """Delete a layout's objects, all of them or those idle for `older_than` seconds.

    Args:
        config: the remote tier's config.
        fingerprint: the layout fingerprint (hex) whose namespace is purged.
        older_than: seconds since last access (reads recorded in access logs, or the last
            write); `None` deletes everything in the namespace, access logs included.
        dry_run: count only; delete nothing.
        now: the current time in Unix seconds (for tests).

    Raises:
        ConfigError: the tier's options are invalid.
        TierIOError: the store cannot be listed or an object cannot be deleted.
    """
    if older_than is not None and older_than < 0:
        raise ConfigError(f"--older-than: expected a non-negative age, got {older_than}")
    now = time.time() if now is None else now
    async with open_store(config) as store:
        namespace = f"{store.root}/{fingerprint}"
        try:
            listing = await scan(store, namespace)
            if older_than is None:
                doomed = list(listing.objects.values())
                # NOTE: `listing.others` are not ours: they stay, even in our namespace.
                others = [*listing.access_logs, *listing.temps]
                others += [listing.layout_record] if listing.layout_record else []
            else:
                doomed = [o for o in listing.objects.values() if o.last_access < now - older_than]
                others = [p for p, t in listing.temps.items() if t < now - older_than]
            if not dry_run:
                await gather_all(store.rm(path) for path in [*(o.path for o in doomed), *others])
        except StoreUnavailable as exc:
            raise TierIOError(f"{config.name}: purge of {namespace} failed: {exc}") from None
    return PurgeResult(
        num_objects=len(doomed),
        num_bytes=sum(o.size for o in doomed),
        num_other_files=len(others),
        num_kept=len(listing.objects) - len(doomed),
    )


def is_fingerprint(name: str) -> bool:
    """Return whether a directory name looks like a layout fingerprint."""
    return _FINGERPRINT.fullmatch(name) is not None
