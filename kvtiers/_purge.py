"""`kvtiers purge PATH|URL`: delete one layout's chunks, or the bad ones, from a store.

Takes what `kvtiers inspect` shows: the entries of one layout fingerprint (`--fingerprint`,
a hex prefix of it is enough when it names one layout), or with `--bad` every entry that
fails its checks (`inspect --verify`). Works on an LMDB path (in one write transaction
that keeps the tier's sizes and recency consistent, so running caches may stay up) and on
a remote URL (the layout's objects, one by one). Everything else is left as it was.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtiers._inspect import inspect
from kvtiers._lmdb_admin import lmdb_failure, open_lmdb
from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.tiers import _chunk_format as fmt

__all__ = ["PurgeReport", "purge", "to_json"]


@dataclass(slots=True)
class PurgeReport:
    """What a purge removed (or, with `dry_run`, would remove)."""

    target: str
    fingerprint: str | None
    removed: int = 0
    removed_bytes: int = 0
    kept: int = 0
    dry_run: bool = False


def purge(
    target: str,
    *,
    fingerprint: str | None = None,
    bad: bool = False,
    older_than: float | None = None,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> PurgeReport:
    """Remove one layout's entries (`fingerprint`) or the bad ones (`bad`) from a store.

    Args:
        older_than: with `fingerprint` on a URL, only the layout's objects not read or
            written for this many seconds (the remote tier's last-access records).

    Raises:
        ConfigError: neither or both selections, an empty, unknown or ambiguous
            fingerprint, a target that is no store, or `older_than` without a fingerprint
            or on a path.
        TierIOError: the store cannot be read or changed.
    """
    _check_selection(target, fingerprint, bad, older_than)
    found = inspect(target, verify=bad, storage_options=storage_options)
    full = None
    if fingerprint is not None:
        full = _resolve(fingerprint.strip().lower(), [ns.fingerprint for ns in found.namespaces])
    report = PurgeReport(target, full, dry_run=dry_run)
    if "://" in target and full is not None:
        _purge_namespace(target, full, older_than, report, storage_options or {})
        report.kept += sum(ns.entries for ns in found.namespaces if ns.fingerprint != full)
    elif "://" in target:
        _purge_bad(target, found, report, storage_options or {})
    else:
        _purge_lmdb(Path(target), full, report)
    return report


def _check_selection(
    target: str, fingerprint: str | None, bad: bool, older_than: float | None
) -> None:
    """Refuse a purge that selects neither or both, an empty prefix, or an age it lacks."""
    if (fingerprint is None) == (not bad):
        raise ConfigError("purge: give --fingerprint F or --bad (one of them)")
    if fingerprint is not None and not fingerprint.strip():
        # NOTE: an empty prefix would match every layout, and a lone layout would go.
        raise ConfigError("--fingerprint: empty; give a layout fingerprint (or a prefix of it)")
    if older_than is not None and (fingerprint is None or "://" not in target):
        raise ConfigError(
            "--older-than: only with --fingerprint on a URL (an LMDB path records recency "
            "order, not times)"
        )


def _resolve(prefix: str, names: list[str]) -> str:
    matches = [name for name in names if name.startswith(prefix)]
    if len(matches) != 1:
        known = ", ".join(names) or "none"
        what = "no layout" if not matches else "several layouts"
        raise ConfigError(f"--fingerprint {prefix!r}: {what} match; the store holds {known}")
    return matches[0]


def _purge_lmdb(path: Path, fingerprint: str | None, report: PurgeReport) -> None:
    import lmdb

    from kvtiers.tiers import _lmdb_format as lfmt

    env = open_lmdb(path, readonly=False)
    try:
        dbs = lfmt.open_databases(env)
        with env.begin(write=not report.dry_run, buffers=True) as txn:
            doomed: list[tuple[bytes, int]] = []
            for raw_key, raw in txn.cursor(db=dbs.chunks):
                key = bytes(raw_key)
                if _selected(raw, key, fingerprint):
                    doomed.append((key, len(raw)))
                else:
                    report.kept += 1
            if not report.dry_run:
                writer = lfmt.Writer(txn, dbs, 0)
                for key, _ in doomed:
                    writer.remove(key)
                writer.save()
        report.removed = len(doomed)
        report.removed_bytes = sum(size for _, size in doomed)
    except lmdb.Error as exc:
        raise lmdb_failure(path, exc, "purge") from exc
    finally:
        env.close()


def _selected(raw: Any, key: bytes, fingerprint: str | None) -> bool:
    peeked = fmt.peek_header(raw)
    if fingerprint is not None:
        return peeked is not None and peeked[0].hex() == fingerprint
    if peeked is None:
        return True
    verdict, _ = fmt.check_value(raw, fingerprint=peeked[0], key=key, payload_len=peeked[1])
    return verdict is not fmt.Verdict.OK


def _purge_bad(url: str, found: Any, report: PurgeReport, storage_options: dict[str, Any]) -> None:
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url, **storage_options)
    # NOTE: object paths come from the listing `inspect` made through the same filesystem.
    paths = [bad.path for bad in found.bad]
    report.removed, report.removed_bytes = len(paths), sum(b.num_bytes for b in found.bad)
    report.kept = found.checked - len(paths)
    if report.dry_run or not paths:
        return
    try:
        for path in paths:
            # NOTE: a cache that read the object meanwhile found it bad and deleted it.
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path)
    except (OSError, ValueError) as exc:
        raise TierIOError(f"{url}: purge failed: {exc}") from exc


def _purge_namespace(
    url: str,
    fingerprint: str,
    older_than: float | None,
    report: PurgeReport,
    storage_options: dict[str, Any],
) -> None:
    """Delete the layout's objects (those idle for `older_than` seconds, if given).

    One object at a time, as `kvtiers remote purge` does: a recursive delete of the
    layout's folder failed (ENOTEMPTY on file://) whenever a cache wrote into it meanwhile.
    """
    import asyncio

    from kvtiers.core.config import TierConfig
    from kvtiers.tiers._remote_admin import purge_namespace

    config = TierConfig(
        "remote", 1, name="purge", options={"url": url, "storage_options": storage_options}
    )
    result = asyncio.run(
        purge_namespace(config, fingerprint, older_than=older_than, dry_run=report.dry_run)
    )
    report.removed, report.removed_bytes = result.num_objects, result.num_bytes
    report.kept = result.num_kept


def to_json(report: PurgeReport) -> str:
    """Return a report as JSON text."""
    return json.dumps(asdict(report), indent=2, sort_keys=True)
