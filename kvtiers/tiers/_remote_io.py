"""Requests to an fsspec filesystem: bounded, timed out, retried, behind a circuit breaker.

`ObjectStore` is the only place the remote tier touches fsspec. Async filesystems (s3fs,
gcsfs, adlfs) are called through their coroutines on the event loop; sync ones (local,
memory) in a thread pool of `max_in_flight` threads. Every request goes through the rules
of `_remote_requests` (slots, timeout, retries, the breaker of `_remote_breaker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import numpy as np
import numpy.typing as npt
from fsspec.core import split_protocol, url_to_fs

from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.tiers._files import write_renamed
from kvtiers.tiers._remote_breaker import StoreFull, StoreUnavailable
from kvtiers.tiers._remote_fetch import (
    range_refused,
    read_into,
    read_ranges,
    s3_head,
    s3_read_into,
)
from kvtiers.tiers._remote_options import Redactor, RemoteOptions, display_url
from kvtiers.tiers._remote_requests import RequestRunner

__all__ = ["ObjectStore"]

logger = logging.getLogger("kvtiers")

# Filesystems whose PUT makes an object appear whole or not at all (object stores; the memory
# filesystem commits a file on close). Others write a temporary name and rename it.
_ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"})
_S3 = frozenset({"s3", "s3a"})
_REWARN_FULL = 300.0  # seconds between two warnings that the store is full


class ObjectStore:
    """One fsspec filesystem, reached through bounded, retried, breaker-guarded requests.

    Args:
        options: the tier's options (URL, storage options, limits).
        name: the tier's name, for logs.
    """

    def __init__(self, options: RemoteOptions, name: str) -> None:
        self.options, self.name = options, name
        self.redact = Redactor(options.storage_options, options.url)
        self.url = display_url(options.url)
        self.protocol = split_protocol(options.url)[0] or "file"
        self.atomic_put = self.protocol in _ATOMIC_PUT
        self._requests = RequestRunner(options, self.url, name, self.describe)
        self.breaker = self._requests.breaker
        self.counters = self._requests.counters
        self.full = False
        """Whether the last write was refused for lack of space."""
        self._full_warned_at = -math.inf
        self.root = ""
        self._fs: Any = None
        self._async = False
        self._session: Any = None
        self._pool: ThreadPoolExecutor | None = None

    @staticmethod
    def check_protocol(url: str, where: str) -> None:
        """Raise `ConfigError` if no installed fsspec backend serves `url`."""
        protocol = split_protocol(url)[0] or "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            hint = " (pip install 'kvtiers[remote]' for s3://)" if protocol in _S3 else ""
            raise ConfigError(
                f"{where}.url: protocol {protocol!r} is unavailable: {exc}{hint}"
            ) from None

    # -- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Build the filesystem (on the running loop, for async ones)."""
        try:
            cls = fsspec.get_filesystem_class(self.protocol)
            self._async = bool(getattr(cls, "async_impl", False))
            self._fs, root = url_to_fs(self.options.url, **self._fs_kwargs())
            if self.protocol in _S3:
                self._fs.retries = 1  # this class retries; s3fs's own loop would multiply it
            if self._async and hasattr(self._fs, "set_session"):
                self._session = await self._fs.set_session()
        except Exception as exc:
            await self.close()
            raise TierIOError(
                f"{self.name}: cannot open {self.url}: {self.describe(exc)}"
            ) from None
        self.root = str(root).rstrip("/")
        if not self._async:
            self._pool = ThreadPoolExecutor(
                self.options.max_in_flight, thread_name_prefix=f"kvtiers-remote-{self.name}"
            )

    def _fs_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.options.storage_options)
        # NOTE: each tier gets its own instance (fsspec would share one per argument set,
        # across event loops), and listings are never cached: other nodes change the store.
        kwargs.setdefault("skip_instance_cache", True)
        kwargs.setdefault("use_listings_cache", False)
        if self._async:
            kwargs["asynchronous"] = True
        if self.protocol in ("file", "local"):
            kwargs.setdefault("auto_mkdir", True)
        if self.protocol in _S3:
            # botocore's own retries and 60 s timeouts would hide behind ours; ours rule.
            config = dict(kwargs.get("config_kwargs") or {})
            config.setdefault("connect_timeout", self.options.timeout)
            config.setdefault("read_timeout", self.options.timeout)
            config.setdefault("retries", {"max_attempts": 1})
            # Every chunk carries its own xxh3 checksums; CRC32s of each body would be redundant.
            config.setdefault("request_checksum_calculation", "when_required")
            config.setdefault("response_checksum_validation", "when_required")
            kwargs["config_kwargs"] = config
        return kwargs

    async def close(self) -> None:
        """Release the filesystem's session and threads."""
        session, self._session = self._session, None
        close = getattr(session, "close", None)
        if close is not None:
            try:
                result = close()
                if asyncio.iscoroutine(result):
                    await asyncio.wait_for(result, self.options.timeout)
            except Exception as exc:  # closing must not fail the tier's close
                logger.debug("kvtiers: %s: closing the session: %s", self.name, self.describe(exc))
        pool, self._pool = self._pool, None
        if pool is not None:
            # NOTE: its threads only return bytes (they never touch a caller's buffer), so a
            # call stuck in the filesystem need not hold up the close.
            pool.shutdown(wait=False, cancel_futures=True)
        self._fs = None

    def describe(self, exc: BaseException) -> str:
        """Return `exc` as one short line with every secret redacted."""
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return self.redact(" ".join(text.split()))[:300]

    @property
    def read_timeout(self) -> float:
        """Seconds one read call may wait in all (`RemoteOptions.read_timeout`)."""
        return self.options.read_timeout or self.options.timeout

    @property
    def is_object_store(self) -> bool:
        """Whether requests go over the network (an async filesystem: s3fs, gcsfs...)."""
        return self._async

    @property
    def available(self) -> bool:
        """Whether a request would be tried now (the breaker is not refusing)."""
        return self.breaker.would_allow()

    # -- operations --------------------------------------------------------------------

    async def cat(self, path: str, size: int | None = None) -> bytes | None:
        """Return the object at `path`, or `None` if there is none.

        Args:
            path: the object.
            size: read at most this many bytes, in one ranged request (s3fs reads a whole
                object with two: its size, then its bytes).
        """
        try:
            if size is None:
                data: bytes = await self._request("cat_file", path)
                return data
            try:
                data = await self._request(
                    "cat_file", path, start=0, end=size, answer=range_refused
                )
            except OSError as exc:
                if not range_refused(exc):
                    raise
                data = await self._request("cat_file", path)  # an empty object, most likely
            return data
        except FileNotFoundError:
            return None

    @property
    def _s3(self) -> bool:
        """Whether the filesystem is s3fs (requests of our own go through `_call_s3`)."""
        return self._async and hasattr(self._fs, "_call_s3")

    @property
    def local(self) -> bool:
        """Whether the store is a local or mounted filesystem (its objects are files)."""
        return self.protocol in ("file", "local")

    @property
    def reads_into(self) -> bool:
        """Whether `read_into` serves this store (a local filesystem, or S3 via s3fs)."""
        return self.local or self._s3

    async def read_into(
        self, path: str, take: Callable[[], npt.NDArray[np.uint8]], ahead: Sequence[str] = ()
    ) -> tuple[npt.NDArray[np.uint8], int] | None:
        """Read the object at `path` into a buffer from `take`; the buffer and bytes read.

        Each attempt takes its own buffer, so a timed-out attempt that goes on reading
        never writes into the buffer of a later one. `None` if there is no such object.
        The objects at `ahead` are hinted to the kernel first (`_readahead.will_need`).
        """
        try:
            result: tuple[npt.NDArray[np.uint8], int] = await (
                self._request(s3_read_into, path, take)
                if self._s3
                else self._request(read_into, path, take, ahead)
            )
        except FileNotFoundError:
            return None
        return result

    async def cat_ranges(self, path: str, ranges: list[tuple[int, int]]) -> list[Any] | None:
        """Return byte ranges `[start, end)` of one object (an exception where one failed).

        Returns:
            One item per range, `bytes` or the exception that range raised; `None` if the
            object does not exist.
        """
        starts, ends = [r[0] for r in ranges], [r[1] for r in ranges]
        try:
            parts: list[Any] = await (
                self._request(read_ranges, path, ranges)
                if self.local
                else self._request(
                    "cat_ranges", [path] * len(ranges), starts, ends, on_error="return"
                )
            )
        except FileNotFoundError:
            return None
        if any(isinstance(part, FileNotFoundError) for part in parts):
            return None
        return parts

    async def info(self, path: str) -> dict[str, Any] | None:
        """Return the object's details (`size`, ...), or `None` if there is none."""
        # NOTE: s3fs's info() lists the "directory" after a 404; one HEAD is all we need.
        method = s3_head if self._s3 else "info"
        try:
            details: dict[str, Any] = await self._request(method, path)
        except FileNotFoundError:
            return None
        return details

    async def write(self, path: str, data: bytes, on_success: Callable[[], None]) -> None:
        """Store `data` at `path` whole: a reader sees the old object or the new one.

        `on_success` runs once the object is stored, also if the caller was cancelled
        meanwhile (a started write is finished, not abandoned).

        Raises:
            StoreUnavailable: the store failed, is full (`StoreFull`), or has nowhere to
                put the object (no such bucket; a temporary removed by someone else).
        """
        method = "pipe_file" if self.atomic_put else write_renamed
        try:
            await self._request(method, path, data, on_success=on_success)
        except FileNotFoundError as exc:  # an answer of the store, but no write
            raise StoreUnavailable(f"{self.url}: cannot write: {self.describe(exc)}") from None
        except StoreFull as exc:
            now = time.monotonic()
            # once per episode, not per chunk; a nearly full store starts no new one at once
            warn = not self.full and now - self._full_warned_at >= _REWARN_FULL
            self.full = True
            if warn:
                self._full_warned_at = now
                logger.warning(
                    "kvtiers: remote tier %r: %s; writes are declined until it has room",
                    self.name,
                    exc,
                )
            raise
        if self.full:
            self.full = False
            logger.debug("kvtiers: remote tier %r: %s takes writes again", self.name, self.url)

    async def rm(self, path: str) -> None:
        """Delete the object at `path`; a missing one is fine."""
        with contextlib.suppress(FileNotFoundError):
            await self._request("rm_file", path)

    async def find(self, path: str, *, retries: int | None = None) -> dict[str, dict[str, Any]]:
        """Return every object below `path` with its details (none if `path` is absent).

        A folder below `path` that cannot be listed fails the whole listing (see
        `_find_local`): a listing that left it out would undercount the pool.

        Args:
            path: the folder or prefix.
            retries: retries after a failure, instead of the configured number.
        """
        try:
            found: dict[str, dict[str, Any]] = await (
                self._request(_find_local, path, max_retries=retries)
                if self.local
                else self._request("find", path, detail=True, max_retries=retries)
            )
        except FileNotFoundError:
            return {}
        return found

    # -- requests ----------------------------------------------------------------------

    async def _request(
        self,
        method: str | Callable[..., Any],
        *args: Any,
        on_success: Callable[[], None] | None = None,
        max_retries: int | None = None,
        answer: Callable[[BaseException], bool] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one filesystem call with the slot, timeout, retry and breaker rules.

        `method` is a filesystem method's name or a helper of ours taking the filesystem
        first; the rest is as for `RequestRunner.run`.
        """
        call = self._call(method, args, kwargs)
        return await self._requests.run(
            call, on_success=on_success, max_retries=max_retries, answer=answer
        )

    def _call(
        self, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Callable[[], Awaitable[Any]]:
        fs = self._fs
        if fs is None:
            raise StoreUnavailable(f"{self.url}: not open")
        if inspect.iscoroutinefunction(method):  # a helper of ours, for async filesystems
            return lambda: method(fs, *args, **kwargs)
        if callable(method):  # a helper of ours, for sync filesystems
            fn = functools.partial(method, fs, *args, **kwargs)
        elif self._async:
            coro_fn = getattr(fs, f"_{method}")
            return lambda: coro_fn(*args, **kwargs)
        else:
            fn = functools.partial(getattr(fs, method), *args, **kwargs)
        loop, pool = asyncio.get_running_loop(), self._pool
        if pool is None:
            raise StoreUnavailable(f"{self.url}: not open")
        return lambda: loop.run_in_executor(pool, fn)


def _find_local(fs: Any, path: str) -> dict[str, dict[str, Any]]:
    """Return every file below `path` on a local filesystem, by path, with its details.

    As fsspec's `find(path, detail=True)`, except that a folder that cannot be listed (or
    an entry whose details cannot be read) raises instead of being left out: fsspec's
    `walk` swallows every `OSError` below the top (its `on_error` does not reach the
    folders it recurses into), so a folder this user may not read went missing without a
    word. A folder that vanishes once listed (a purge removed it) is left out, as gone.

    Raises:
        FileNotFoundError: `path` does not exist.
        OSError: a folder or entry below it cannot be read (e.g. `PermissionError`).
    """
    top = fs._strip_protocol(path)
    found: dict[str, dict[str, Any]] = {}
    folders = [top]
    while folders:
        folder = folders.pop()
        try:
            entries = fs.ls(folder, detail=True)
        except FileNotFoundError:
            if folder == top:
                raise
            continue
        for info in entries:
            name = info["name"].rstrip("/")
            if info["type"] == "directory" and name != folder:
                folders.append(name)
            else:
                found[name] = info
    return dict(sorted(found.items()))
