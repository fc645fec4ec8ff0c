"""`kvtiers inspect`: what an LMDB environment or a remote pool holds, and whether it is intact.

Nothing here opens a tier: opening runs scans that evict and expire, and inspecting must
change nothing. Values are grouped by the layout fingerprint their header names, so a store
shared by several models (or left by an old one) is read without any config; each group is
named by the layout record its writers left (see `tiers/_layout_record`), where there is one.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from kvtiers._lmdb_admin import check_store_path, lmdb_failure, open_chunks, open_lmdb
from kvtiers.core.config import TierConfig, format_size
from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers import _layout_record as layout_record

if TYPE_CHECKING:
    from kvtiers.tiers._remote_admin import Namespace as PoolNamespace
    from kvtiers.tiers._remote_io import ObjectStore

__all__ = [
    "BadEntry",
    "Inspection",
    "Namespace",
    "format_text",
    "inspect",
    "open_lmdb",
    "to_json",
]

_UNREADABLE = "?"  # the namespace of values whose header cannot be parsed


@dataclass(slots=True)
class Namespace:
    """The entries of one layout fingerprint."""

    fingerprint: str
    """The layout fingerprint in hex, or "?" for values whose header is unreadable."""
    entries: int = 0
    bytes: int = 0
    """Bytes of stored values, headers included."""
    layout: dict[str, Any] | None = None
    """The layout's fields (`KVLayout.to_dict`), from its record; `None` without one."""


@dataclass(frozen=True, slots=True)
class BadEntry:
    """A value that failed verification."""

    key: str
    """The key (hex) it is stored under."""
    fingerprint: str
    problem: str
    """"corrupt" (header, length or checksum) or "foreign" (its header names another key)."""
    path: str = ""
    """Where the object is, for a remote store ("" for an LMDB entry)."""
    num_bytes: int = 0
    """Bytes the value or object takes."""


@dataclass(slots=True)
class Inspection:
    """What `inspect` found."""

    kind: str
    """"lmdb" or "remote"."""
    location: str
    namespaces: list[Namespace] = field(default_factory=list)
    verified: bool = False
    """Whether every value was read and its checksum verified."""
    checked: int = 0
    """Values verified."""
    bad: list[BadEntry] = field(default_factory=list)


def inspect(
    target: str, *, verify: bool = False, storage_options: dict[str, Any] | None = None
) -> Inspection:
    """Inspect an LMDB environment (a directory) or a remote pool (an fsspec URL).

    Raises:
        ConfigError: `target` is neither an LMDB environment of kvtiers nor a supported
            URL (a bad argument).
        TierIOError: the store cannot be read: the LMDB environment cannot be opened or
            read (e.g. its data.mdb is no LMDB file, is cut short or damaged, its reader
            table is full), or the remote store cannot be listed or read.
    """
    if "://" in target:
        return asyncio.run(_inspect_remote(target, verify, storage_options or {}))
    if storage_options:
        raise ConfigError("--storage-options: only for a remote URL")
    return _inspect_lmdb(Path(target), verify)


def _verdict(raw: fmt.Bytes, key: bytes) -> tuple[str, str | None]:
    """Return the value's fingerprint (hex) and its problem (`None` when intact)."""
    peeked = fmt.peek_header(raw)
    if peeked is None:
        return _UNREADABLE, "corrupt"
    fingerprint, payload_len = peeked
    verdict, _ = fmt.check_value(raw, fingerprint=fingerprint, key=key, payload_len=payload_len)
    problem = None if verdict is fmt.Verdict.OK else verdict.name.lower()
    return fingerprint.hex(), problem


@contextmanager
def _progress(total: int, verify: bool, what: str) -> Iterator[tqdm[Any]]:
    bar = tqdm(total=total, unit="chunk", desc=what, disable=not verify or not sys.stderr.isatty())
    try:
        yield bar
    finally:
        bar.close()


def _inspect_lmdb(path: Path, verify: bool) -> Inspection:
    import lmdb

    check_store_path(path)
    result = Inspection("lmdb", str(path), verified=verify)
    groups: dict[str, Namespace] = {}
    env = open_lmdb(path, readonly=True)
    try:
        chunks = open_chunks(env, path)
        with env.begin(db=chunks, buffers=True) as txn:
            total = txn.stat(chunks)["entries"]
            with _progress(total, verify, "verify") as bar, txn.cursor() as cursor:
                for raw_key, raw in cursor:
                    key = bytes(raw_key)
                    if verify:
                        fingerprint, problem = _verdict(raw, key)
                        result.checked += 1
                        bar.update()
                        if problem is not None:
                            bad = BadEntry(key.hex(), fingerprint, problem, "", len(raw))
                            result.bad.append(bad)
                    else:
                        peeked = fmt.peek_header(raw)
                        fingerprint = _UNREADABLE if peeked is None else peeked[0].hex()
                    group = groups.setdefault(fingerprint, Namespace(fingerprint))
                    group.entries += 1
                    group.bytes += len(raw)
            for fingerprint, fields in _lmdb_layouts(env, txn).items():
                if fingerprint in groups:
                    groups[fingerprint].layout = fields
    except lmdb.Error as exc:  # a store failure; a store that is none raised ConfigError
        raise lmdb_failure(path, exc, "read") from exc
    finally:
        env.close()
    result.namespaces = sorted(groups.values(), key=lambda g: -g.bytes)
    return result


def _lmdb_layouts(env: Any, txn: Any) -> dict[str, dict[str, Any]]:
    """Return the layout records of an environment by fingerprint (hex), as of `txn`."""
    import lmdb

    try:
        meta = env.open_db(b"meta", txn=txn, create=False)
    except lmdb.NotFoundError:  # an environment no kvtiers tier opened
        return {}
    found: dict[str, dict[str, Any]] = {}
    prefix = layout_record.LMDB_PREFIX
    with txn.cursor(db=meta) as cursor:
        if cursor.set_range(prefix):
            for raw_key, raw in cursor:
                key = bytes(raw_key)  # `txn` returns buffers
                if not key.startswith(prefix):
                    break
                fields = layout_record.decode(raw)
                if fields is not None:
                    found[key[len(prefix) :].hex()] = fields
    return found


async def _inspect_remote(url: str, verify: bool, storage_options: dict[str, Any]) -> Inspection:
    from kvtiers.tiers._remote_admin import is_fingerprint, list_pool, open_store
    from kvtiers.tiers._remote_breaker import StoreUnavailable
    from kvtiers.tiers._remote_options import display_url

    config = TierConfig(
        "remote", 1, name="inspect", options={"url": url, "storage_options": storage_options}
    )
    result = Inspection("remote", display_url(url), verified=verify)
    pool = [ns for ns in await list_pool(config, None) if ns.listing.objects]
    result.namespaces = [
        Namespace(
            ns.fingerprint if is_fingerprint(ns.fingerprint) else _UNREADABLE,
            len(ns.listing.objects),
            ns.listing.used_bytes,
            ns.layout,
        )
        for ns in pool
    ]
    if verify:
        async with open_store(config) as store:
            try:
                await _verify_remote(store, pool, result)
            except StoreUnavailable as exc:  # its text names the URL and the object
                raise TierIOError(f"cannot read the pool: {exc}") from None
    return result


async def _verify_remote(store: ObjectStore, pool: list[PoolNamespace], result: Inspection) -> None:
    """Read and verify every object of `pool`, noting the bad ones in `result`."""
    objects = [obj for ns in pool for obj in ns.listing.objects.values()]
    with _progress(len(objects), True, "verify") as bar:
        for obj in objects:
            raw = await store.cat(obj.path)
            result.checked += 1
            bar.update()
            if raw is None:  # deleted since the listing (evicted by a cache)
                continue
            fingerprint, problem = _verdict(raw, obj.key)
            if problem is not None:
                result.bad.append(BadEntry(obj.key.hex(), fingerprint, problem, obj.path, len(raw)))


def to_json(result: Inspection) -> str:
    """Return the inspection as a JSON document."""
    doc = {
        "kind": result.kind,
        "location": result.location,
        "namespaces": [
            {
                "fingerprint": g.fingerprint,
                "entries": g.entries,
                "bytes": g.bytes,
                "layout": g.layout,
            }
            for g in result.namespaces
        ],
        "verified": result.verified,
        "checked": result.checked,
        "bad": [
            {
                "key": b.key,
                "fingerprint": b.fingerprint,
                "problem": b.problem,
                "path": b.path,
                "num_bytes": b.num_bytes,
            }
            for b in result.bad
        ],
    }
    return json.dumps(doc, indent=2)


def format_text(result: Inspection) -> list[str]:
    """Return the inspection as lines for a terminal."""
    lines = [f"{result.kind} at {result.location}"]
    if not result.namespaces:
        lines.append("  empty")
    for g in result.namespaces:
        line = f"  {g.fingerprint}  {g.entries:,} entries, {format_size(g.bytes)}"
        lines.append(line if g.layout is None else f"{line}  {layout_record.describe(g.layout)}")
    if result.verified:
        lines.append(f"verified {result.checked:,} entries: {len(result.bad):,} bad")
        lines += [
            f"  {b.problem:8} {b.key}  (layout {b.fingerprint}, {format_size(b.num_bytes)})"
            for b in result.bad
        ]
    return lines
