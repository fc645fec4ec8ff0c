"""The lookup channel: the scheduler asks each worker rank how much of a prompt kvtiers holds.

In vLLM's default mode the scheduler runs in the engine-core process and each tensor-
parallel rank's worker in a process of its own; the worker holds the `TieredCache` (its
DRAM tier included). Each worker serves lookups on a Unix socket named after the engine
id and its rank; the scheduler connects to every rank and takes the minimum answer, since a
prefix is usable only if every rank can load its shard of it.

The same channel carries the scheduler's one other request: clear the workers' caches
(vLLM's `reset_prefix_cache(reset_connector=True)`).

Wire format: frames of a 4-byte big-endian length and a msgpack body. Requests are
`[seq, "lookup", salt, tokens]` (tokens: int64 little-endian bytes) and `[seq, "clear"]`;
answers `[seq, value, error, tiers]`: `value` the hit in tokens or the residencies
cleared, `error` a string or `None`, `tiers` the name of the tier each chunk of a hit is in
(`LookupResult.tiers`). Requests on one connection are answered concurrently, each tagged
by its `seq`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import xxhash

from kvtiers.core.index import LookupResult

__all__ = ["LookupClient", "LookupServer", "socket_path"]

logger = logging.getLogger("kvtiers.vllm")

Salt = str | bytes | None
Lookup = Callable[[npt.NDArray[np.int64], Salt], Awaitable[LookupResult]]
Clear = Callable[[], Awaitable[int]]

_HEADER = struct.Struct(">I")
_MAX_FRAME = 1 << 30  # 1 GiB: far above any prompt, guards against a garbled stream


def socket_path(directory: str | os.PathLike[str], engine_id: str, dp_rank: int, rank: int) -> str:
    """Return the socket path of one worker of one engine.

    `rank` is the worker's rank in its data-parallel group, `pp_rank * tp_size + tp_rank`.
    The engine id is hashed so the path stays under the 107-byte limit of Unix sockets.
    """
    tag = xxhash.xxh64_hexdigest(engine_id.encode())
    return str(Path(directory) / f"kvtiers-{tag}-dp{dp_rank}-r{rank}.sock")


def _frame(body: Any) -> bytes:
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    return _HEADER.pack(len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader) -> Any | None:
    """Return the next message, or `None` at a clean end of stream."""
    try:
        head = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionError("lookup channel: stream ended inside a frame header") from exc
        return None
    (size,) = _HEADER.unpack(head)
    if size > _MAX_FRAME:
        raise ConnectionError(f"lookup channel: frame of {size} bytes is too large")
    return msgpack.unpackb(await reader.readexactly(size), raw=False)


class LookupServer:
    """Answer lookups on a Unix socket with `lookup(tokens, salt)`, and clears with `clear()`.

    Args:
        path: the socket path; a stale file there is replaced.
        lookup: the coroutine function that answers (normally `TieredCache.locate`).
        clear: the coroutine function that clears the cache and returns the residencies
            removed; without it a clear is answered with an error.
    """

    def __init__(self, path: str, lookup: Lookup, clear: Clear | None = None) -> None:
        self.path = path
        self._lookup = lookup
        self._clear = clear
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        """Bind the socket and start serving."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        lock = asyncio.Lock()
        try:
            async with asyncio.TaskGroup() as group:
                while (message := await _read_frame(reader)) is not None:
                    group.create_task(self._answer(message, writer, lock))
        except* (ConnectionError, OSError, ValueError, msgpack.UnpackException) as group:
            logger.warning("kvtiers: lookup channel connection dropped: %s", group.exceptions[0])
        except* Exception:
            logger.exception("kvtiers: lookup channel connection failed")
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(
        self, message: Sequence[Any], writer: asyncio.StreamWriter, lock: asyncio.Lock
    ) -> None:
        seq, op, *args = message
        error: str | None = None
        value: int = 0
        tiers: tuple[str, ...] = ()
        try:
            if op == "lookup":
                salt, raw = args
                tokens = np.frombuffer(raw, dtype="<i8").astype(np.int64)
                found = await self._lookup(tokens, salt)
                value, tiers = found.num_tokens, found.tiers
            elif op == "clear" and self._clear is not None:
                value = await self._clear()
            else:
                raise ValueError(f"this worker does not serve {op!r} requests")
        except Exception as exc:  # a failed call is an error for the asker, not a dropped link
            error = f"{type(exc).__name__}: {exc}"
        async with lock:
            writer.write(_frame([seq, value, error, list(tiers)]))
            await writer.drain()

    async def aclose(self) -> None:
        """Stop serving, drop open connections and remove the socket file; idempotent."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class LookupClient:
    """Ask every worker rank over its socket; the answer is the minimum over ranks.

    Connections open on first use and reopen after a failure. All methods must run on one
    event loop.

    Args:
        paths: the ranks' socket paths.
        tier_order: the tiers' names, top first; where ranks hold a chunk in different
            tiers, the answer names the lowest (the load waits for the slowest rank).
        connect_timeout: seconds to wait for a rank's socket.
    """

    def __init__(
        self, paths: Sequence[str], *, tier_order: Sequence[str] = (), connect_timeout: float = 2.0
    ) -> None:
        self._conns = [_Connection(path, connect_timeout) for path in paths]
        self._depth = {name: depth for depth, name in enumerate(tier_order)}

    async def lookup(self, tokens: npt.NDArray[np.int64], salt: Salt) -> LookupResult:
        """Return the cached prefix that every rank holds, with its tiers.

        Raises:
            ConnectionError, OSError: a rank cannot be reached.
            LookupError: a rank's lookup failed.
        """
        raw = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
        asked = await asyncio.gather(*(conn.ask(["lookup", salt, raw]) for conn in self._conns))
        answers = [LookupResult(value, tiers) for value, tiers in asked]
        num_tokens = min(found.num_tokens for found in answers)
        num_chunks = min(len(found.tiers) for found in answers)
        # NOTE: a name this side does not know ranks below every known tier.
        lowest = len(self._depth)
        tiers = tuple(
            max(names, key=lambda name: self._depth.get(name, lowest))
            for names in zip(*(found.tiers[:num_chunks] for found in answers), strict=True)
        )
        return LookupResult(num_tokens, tiers)

    async def clear(self) -> int:
        """Clear every rank's cache; return the residencies removed, summed over ranks.

        Raises:
            ConnectionError, OSError: a rank cannot be reached.
            LookupError: a rank's clear failed.
        """
        answers = await asyncio.gather(*(conn.ask(["clear"]) for conn in self._conns))
        return sum(value for value, _ in answers)

    async def aclose(self) -> None:
        """Close every connection; idempotent."""
        for conn in self._conns:
            await conn.aclose()


class _Connection:
    def __init__(self, path: str, connect_timeout: float) -> None:
        self.path = path
        self._timeout = connect_timeout
        self._seq = itertools.count()
        self._lock = asyncio.Lock()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[int, str | None, list[str]]]] = {}

    async def _ensure(self) -> asyncio.StreamWriter:
        async with self._lock:
            if self._writer is None or self._writer.is_closing():
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(self.path), self._timeout
                )
                self._writer = writer
                self._reader_task = asyncio.get_running_loop().create_task(
                    self._read_answers(reader), name=f"kvtiers-lookup-{self.path}"
                )
            return self._writer

    async def _read_answers(self, reader: asyncio.StreamReader) -> None:
        error: BaseException = ConnectionError(f"lookup channel {self.path}: closed by the worker")
        try:
            while (message := await _read_frame(reader)) is not None:
                seq, num_tokens, err, tiers = message
                future = self._pending.pop(seq, None)
                if future is not None and not future.done():
                    future.set_result((num_tokens, err, tiers))
        except (ConnectionError, OSError, ValueError, msgpack.UnpackException) as exc:
            error = exc
        finally:
            self._fail_pending(error)
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def _fail_pending(self, error: BaseException) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError(str(error)))
        self._pending.clear()

    async def ask(self, request: list[Any]) -> tuple[int, tuple[str, ...]]:
        """Send `request` (without its `seq`); return the answer's value and tiers."""
        writer = await self._ensure()
        seq = next(self._seq)
        future: asyncio.Future[tuple[int, str | None, list[str]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[seq] = future
        try:
            writer.write(_frame([seq, *request]))
            await writer.drain()
            value, error, tiers = await future
        finally:
            self._pending.pop(seq, None)
        if error is not None:
            raise LookupError(f"worker {request[0]} failed: {error}")
        return int(value), tuple(str(name) for name in tiers)

    async def aclose(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
            self._reader_task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._fail_pending(ConnectionError("lookup channel closed"))
