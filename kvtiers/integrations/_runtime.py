"""Threads, loops and the per-process cache registry behind the engine adapters.

vLLM and SGLang call an adapter synchronously from their own threads, while `TieredCache`
is asyncio and must be used from the loop that opened it. Each cache therefore lives on a
`LoopThread`: a dedicated event loop in a daemon thread; adapter code submits coroutines
to it and waits on `concurrent.futures.Future`s with timeouts.

`CACHES` is the one deliberate process-level object of the adapters. LMDB allows one open
environment per path per process, and one process may build several users of one config:
with `VLLM_ENABLE_V1_MULTIPROCESSING=0` vLLM builds the scheduler-side and worker-side
connectors (and, in tests, several engines one after another) in one process; SGLang may
attach, detach and attach a storage backend again. They must share one `TieredCache` per
config and layout, opened once and closed when the last user releases it. The registry
also lets the vLLM scheduler side find the worker's cache when both live in one process
(no lookup channel needed then).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvtiers.cache import TieredCache

__all__ = ["CACHES", "CacheRegistry", "Lease", "LoopThread", "SharedCache", "config_identity"]

logger = logging.getLogger("kvtiers.integrations")

_T = TypeVar("_T")


class LoopThread:
    """An asyncio event loop running in a daemon thread of its own.

    Args:
        name: the thread's name (shown in stack dumps).
    """

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        # NOTE: cancel what is left so no task outlives its loop with a pending warning.
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop; schedule work on it only through `submit`."""
        return self._loop

    @property
    def alive(self) -> bool:
        """Whether the loop still runs."""
        return self._thread.is_alive() and not self._loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Schedule `coro` on the loop; return a future for its result.

        Raises:
            RuntimeError: the loop is stopped or closed (`coro` is closed, never left
                unawaited).
        """
        # NOTE: a stopping loop still accepts callbacks until it is closed, and one that
        # arrives after its last turn is dropped: the caller would wait out its whole
        # timeout. Under the lock a submission either lands before the stop (its task
        # runs or is cancelled with the loop's other tasks) or is refused here.
        try:
            with self._lock:
                if self._stopping:
                    raise RuntimeError("the loop is stopped")
                return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except BaseException:
            coro.close()
            raise

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run `coro` on the loop and wait for its result (never call from the loop)."""
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and join the thread; idempotent."""
        if self._loop.is_closed():
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("a LoopThread cannot stop itself from its own thread")
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


@dataclass(eq=False)
class SharedCache:
    """One open `TieredCache`, its loop, and how many connectors use it."""

    key: Hashable
    loop: LoopThread
    cache: TieredCache
    refs: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    """Per-cache services started by a user (the lookup server), closed with the cache."""


def _at_interpreter_exit(callback: Callable[[], None]) -> None:
    """Run `callback` when the interpreter exits, while thread pools still take work.

    NOTE: `atexit` hooks run after `concurrent.futures` has shut its pools down (its hook
    is one of `threading`'s exit hooks, which run first), so a cache closed there cannot
    drain its queues: the LMDB tier writes through a pool. `threading`'s hooks run last
    registered first, so one registered here runs before the pools' own.
    """
    import concurrent.futures.thread  # noqa: F401  # its hook is registered before ours

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has had it since 3.9
        import atexit

        atexit.register(callback)
    else:
        register(callback)


def _close_at_exit(registry_ref: weakref.ref[CacheRegistry]) -> None:
    registry = registry_ref()
    if registry is not None:
        registry.close_all()


class CacheRegistry:
    """Share one open `TieredCache` per (config, layout) within a process, counted by users.

    At interpreter exit the caches still open are closed (their queued writes drained), so
    a process that never shuts its engine down loses no accepted chunk.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, SharedCache] = {}
        self._engines: dict[tuple[str, int], SharedCache] = {}
        self._exit_hooked = False

    def acquire(
        self, key: Hashable, build: Callable[[], TieredCache], *, open_timeout: float = 120.0
    ) -> SharedCache:
        """Return the open cache under `key`, building and opening it on first use.

        Raises:
            Exception: whatever building or opening the cache raised (nothing is kept).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                loop = LoopThread(name="kvtiers-loop")
                try:
                    cache = build()
                    loop.run(cache.open(), open_timeout)
                except BaseException:
                    loop.stop()
                    raise
                entry = SharedCache(key=key, loop=loop, cache=cache)
                self._entries[key] = entry
                if not self._exit_hooked:
                    _at_interpreter_exit(functools.partial(_close_at_exit, weakref.ref(self)))
                    self._exit_hooked = True
            entry.refs += 1
            return entry

    def release(self, entry: SharedCache, *, close_timeout: float = 60.0) -> None:
        """Drop one use of `entry`; the last one closes the cache and stops its loop."""
        # NOTE: the lock is held while closing, so a new user of the same config waits
        # for the close instead of opening the same LMDB path a second time.
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            self._entries.pop(entry.key, None)
            for name, value in list(self._engines.items()):
                if value is entry:
                    del self._engines[name]
            _close_and_stop(entry, close_timeout)

    def close_all(self, *, close_timeout: float = 60.0) -> None:
        """Close every open cache, whatever its users; idempotent (run at interpreter exit)."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._engines.clear()
            for entry in entries:
                entry.refs = 0
                _close_and_stop(entry, close_timeout)

    def publish(self, engine_id: str, rank: int, entry: SharedCache) -> None:
        """Record that the worker of `engine_id`, rank `rank`, uses `entry` in this process."""
        with self._lock:
            self._engines[(engine_id, rank)] = entry

    def find(self, engine_id: str, rank: int) -> SharedCache | None:
        """Return the cache the worker of `engine_id`, rank `rank`, uses in this process."""
        with self._lock:
            return self._engines.get((engine_id, rank))


class Lease:
    """One user's use of a `SharedCache`, released once: by `release` or with its owner.

    An engine may drop an adapter without closing it (SGLang closes a storage backend on
    detach, at best effort, and otherwise relies on garbage collection). When `owner` is
    collected, the use is released on a short-lived thread of its own: the collector may
    run in any thread, the cache's loop thread or one holding the registry's lock included,
    and releasing there would wait on itself.

    Args:
        owner: the adapter object whose collection ends the use.
        entry: the acquired cache.
        registry: the registry `entry` came from.
    """

    def __init__(self, owner: object, entry: SharedCache, registry: CacheRegistry) -> None:
        self.entry = entry
        self._registry = registry
        self._finalizer = weakref.finalize(owner, _release_later, registry, entry)
        self._finalizer.atexit = False  # an exiting process keeps its old behaviour

    def release(self) -> None:
        """Release the use now, in this thread; a second call (or a racing one) is a no-op."""
        # NOTE: `detach` hands the finalizer's arguments to one caller only.
        if self._finalizer.detach() is not None:
            self._registry.release(self.entry)


def _release_later(registry: CacheRegistry, entry: SharedCache) -> None:
    threading.Thread(
        target=registry.release, args=(entry,), name="kvtiers-release", daemon=True
    ).start()


def config_identity(source: str | Mapping[str, Any]) -> Hashable:
    """Return a key that is equal for two spellings of one kvtiers config."""
    if isinstance(source, str | os.PathLike):
        return ("path", str(Path(source).expanduser().resolve()))
    return ("inline", json.dumps(source, sort_keys=True, default=str))


def _close_and_stop(entry: SharedCache, close_timeout: float) -> None:
    """Close `entry`'s cache on its loop (logged if that fails), then stop the loop."""
    try:
        if entry.loop.alive:
            entry.loop.run(_close(entry), close_timeout)
    except Exception:
        logger.exception("kvtiers: closing the cache failed")
    finally:
        entry.loop.stop()


async def _close(entry: SharedCache) -> None:
    for extra in list(entry.extras.values()):
        closer = getattr(extra, "aclose", None)
        if closer is not None:
            try:
                await closer()
            except Exception:
                logger.exception("kvtiers: closing %r failed", extra)
    entry.extras.clear()
    await entry.cache.close()


#: The process's registry; see the module docstring for why it is process-level.
CACHES = CacheRegistry()
