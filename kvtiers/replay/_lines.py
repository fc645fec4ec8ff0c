"""The lines of a trace file: opened, decoded and parsed into JSON objects, one per line.

Every error is a `TraceError` naming the file and line: a file that cannot be opened, a
compressed one, a line that is not UTF-8 or not one JSON object, a field given twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvtiers.core.checks import describe
from kvtiers.core.errors import InvalidInputError

__all__ = ["TraceError", "path_name", "records"]

# The first bytes of compressed files, which would otherwise read as "not UTF-8".
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"\xfd7zXZ": "xz", b"BZh": "bz2"}


class TraceError(InvalidInputError):
    """A trace file is unreadable, empty or malformed; the message names the line."""

    def __init__(self, message: str, *, path: str = "", line: int | None = None) -> None:
        where = f"{path} line {line}" if line is not None else path
        super().__init__(f"{where}: {message}" if where else message)
        self.path = path
        """The trace file."""
        self.line = line
        """The 1-based line number of the bad record, or `None` for the whole file."""


def path_name(path: object) -> str:
    """Return a trace path as text.

    Raises:
        TraceError: `path` is not a text path.
    """
    name = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if not isinstance(name, str):
        raise TraceError(f"expected the path of a trace file, got {describe(path)}")
    return name


def records(path: Path, limit: int | None) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """Yield (line number, JSON object) for each non-blank line, up to `limit` of them."""
    name = str(path)
    try:
        f = path.open("rb")
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise TraceError(f"cannot read: {reason}", path=name) from exc
    count = 0
    with f:
        # NOTE: binary lines decoded one by one, so a decoding error names its own line.
        for line_no, raw in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
            if line_no == 1:
                raw = _first_line(raw, name)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"not UTF-8 ({exc.reason})", path=name, line=line_no) from exc
            if not text.strip():
                continue
            count += 1
            yield line_no, _json_object(text, name, line_no)


def _first_line(raw: bytes, path: str) -> bytes:
    """Return the first line without a UTF-8 byte-order mark; refuse a compressed file."""
    for magic, kind in _COMPRESSED.items():
        if raw.startswith(magic):
            raise TraceError(f"{kind}-compressed; decompress it first", path=path)
    return raw.removeprefix(b"\xef\xbb\xbf")


def _json_object(text: str, path: str, line: int) -> Mapping[str, Any]:
    """Return a line's JSON object.

    Raises:
        TraceError: not JSON (also: nested thousands deep, an integer of thousands of
            digits), or not an object.
    """
    try:
        record = json.loads(text, object_pairs_hook=_unique_keys)
    except _RepeatedField as exc:
        raise TraceError(
            f"field {describe(exc.key)} appears twice; a record gives each field once",
            path=path,
            line=line,
        ) from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"not valid JSON: {exc.msg}", path=path, line=line) from exc
    except ValueError as exc:  # an integer past Python's digit limit
        raise TraceError(f"not valid JSON: {exc}", path=path, line=line) from exc
    except RecursionError:  # arrays or objects nested thousands deep
        raise TraceError("not valid JSON: nested too deep", path=path, line=line) from None
    if not isinstance(record, dict):
        raise TraceError("expected a JSON object", path=path, line=line)
    return record


class _RepeatedField(Exception):
    """A JSON object names one key twice (json.loads would keep the last value silently)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    record = dict(pairs)
    if len(record) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedField(key)
            seen.add(key)
    return record
