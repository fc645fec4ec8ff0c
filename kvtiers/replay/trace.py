"""Request traces: read, validate, and turn into chains of block ids.

Two formats, one JSON object per line, told apart by the first request line:

- **Mooncake** (`{"timestamp", "input_length", "output_length", "hash_ids"}`): each request is
  given as the ids of its blocks (512 tokens each in Mooncake's traces, the last one
  possibly partial), chained over the prefix: an equal id means an equal whole prefix.
- **Tokens** (`{"tokens": [...], "salt": "..."}`, `timestamp` and `output_length`
  optional): the token ids themselves. Only full blocks are keyed, by the library's
  chained `ChunkHasher`, so `salt` isolates tenants exactly as it does in the cache.

Either way a request becomes a tuple of dense block ids (0, 1, ... in order of first
appearance), each with one parent, so the trace is a prefix trie. Every error is a
`TraceError` naming the file and line.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtiers.core.checks import MAX_DIM, describe, is_int
from kvtiers.core.errors import TokenError
from kvtiers.core.keys import ChunkHasher, ChunkKey
from kvtiers.replay._lines import TraceError, path_name, records

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceError",
    "TraceFormat",
    "read_prompts",
    "read_trace",
]

TraceFormat = Literal["mooncake", "tokens"]

#: Tokens per block of Mooncake's published traces.
MOONCAKE_BLOCK_TOKENS = 512
#: Tokens per block of a token trace when the caller names none (the library's default).
_DEFAULT_TOKEN_BLOCK = 256
#: The largest token count a record may give (an exact float, so costs stay finite).
_MAX_COUNT = 2**53
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
# NOTE: token traces are keyed under a fixed fingerprint: only equality of keys matters here.
_TOKEN_FINGERPRINT = b"kvtiers.replay.tokens"


@dataclass(frozen=True, slots=True)
class Trace:
    """A request trace as chains of dense block ids, in file order."""

    path: str
    """Where it was read from."""
    format: TraceFormat
    """`"mooncake"` or `"tokens"`."""
    block_tokens: int
    """Tokens per block."""
    requests: tuple[tuple[int, ...], ...]
    """Each request's block ids, prefix first; ids are dense, numbered by first appearance."""
    parents: tuple[int, ...]
    """The parent of each block id (-1 for a first block)."""
    keys: tuple[ChunkKey, ...]
    """The chunk key of each block id, as the prefix index stores it."""
    timestamps: tuple[float, ...]
    """Arrival of each request in milliseconds (0 where the trace gives none)."""
    input_tokens: tuple[int, ...]
    """Prompt tokens of each request."""
    output_tokens: tuple[int, ...]
    """Generated tokens of each request (0 where the trace gives none)."""

    @property
    def num_requests(self) -> int:
        """Return the number of requests."""
        return len(self.requests)

    @property
    def total_blocks(self) -> int:
        """Return the number of blocks requested, over all requests."""
        return sum(len(ids) for ids in self.requests)

    @property
    def unique_blocks(self) -> int:
        """Return the number of distinct blocks."""
        return len(self.parents)

    def head(self, num_requests: int) -> Trace:
        """Return a trace of the first `num_requests` requests only.

        Ids stay dense: they are numbered by first appearance, so the first requests use
        the first ids.
        """
        requests = self.requests[:num_requests]
        num_ids = max((max(ids) + 1 for ids in requests if ids), default=0)
        return Trace(
            self.path,
            self.format,
            self.block_tokens,
            requests,
            self.parents[:num_ids],
            self.keys[:num_ids],
            self.timestamps[:num_requests],
            self.input_tokens[:num_requests],
            self.output_tokens[:num_requests],
        )


def read_trace(
    path: str | os.PathLike[str],
    *,
    block_tokens: int | None = None,
    token_block_tokens: int | None = None,
    limit: int | None = None,
) -> Trace:
    """Read a Mooncake or token trace from a JSON-lines file.

    Args:
        path: the file; blank lines are skipped.
        block_tokens: tokens per block, whatever the format; by default 512 for a Mooncake
            trace and `token_block_tokens` for a token trace.
        token_block_tokens: tokens per block of a token trace when `block_tokens` is not
            given (a layout's chunk size); default 256.
        limit: read only the first `limit` requests.

    Returns:
        The trace, requests in file order.

    Raises:
        TraceError: the file cannot be read, holds no request, or a line is malformed
            (missing or mistyped field, decreasing timestamp, inconsistent block ids).
    """
    name = path_name(path)
    for arg, value in (("block_tokens", block_tokens), ("token_block_tokens", token_block_tokens)):
        if value is not None and (not is_int(value) or not 1 <= value <= MAX_DIM):
            raise TraceError(
                f"{arg}: tokens per block must be >= 1 and <= {MAX_DIM}, got {describe(value)}",
                path=name,
            )
    if limit is not None and (not is_int(limit) or limit < 1):
        raise TraceError(f"limit: expected an integer >= 1, got {describe(limit)}", path=name)
    builder: _Builder | None = None
    for line_no, record in records(Path(name), limit):
        if builder is None:
            fmt: TraceFormat = "mooncake" if "hash_ids" in record else "tokens"
            if fmt == "tokens" and "tokens" not in record:
                raise TraceError(
                    "expected a Mooncake record (timestamp, input_length, output_length, "
                    f"hash_ids) or a token record (tokens), got keys {describe(sorted(record))}",
                    path=name,
                    line=line_no,
                )
            default = (
                MOONCAKE_BLOCK_TOKENS
                if fmt == "mooncake"
                else token_block_tokens or _DEFAULT_TOKEN_BLOCK
            )
            builder = _Builder(name, fmt, block_tokens or default)
        builder.add(line_no, record)
    if builder is None:
        raise TraceError("the trace is empty: no request lines", path=name)
    return builder.build()


def read_prompts(trace: Trace) -> Iterator[tuple[list[int], str | None]]:
    """Yield the token ids and salt of each request of a token trace, in order.

    A `Trace` keeps block keys, not tokens: this reads `trace.path` again, one line at a
    time, up to the trace's last request (for a replay that hashes tokens itself).

    Raises:
        TraceError: `trace` is not a token trace, or its file no longer holds its requests.
    """
    if not isinstance(trace, Trace):
        raise TraceError(f"expected a Trace (from read_trace), got {type(trace).__name__}")
    if trace.format != "tokens":
        raise TraceError(f"a {trace.format} trace holds no tokens", path=trace.path)
    count = 0
    for line_no, record in records(Path(trace.path), trace.num_requests):
        tokens, salt = record.get("tokens"), record.get("salt")
        if not isinstance(tokens, list) or not (salt is None or isinstance(salt, str)):
            raise TraceError("changed since it was read", path=trace.path, line=line_no)
        count += 1
        yield tokens, salt
    if count < trace.num_requests:
        raise TraceError("changed since it was read: requests missing", path=trace.path)


class _Builder:
    """Collect validated requests and number their blocks densely."""

    def __init__(self, path: str, fmt: TraceFormat, block_tokens: int) -> None:
        self.path = path
        self.format: TraceFormat = fmt
        self.block_tokens = block_tokens
        self.requests: list[tuple[int, ...]] = []
        self.parents: list[int] = []
        self.keys: list[ChunkKey] = []
        self.timestamps: list[float] = []
        self.input_tokens: list[int] = []
        self.output_tokens: list[int] = []
        self._ids: dict[object, int] = {}
        # For a Mooncake trace: the line where each id first appeared, to name both lines.
        self._first_line: list[int] = []
        self._hasher = ChunkHasher(_TOKEN_FINGERPRINT, block_tokens)

    def error(self, message: str, line: int) -> TraceError:
        return TraceError(message, path=self.path, line=line)

    def add(self, line: int, record: Mapping[str, Any]) -> None:
        if self.format == "mooncake":
            raw_ids, num_tokens = self._mooncake(line, record)
        else:
            raw_ids, num_tokens = self._tokens(line, record)
        self.timestamps.append(self._timestamp(line, record))
        self.input_tokens.append(num_tokens)
        self.output_tokens.append(self._count(line, record, "output_length", default=0))
        self.requests.append(self._chain(line, raw_ids))

    def build(self) -> Trace:
        return Trace(
            self.path,
            self.format,
            self.block_tokens,
            tuple(self.requests),
            tuple(self.parents),
            tuple(self.keys),
            tuple(self.timestamps),
            tuple(self.input_tokens),
            tuple(self.output_tokens),
        )

    def _mooncake(self, line: int, record: Mapping[str, Any]) -> tuple[list[object], int]:
        missing = [f for f in _MOONCAKE_FIELDS if f not in record]
        if missing:
            raise self.error(
                f"missing field {missing[0]!r}; a Mooncake record needs "
                + ", ".join(_MOONCAKE_FIELDS),
                line,
            )
        num_tokens = self._count(line, record, "input_length", default=None)
        hash_ids = record["hash_ids"]
        if not isinstance(hash_ids, list) or not all(_is_count(h) for h in hash_ids):
            raise self.error("hash_ids: expected a list of non-negative integers", line)
        expected = -(-num_tokens // self.block_tokens)  # ceil, exact for any integer
        if len(hash_ids) != expected:
            raise self.error(
                f"{len(hash_ids)} hash_ids for input_length {num_tokens}; with "
                f"{self.block_tokens}-token blocks expected {expected} "
                "(pass the trace's block size if it is another)",
                line,
            )
        return list(hash_ids), num_tokens

    def _tokens(self, line: int, record: Mapping[str, Any]) -> tuple[list[object], int]:
        if "tokens" not in record:
            raise self.error("missing field 'tokens'; a token record needs tokens", line)
        tokens = record["tokens"]
        if not isinstance(tokens, list):
            raise self.error("tokens: expected a list of token ids", line)
        # NOTE: JSON's true and false load as bools, which count as the ints 1 and 0.
        if bool in set(map(type, tokens)):
            raise self.error("tokens: true or false is not a token id", line)
        salt = record.get("salt")
        if salt is not None and not isinstance(salt, str):
            raise self.error(f"salt: expected a string, got {type(salt).__name__}", line)
        if salt is not None and not _is_utf8(salt):
            raise self.error(
                f"salt: not encodable as UTF-8 (a lone surrogate escape?): {salt!a:.60}", line
            )
        try:
            keys = self._hasher.keys(tokens, salt)
        except TokenError as exc:
            raise self.error(str(exc), line) from exc
        return list(keys), len(tokens)

    def _timestamp(self, line: int, record: Mapping[str, Any]) -> float:
        if "timestamp" not in record:
            return self.timestamps[-1] if self.timestamps else 0.0
        value = record["timestamp"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise self.error(f"timestamp: expected a number >= 0, got {value!r:.40}", line)
        if value > sys.float_info.max or not math.isfinite(value):  # an int beyond floats too
            raise self.error(f"timestamp: expected a finite number, got {value!r:.40}", line)
        if isinstance(value, int) and float(value) != value:  # past 2**53: rounded, not kept
            raise self.error(
                f"timestamp: {value!r:.40} is not held exactly by a float (over 2**53)", line
            )
        if self.timestamps and value < self.timestamps[-1]:
            raise self.error(
                f"timestamp {value} is earlier than the previous request's "
                f"{self.timestamps[-1]:g}; requests must be in arrival order",
                line,
            )
        return float(value)

    def _count(self, line: int, record: Mapping[str, Any], field: str, default: int | None) -> int:
        if field not in record and default is not None:
            return default
        value = record[field]
        if not _is_count(value) or value > _MAX_COUNT:
            raise self.error(
                f"{field}: expected an integer from 0 to 2**53, got {value!r:.40}", line
            )
        return int(value)

    def _chain(self, line: int, raw_ids: list[object]) -> tuple[int, ...]:
        """Number a request's blocks, checking that each id has one parent."""
        ids = self._ids
        chain: list[int] = []
        parent = -1
        for raw in raw_ids:
            dense = ids.get(raw)
            if dense is None:
                dense = ids[raw] = len(self.parents)
                self.parents.append(parent)
                self.keys.append(_key_of(raw))
                self._first_line.append(line)
            elif self.parents[dense] != parent:
                if dense in chain:
                    raise self.error(
                        f"block {raw!s:.40} appears twice in one request; "
                        "an id names a whole prefix",
                        line,
                    )
                raise self.error(
                    f"block {raw!s:.40} follows a different prefix here than on line "
                    f"{self._first_line[dense]}; an id must name one whole prefix "
                    "(ids chained over the prefix)",
                    line,
                )
            chain.append(dense)
            parent = dense
        return tuple(chain)


def _is_utf8(text: str) -> bool:
    """Return whether `text` encodes to UTF-8; a lone surrogate (JSON `"\\ud800"`) does not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _key_of(raw: object) -> ChunkKey:
    if isinstance(raw, bytes):
        return ChunkKey(raw)
    # A Mooncake id: any distinct bytes do, the index only compares keys.
    assert isinstance(raw, int)
    return ChunkKey(raw.to_bytes(max(8, (raw.bit_length() + 7) // 8), "little"))
