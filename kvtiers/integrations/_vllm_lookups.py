"""The scheduler side's lookups: start one per request, wait a bounded time for its answer.

vLLM's scheduler asks `get_num_new_matched_tokens` step after step; a lookup still running
after `lookup_wait_ms` is answered 'ask again later' and taken at a later call, and one
running past `lookup_deadline_s` (or a request's hand-off wait) is a miss. A lookup that
fails is a miss too: logged and counted, never raised to vLLM.

vLLM objects are not imported here.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvtiers.core.index import LookupResult
from kvtiers.integrations._vllm_handoff import HandoffWaits
from kvtiers.integrations._vllm_plan import ConnectorSettings
from kvtiers.integrations._vllm_tracked import Salt, Tracked

__all__ = ["Lookup", "Lookups"]

logger = logging.getLogger("kvtiers.vllm")

Lookup = Callable[[npt.NDArray[np.int64], Salt], "concurrent.futures.Future[LookupResult]"]
"""Start a lookup of a token prefix; the future gives the cached length and its tiers."""


class Lookups:
    """Start each request's lookup and wait for its answer, briefly at each call.

    Args:
        settings: the connector settings (`lookup_wait_ms`, `lookup_deadline_s`).
        lookup: starts a lookup; resolved on first use (it may need the workers up).
        clock: monotonic seconds (the scheduler side's).
        handoffs: the scheduler side's hand-off waits (a waiting request's deadline).
        count: adds to one of the scheduler side's counters.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        lookup: Callable[[], Lookup],
        clock: Callable[[], float],
        handoffs: HandoffWaits,
        count: Callable[[str, int], None],
    ) -> None:
        self._settings = settings
        self._make_lookup = lookup
        self._lookup: Lookup | None = None
        self._clock = clock
        self._handoffs = handoffs
        self._count = count

    def await_hit(self, tracked: Tracked, limit: int) -> int | None:
        """Return the hit of `tracked`'s lookup, started if none runs; `None`: ask later.

        A lookup is of the first `limit` tokens; one that cannot start, fails or runs past
        its deadline is a miss (0).
        """
        future = tracked.future
        if future is None:
            future = self._start(tracked, limit)
            if future is None:
                return 0
        deadline = tracked.asked_at + self._settings.lookup_deadline_s
        wait_s = self._settings.lookup_wait_ms / 1000
        # NOTE: a request waiting for announced KV is looked up again step after step; its
        # lookups must not hold up vLLM's scheduler (their answers are taken at a later
        # call), nor outlast the wait (which then serves what earlier lookups found).
        handoff_end = self._handoffs.end(tracked)
        if handoff_end is not None:
            deadline, wait_s = min(deadline, handoff_end), 0
        hit = self._answer(tracked, future, deadline, wait_s, handoff_end is not None)
        if hit is None:
            return None
        tracked.future = None
        self._count("lookup_hit_tokens", hit)
        return hit

    def _start(
        self, tracked: Tracked, limit: int
    ) -> concurrent.futures.Future[LookupResult] | None:
        """Start the lookup of `tracked`'s first `limit` tokens; `None`: it failed."""
        try:
            if self._lookup is None:
                self._lookup = self._make_lookup()
            tracked.future = self._lookup(tracked.keyed(limit), tracked.salt)
        except Exception:
            logger.exception("kvtiers: starting a lookup failed; served as a miss")
            self._count("lookup_errors", 1)
            return None
        tracked.asked_at = self._clock()
        self._count("lookups", 1)
        self._count("lookup_tokens", limit)
        return tracked.future

    def _answer(
        self,
        tracked: Tracked,
        future: concurrent.futures.Future[LookupResult],
        deadline: float,
        wait_s: float,
        waiting: bool,
    ) -> int | None:
        """Wait up to `wait_s` for the lookup's hit; `None`: ask later, before `deadline`.

        `waiting` says the request waits for announced KV (its failed lookups are logged
        at debug level).
        """
        try:
            found = future.result(timeout=wait_s)
            hit, tracked.tiers = found.num_tokens, found.tiers
        except concurrent.futures.TimeoutError:
            if self._clock() < deadline:
                self._count("lookup_retries", 1)
                return None
            future.cancel()
            logger.warning(
                "kvtiers: a lookup ran for %.3gs; served as a miss",
                self._clock() - tracked.asked_at,
            )
            self._count("lookup_timeouts", 1)
            hit = 0
        except Exception as exc:
            # NOTE: a request waiting for announced KV looks up every poll; one warning
            # (its first lookup's) is enough, the rest are counted.
            log = logger.debug if waiting else logger.warning
            log("kvtiers: a lookup failed (%s); served as a miss", exc)
            self._count("lookup_errors", 1)
            hit = 0
        return hit
