"""Reads of objects into a caller's buffer, per kind of filesystem.

`ObjectStore` runs these through its request rules: `read_into` and `read_ranges` for a
local filesystem (a file opened and read into the buffer, with readahead hints for the
objects after it; some byte ranges of one file, opened once), `s3_read_into` and `s3_head`
for s3fs (one ranged GET or HEAD each, the body copied into the buffer piece by piece
instead of built into one `bytes`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtiers.tiers._readahead import will_need

__all__ = ["range_refused", "read_into", "read_ranges", "s3_head", "s3_read_into"]

_PIECE = 1 << 20  # bytes of an S3 body read at a time into the caller's buffer
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # absent on Windows, where pipes are not files


def read_into(
    fs: Any, path: str, take: Callable[[], npt.NDArray[np.uint8]], ahead: Sequence[str]
) -> tuple[npt.NDArray[np.uint8], int]:
    """Read the local file at `path` into a buffer from `take`, up to its size.

    Anything but a regular file at `path` (a named pipe, a folder) reads as empty, so the
    tier judges it a truncated object instead of waiting on it.
    """
    if ahead:
        will_need(ahead)
    buf = take()
    view, got = buf.data, 0
    with _open_regular(path) as f:
        if f is None:
            return buf, 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return buf, got


def read_ranges(fs: Any, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """Return byte ranges `[start, end)` of the local file at `path` (one open for all).

    Anything but a regular file reads as empty ranges, as `read_into` does.
    """
    with _open_regular(path) as f:
        if f is None:
            return [b""] * len(ranges)
        fd = f.fileno()
        return [os.pread(fd, max(end - start, 0), start) for start, end in ranges]


@contextlib.contextmanager
def _open_regular(path: str) -> Iterator[io.FileIO | None]:
    """Open `path` to read, or yield `None` when it is not a regular file.

    Raises:
        FileNotFoundError: nothing at `path`.
    """
    # NOTE: O_NONBLOCK, so a named pipe opens at once instead of waiting for a writer; it
    # changes nothing for a regular file.
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | getattr(os, "O_BINARY", 0))
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        yield None
        return
    with io.FileIO(fd, "rb", closefd=True) as f:
        yield f


async def s3_read_into(
    fs: Any, path: str, take: Callable[[], npt.NDArray[np.uint8]]
) -> tuple[npt.NDArray[np.uint8], int]:
    """Read an S3 object into a buffer from `take`, up to the buffer's size (s3fs).

    One ranged GET whose body is copied into the buffer as it arrives, where `cat_file`
    would build a new `bytes` of the whole object first (for 8 MiB, two thousand fresh
    pages to fault in and zero, then a copy).
    """
    bucket, key, version = fs.split_path(path)
    buf = take()
    view, got = buf.data, 0
    versioned = {"VersionId": version} if version else {}
    try:
        resp = await fs._call_s3(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{len(view) - 1}", **versioned
        )
    except OSError as exc:
        if range_refused(exc):  # an empty object: nothing to read
            return buf, 0
        raise
    body = resp["Body"]
    try:
        while got < len(view):
            piece = await body.read(min(_PIECE, len(view) - got))
            if not piece:
                break
            view[got : got + len(piece)] = piece
            got += len(piece)
    finally:
        body.close()
    return buf, got


def range_refused(exc: BaseException) -> bool:
    """Return whether `exc` is an object store refusing a byte range (HTTP 416: too short)."""
    return isinstance(exc, OSError) and exc.errno == errno.EINVAL


async def s3_head(fs: Any, path: str) -> dict[str, Any]:
    """Return an S3 object's size from one HEAD request (s3fs)."""
    bucket, key, _ = fs.split_path(path)
    out = await fs._call_s3("head_object", Bucket=bucket, Key=key)
    return {"name": path, "size": int(out["ContentLength"]), "type": "file"}
