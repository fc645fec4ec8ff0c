"""Open an LMDB path beside the caches using it, and say why it cannot be read.

`kvtiers inspect` and `kvtiers purge` read (purge also writes) a path that running caches
may hold open. What can go wrong falls into the command line's two kinds of failure:

- a path that is no kvtiers store (no `data.mdb`, or no `chunks` database in it) is a bad
  argument: `ConfigError`, exit status 2;
- a store that cannot be read or changed is a store failure: `TierIOError`, exit status 1.
  That is any other LMDB error (a full reader table, a map another process grew meanwhile,
  a damaged or truncated `data.mdb`, a `lock.mdb` it may not open) and any `OSError` on
  the path (a folder it may not enter).

Each message is one line that names the path and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Any

from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.tiers._files import FILE_MODE

__all__ = ["check_store_path", "lmdb_failure", "open_chunks", "open_lmdb"]

# NOTE: a name no file can have; anything else the OS refuses is the store's failure.
_NO_SUCH_PATH = {errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG}


def check_store_path(path: Path) -> None:
    """Refuse a path without a `data.mdb` file; report one that cannot be looked at.

    Raises:
        ConfigError: `path` holds no `data.mdb` file (a bad argument).
        TierIOError: the OS refused to look (e.g. a folder this user may not enter).
    """
    try:
        found = stat.S_ISREG((path / "data.mdb").stat().st_mode)
    except ValueError:  # a NUL byte in the path
        found = False
    except OSError as exc:
        if exc.errno not in _NO_SUCH_PATH:
            reason = exc.strerror or str(exc)
            raise TierIOError(f"{path}: cannot read the LMDB environment: {reason}") from exc
        found = False
    if not found:
        raise ConfigError(f"{path}: not an LMDB environment (no data.mdb); give a path or a URL")


def open_lmdb(path: Path, *, readonly: bool) -> Any:
    """Open the LMDB environment at `path` beside the caches that may be using it.

    Raises:
        TierIOError: it cannot be opened (e.g. its data.mdb is no LMDB file or is cut
            short, its lock.mdb cannot be opened, its reader table is full).
    """
    import lmdb

    from kvtiers.tiers._lmdb_options import check_length

    # NOTE: lock=True enters each read transaction in lock.mdb's reader table, so caches
    # writing the path keep the pages of its snapshot; unlocked, they reused them mid-read
    # and inspect counted and verified garbage (every entry "corrupt"). A folder without a
    # lock.mdb is open in no process (each one creates it): read it without, creating none.
    lock = not readonly or (path / "lock.mdb").exists()
    env = _open_env(path, readonly=readonly, lock=lock)
    try:
        # NOTE: a data.mdb cut short (a partial copy, a full disk) is a SIGBUS, which
        # kills the process, when a read touches a page past its end.
        check_length(env, str(path / "data.mdb"))
    except lmdb.CorruptedError as exc:  # its text says how short
        env.close()
        raise TierIOError(f"{path}: cannot open the LMDB environment: {exc}") from exc
    except (OSError, lmdb.Error) as exc:
        env.close()
        raise lmdb_failure(path, exc, "open") from exc
    if lock:
        # NOTE: a reader killed mid-read (an inspect, a cache) keeps its slot, and its
        # snapshot's pages stay pinned: the caches' writes then only grow the file.
        with contextlib.suppress(lmdb.Error):
            env.reader_check()
    return env


def _open_env(path: Path, *, readonly: bool, lock: bool) -> Any:
    """Return the LMDB environment at `path`, opened as the caches sized it."""
    import lmdb

    try:
        # NOTE: map_size=0 maps the size the caches recorded. py-lmdb's default (10 MiB,
        # raised only to the pages in use) left no room to copy pages on write, so a purge
        # of a larger store failed with MDB_MAP_FULL.
        return lmdb.open(
            str(path),
            max_dbs=4,
            subdir=True,
            readonly=readonly,
            lock=lock,
            create=False,
            map_size=0,
            mode=FILE_MODE,
        )
    except lmdb.Error as exc:  # e.g. MDB_INVALID: data.mdb is no LMDB file
        raise lmdb_failure(path, exc, "open", lock=lock, readonly=readonly) from exc


def open_chunks(env: Any, path: Path) -> Any:
    """Return the handle of the environment's `chunks` database.

    Raises:
        ConfigError: the environment has none: it is no kvtiers store (a bad argument).
        lmdb.Error: LMDB failed otherwise (for `lmdb_failure`).
    """
    import lmdb

    try:
        return env.open_db(b"chunks", create=False)
    except (lmdb.NotFoundError, lmdb.IncompatibleError):
        raise ConfigError(
            f"{path}: an LMDB environment without kvtiers' databases (no 'chunks'); "
            "give the path of an lmdb tier"
        ) from None


def lmdb_failure(
    path: Path, exc: Exception, action: str, *, lock: bool = False, readonly: bool = True
) -> TierIOError:
    """Return the error that reports `exc`, raised by LMDB at `path`, in one line.

    Args:
        path: the environment's folder.
        exc: an `lmdb.Error`, or an `OSError` on one of its files.
        action: what failed: "open", "read" or "purge".
        lock: whether the open used lock.mdb (to name the file LMDB could not open).
        readonly: whether the open was read-only.
    """
    return TierIOError(
        f"{path}: cannot {action} the LMDB environment: {_cause(path, exc, lock, readonly)}"
    )


def _cause(path: Path, exc: Exception, lock: bool, readonly: bool) -> str:
    import lmdb

    # py-lmdb says "mdb_txn_begin: MDB_READERS_FULL: ...": the C call is noise here.
    text = str(exc).split(": ", 1)[1] if str(exc).startswith("mdb_") else str(exc)
    if isinstance(exc, lmdb.ReadersFullError):
        return (
            "its reader table is full (MDB_READERS_FULL): live readers hold every slot; "
            "retry when some end, or raise the lmdb tier's max_readers (it applies once "
            "every process has closed the path)"
        )
    if isinstance(exc, lmdb.MapResizedError):
        return "another process grew its map meanwhile (MDB_MAP_RESIZED); run the command again"
    if isinstance(exc, lmdb.BadRslotError):
        return "LMDB refused its reader slot (MDB_BAD_RSLOT); run the command again"
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError)):
        return f"data.mdb is damaged ({text})"
    if isinstance(exc, OSError):
        return exc.strerror or text
    return _unopenable(path, lock, readonly) or text


def _unopenable(path: Path, lock: bool, readonly: bool) -> str | None:
    """Name the file LMDB could not open, and why; `None` if both open now."""
    files = [("lock.mdb", os.O_RDWR)] if lock else []  # LMDB writes it even to read
    files.append(("data.mdb", os.O_RDONLY if readonly else os.O_RDWR))
    for name, flags in files:
        try:
            os.close(os.open(path / name, flags | os.O_NONBLOCK))
        except FileNotFoundError:  # a lock.mdb LMDB would have created
            continue
        except OSError as exc:
            return f"{name}: {exc.strerror or exc}"
    return None
