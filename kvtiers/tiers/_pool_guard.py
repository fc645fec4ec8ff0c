"""Requests of a pool tier (redis, mooncake): bounded, timed out, behind a circuit breaker.

The pool tiers reuse the remote tier's `CircuitBreaker` and `IOCounters`: after
`breaker_failures` failed requests in a row every request is refused at once (a miss for
the caller) until a probe after `breaker_cooldown` seconds succeeds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from kvtiers.core.errors import InvalidInputError
from kvtiers.core.keys import KEY_BYTES, ChunkKey
from kvtiers.tiers._remote_breaker import CircuitBreaker, IOCounters, StoreUnavailable
from kvtiers.tiers._remote_options import Redactor

__all__ = ["StoreGuard", "StoreUnavailable", "check_keys"]

logger = logging.getLogger("kvtiers")

_T = TypeVar("_T")


class StoreGuard:
    """Run a tier's requests to its store under a slot limit, a timeout and a breaker.

    Args:
        label: the tier, for logs (`"redis tier 'pool'"`).
        where: the store, for logs (an address without credentials).
        timeout: seconds one request may take; `None` where the request times itself.
        slots: requests in flight at once.
        breaker: the circuit breaker.
        errors: exception types that mean the store failed; others propagate.
        timeouts: of those, the types that mean a request timed out (counted apart).
        redact: scrubs credentials from logged error text.
    """

    def __init__(
        self,
        label: str,
        where: str,
        *,
        timeout: float | None,
        slots: int,
        breaker: CircuitBreaker,
        errors: tuple[type[BaseException], ...],
        timeouts: tuple[type[BaseException], ...] = (),
        redact: Redactor | None = None,
    ) -> None:
        self.label, self.where, self.timeout = label, where, timeout
        self.breaker = breaker
        self.counters = IOCounters()
        self._errors: tuple[type[BaseException], ...] = (*errors, TimeoutError)
        self._timeouts: tuple[type[BaseException], ...] = (*timeouts, TimeoutError)
        self._slots = asyncio.Semaphore(slots)
        self._redact = redact or Redactor({})

    @property
    def available(self) -> bool:
        """Whether a request would be tried now (the breaker is not refusing)."""
        return self.breaker.would_allow()

    def refuses(self) -> bool:
        """Return whether the breaker refuses requests now (counted as one refusal)."""
        if self.breaker.would_allow():
            return False
        self.counters.refused += 1
        return True

    async def call(self, request: Callable[[], Awaitable[_T]]) -> _T:
        """Run one request; translate the store's failures.

        Raises:
            StoreUnavailable: the breaker refused it, or it failed or timed out.
        """
        async with self._slots:
            if not self.breaker.allow():
                self.counters.refused += 1
                raise StoreUnavailable(f"{self.where}: unavailable (circuit breaker open)")
            self.counters.requests += 1
            try:
                async with asyncio.timeout(self.timeout):
                    result = await request()
            except asyncio.CancelledError:
                self.breaker.abandon()
                raise
            except self._errors as exc:
                self._failed(exc)
                raise StoreUnavailable(f"{self.where}: {self.describe(exc)}") from exc
            except BaseException:
                self.breaker.abandon()
                raise
        if self.breaker.success():
            logger.info("kvtiers: %s: %s is reachable again", self.label, self.where)
        return result

    def describe(self, exc: BaseException) -> str:
        """Return `exc` as text without credentials."""
        return self._redact(f"{type(exc).__name__}: {exc}")

    def _failed(self, exc: BaseException) -> None:
        self.counters.failures += 1
        self.counters.timeouts += isinstance(exc, self._timeouts)
        if self.breaker.failure():
            logger.warning(
                "kvtiers: %s: %s failed %d times in a row (%s); serving misses for %.1f s",
                self.label,
                self.where,
                self.breaker.consecutive,
                self.describe(exc),
                self.breaker.cooldown,
            )
        else:
            logger.debug("kvtiers: %s: %s", self.label, self.describe(exc))


def check_keys(keys: Sequence[ChunkKey]) -> None:
    """Raise `InvalidInputError` for the first key that is not a chunk key."""
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidInputError(f"keys[{i}]: expected a {KEY_BYTES}-byte key, got {key!r:.60}")
