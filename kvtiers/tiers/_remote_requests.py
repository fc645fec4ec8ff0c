"""The remote tier's request rules: slots, timeouts, retries with backoff, the breaker.

`RequestRunner` runs each filesystem call `ObjectStore` builds. Every request:

- waits for one of `max_in_flight` slots;
- may take `timeout` seconds; once started it runs to its end (or its timeout) even if the
  caller is cancelled, so the caller's accounting can match the store (`on_success`);
- is retried `retries` times with exponential backoff and jitter when it fails (a missing
  object, `FileNotFoundError`, is an answer, not a failure; `PermissionError` is not
  retried);
- is refused at once, `StoreUnavailable`, while the circuit breaker is open.

The breaker itself is in `_remote_breaker`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvtiers.tiers._cancellation import wait_out
from kvtiers.tiers._remote_breaker import (
    BreakerState,
    CircuitBreaker,
    IOCounters,
    StoreFull,
    StoreUnavailable,
)
from kvtiers.tiers._remote_options import RemoteOptions

__all__ = ["RequestRunner"]

logger = logging.getLogger("kvtiers")

_T = TypeVar("_T")
_BACKOFF_BASE = 0.1  # seconds before the first retry; doubled for each further one
_BACKOFF_CAP = 2.0
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})  # answers, not failures: never retried
# Errors that are bugs (ours or a backend's), never a store being unreachable.
_BUGS = (TypeError, AttributeError, NotImplementedError, AssertionError)


class StoreClosed(StoreUnavailable):
    """The store was closed while a request waited for it (never retried)."""


class RequestRunner:
    """Run one store's filesystem calls under the slot, timeout, retry and breaker rules.

    Args:
        options: the tier's options (limits, retries, breaker settings).
        url: the store, for messages (without credentials).
        name: the tier's name, for logs.
        describe: returns an exception as one short line with every secret redacted.
    """

    def __init__(
        self,
        options: RemoteOptions,
        url: str,
        name: str,
        describe: Callable[[BaseException], str],
    ) -> None:
        self.options, self.url, self.name, self.describe = options, url, name, describe
        self.breaker = CircuitBreaker(options.breaker_failures, options.breaker_cooldown)
        self.counters = IOCounters()
        self._slots = asyncio.Semaphore(options.max_in_flight)

    async def run(
        self,
        call: Callable[[], Awaitable[Any]],
        *,
        on_success: Callable[[], None] | None = None,
        max_retries: int | None = None,
        answer: Callable[[BaseException], bool] | None = None,
    ) -> Any:
        """Run `call` (it starts one attempt) until it succeeds or the request gives up.

        `FileNotFoundError`, and errors for which `answer` is true, are the store's answer:
        they reach the caller as they are, and count as the store being reachable.
        `on_success` runs once the call succeeded, also if the caller was cancelled;
        `max_retries` replaces the configured number of retries.

        Raises:
            StoreFull: the store refused a write for lack of space (never retried).
            StoreUnavailable: the breaker refused it, or it failed after its retries.
        """
        retries = self.options.retries if max_retries is None else max_retries
        attempt = 0
        while True:
            if not self.breaker.allow():
                self.counters.refused += 1
                raise StoreUnavailable(f"{self.url}: unavailable (circuit breaker open)")
            try:
                async with self._slots:
                    self.counters.requests += 1
                    result = await self._attempt(call, on_success)
            except (asyncio.CancelledError, StoreClosed, *_BUGS):
                self.breaker.abandon()
                raise
            except Exception as exc:
                if isinstance(exc, FileNotFoundError) or (answer is not None and answer(exc)):
                    self._succeeded()
                    raise
                self._end_unless_retried(exc, last=attempt >= retries)
                attempt += 1
                self.counters.retries += 1
                delay = min(_BACKOFF_CAP, _BACKOFF_BASE * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
            else:
                self._succeeded()
                return result

    def _end_unless_retried(self, exc: Exception, *, last: bool) -> None:
        """Raise what a request that failed with `exc` ends with; return to retry it."""
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            self._succeeded()  # an answer: the store is reachable, only full
            self.counters.full += 1
            raise StoreFull(f"{self.url}: {self.describe(exc)}") from None
        self._failed(exc)
        if (
            last
            or isinstance(exc, PermissionError)
            or self.breaker.state is not BreakerState.CLOSED
        ):
            raise StoreUnavailable(
                f"{self.url}: {self.describe(exc)}", timed_out=isinstance(exc, TimeoutError)
            ) from None

    async def _attempt(
        self, call: Callable[[], Awaitable[_T]], on_success: Callable[[], None] | None
    ) -> _T:
        fut = asyncio.ensure_future(call())
        timeout = self.options.timeout
        try:
            # NOTE: asyncio.wait does not cancel `fut` when this task is cancelled.
            done, _ = await asyncio.wait({fut}, timeout=timeout)
        except asyncio.CancelledError:
            # Started: let it end (within its timeout) so that its effect is accounted.
            await wait_out({fut}, timeout)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._succeeded()
                if on_success is not None:
                    on_success()
            else:
                fut.cancel()
            raise
        if not done:
            fut.cancel()
            self.counters.timeouts += 1
            raise TimeoutError(f"no answer within {timeout:g} s")
        if fut.cancelled():
            # NOTE: the store closed under the request (its thread pool drops queued calls);
            # the caller was not cancelled, so it gets an unavailable store, not a cancel.
            raise StoreClosed(f"{self.url}: closed")
        result = fut.result()
        if on_success is not None:
            on_success()
        return result

    def _succeeded(self) -> None:
        if self.breaker.success():
            logger.info("kvtiers: remote tier %r: %s is reachable again", self.name, self.url)

    def _failed(self, exc: BaseException) -> None:
        self.counters.failures += 1
        if self.breaker.failure():
            logger.warning(
                "kvtiers: remote tier %r: %s failed %d times in a row (%s); serving misses "
                "and dropping writes, probing again every %g s",
                self.name,
                self.url,
                self.breaker.consecutive,
                self.describe(exc),
                self.breaker.cooldown,
            )
        else:
            logger.debug("kvtiers: remote tier %r: %s", self.name, self.describe(exc))
