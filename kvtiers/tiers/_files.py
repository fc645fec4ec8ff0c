"""Local files and paths the tiers create: private to the user, never outside their root.

Chunks are a tenant's prompts in another form (KV can be inverted to tokens), so what a
tier writes on a local disk is readable by its owner only: folders 0700, files 0600,
whatever the umask. Paths from a config are checked before anything is created: no NUL
byte, and no `..` segment that could climb out of the folder a relative path names.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
from typing import Any

from kvtiers.core.errors import ConfigError

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "allocate_whole",
    "check_path",
    "make_private_dirs",
    "write_renamed",
]

DIR_MODE = 0o700
"""Mode of every folder a tier creates."""
FILE_MODE = 0o600
"""Mode of every file a tier creates."""


def check_path(path: str, where: str) -> str:
    """Return `path` if it is a safe location for a tier's files.

    Args:
        path: a local path or the path part of a URL, as configured.
        where: the config field, for the message.

    Raises:
        ConfigError: `path` holds a NUL byte or a `..` segment.
    """
    if "\0" in path:
        raise ConfigError(f"{where}: holds a NUL byte")
    segments = path.replace("\\", "/").split("/")
    if ".." in segments:
        raise ConfigError(
            f"{where}: must not contain '..' segments (it would escape the folder it names); "
            f"got {path!r:.200}"
        )
    return path


def allocate_whole(path: str, size: int) -> None:
    """Give the file at `path` its first `size` bytes of disk now (a sparse file's holes).

    A write into a memory-mapped hole that the disk cannot back is a SIGBUS, not an error;
    once allocated, such a write needs no new blocks. Nothing happens where the platform or
    filesystem cannot allocate ahead.

    Raises:
        OSError: the disk has no room for it (ENOSPC), or another failure.
    """
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is None:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        allocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    finally:
        os.close(fd)


def make_private_dirs(path: str) -> None:
    """Create the folder `path` and any missing parents, each with mode 0700.

    Folders that exist already are left as they are.
    """
    missing: list[str] = []
    head = os.path.abspath(path)
    while head and not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(folder, DIR_MODE)
            os.chmod(folder, DIR_MODE)  # the umask may have narrowed it, never widened


def write_renamed(fs: Any, path: str, data: bytes) -> None:
    """Write `data` under a temporary name beside `path`, then rename it (one atomic step).

    On a local filesystem the file is created 0600 and missing folders 0700; on others
    (sftp, hdfs...) the filesystem's own defaults apply.
    """
    parent, _, base = path.rpartition("/")
    tmp = f"{parent}/.{base}.{random.getrandbits(64):016x}.tmp"
    if _is_local(fs):
        _write_local(parent, tmp, path, data)
        return
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.rm_file(tmp)
        raise


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _write_local(parent: str, tmp: str, path: str, data: bytes) -> None:
    make_private_dirs(parent)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
