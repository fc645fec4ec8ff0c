"""The remote tier's circuit breaker, its request counters, and a careful gather.

The breaker opens after `breaker_failures` consecutive failed requests. After
`breaker_cooldown` seconds one request goes through as a probe (half-open): its success
closes the breaker, its failure opens it for another cool-down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from kvtiers.core.stats import StoreHealth

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "IOCounters",
    "StoreFull",
    "StoreUnavailable",
    "gather_all",
    "health_of",
]

_T = TypeVar("_T")


async def gather_all(aws: Iterable[Awaitable[_T]]) -> list[_T]:
    """Await `aws` concurrently; return or raise only once every one of them has ended.

    Unlike a plain `asyncio.gather`, a cancellation (or a first error) does not return while
    other awaitables still run: a started request is finished, and its effect accounted,
    before the caller goes on (and perhaps reuses its buffers).

    Raises:
        BaseException: the first error among them, after all ended.
    """
    results = await asyncio.gather(*aws, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]  # no exceptions left


class StoreUnavailable(Exception):
    """A request was refused by the open breaker, or failed after its retries.

    Args:
        message: what failed, without credentials.
        timed_out: the last attempt got no answer in time.
    """

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class StoreFull(StoreUnavailable):
    """The store refused a write for lack of space (ENOSPC, EDQUOT): reachable, but full."""


class BreakerState(enum.Enum):
    """States of the circuit breaker."""

    CLOSED = 1  # requests go through
    OPEN = 2  # requests are refused until the cool-down ends
    HALF_OPEN = 3  # one probe request is allowed; the rest are refused


class CircuitBreaker:
    """Refuse requests while the store is failing; let one probe through after a cool-down.

    Args:
        failures: consecutive failures that open it.
        cooldown: seconds it stays open.
        clock: monotonic seconds (injected for tests).
    """

    def __init__(
        self, failures: int, cooldown: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failures, self.cooldown, self._clock = failures, cooldown, clock
        self.state = BreakerState.CLOSED
        self.consecutive = 0  # failures since the last success
        self.opened = 0  # times it opened
        self._opened_at = 0.0
        self._probing = False

    def allow(self) -> bool:
        """Return whether a request may go now; the first after a cool-down is the probe."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if self._clock() < self._opened_at + self.cooldown:
                return False
            self.state = BreakerState.HALF_OPEN
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> bool:
        """Record a request that reached the store; return whether this closed the breaker."""
        was_open = self.state is not BreakerState.CLOSED
        self.state, self.consecutive, self._probing = BreakerState.CLOSED, 0, False
        return was_open

    def failure(self) -> bool:
        """Record a failed request; return whether this opened the breaker."""
        self.consecutive += 1
        probe_failed = self.state is BreakerState.HALF_OPEN and self._probing
        if self.state is BreakerState.CLOSED and self.consecutive < self.failures:
            return False
        first = self.state is BreakerState.CLOSED
        if first or probe_failed:
            self.state, self._opened_at, self._probing = BreakerState.OPEN, self._clock(), False
            self.opened += first
        return first

    def would_allow(self) -> bool:
        """Return whether `allow` would let a request go now, without taking the probe."""
        if self.state is BreakerState.OPEN:
            return self._clock() >= self._opened_at + self.cooldown
        return self.state is BreakerState.CLOSED or not self._probing

    def abandon(self) -> None:
        """Forget a probe whose outcome is unknown (cancelled), so another may probe."""
        if self.state is BreakerState.HALF_OPEN:
            self._probing = False


@dataclass(slots=True)
class IOCounters:
    """What the requests to the store went through (mutable)."""

    requests: int = 0
    """Requests started (each retry counts)."""
    retries: int = 0
    """Requests repeated after a failure."""
    failures: int = 0
    """Requests that failed (timeouts included)."""
    timeouts: int = 0
    """Requests that took longer than `timeout`."""
    refused: int = 0
    """Requests refused at once because the breaker was open."""
    dropped_writes: int = 0
    """Chunks `put` dropped because the store was unavailable."""
    full: int = 0
    """Writes the store refused for lack of space (not retried; the breaker stays closed)."""


def health_of(breaker: CircuitBreaker, counters: IOCounters) -> StoreHealth:
    """Return what `Tier.store_health` reports for a store behind `breaker`."""
    return StoreHealth(breaker.state.name.lower(), dataclasses.asdict(counters))
