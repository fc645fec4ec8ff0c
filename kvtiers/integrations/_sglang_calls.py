"""How the SGLang backend runs SGLang's calls: never an exception into SGLang's threads.

SGLang calls storage backends synchronously from its prefetch and backup threads, where an
exception would end the thread for good. So each call runs its cache work on the cache's
loop under the backend's timeout, and anything that goes wrong (a tier down, a timeout, a
bad argument) gives the call's miss instead: `False`, `0`, `None`, an aligned list of
them. Each miss is counted by method, a bad argument also by the argument at fault, and
logged: the first of each kind (with its traceback, unless a bad argument), then one line
per hundred.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvtiers.integrations._runtime import SharedCache
from kvtiers.integrations._sglang_args import BadArgumentError

__all__ = ["Calls"]

_T = TypeVar("_T")


class Calls:
    """Runs the backend's calls; a failure of any kind is a miss, counted and logged.

    Args:
        logger: where the lines go.
        timeout: seconds one call's cache work may take.
    """

    def __init__(self, logger: logging.Logger, timeout: float) -> None:
        self._logger, self._timeout = logger, timeout
        self.failures: Counter[str] = Counter()
        """Calls that failed (served as misses), by method."""
        self.rejected: Counter[str] = Counter()
        """Calls refused for a bad argument (also in `failures`), by the argument at fault."""
        self._failed: Counter[str] = Counter()  # the other misses, by method (for the log)

    def miss(self, op: str, why: object) -> None:
        """Count and log one call of `op` served as a miss because of `why`."""
        self.failures[op] += 1
        if isinstance(why, BadArgumentError):
            self.rejected[why.reason] += 1
            count, what = self.rejected[why.reason], "refused a bad argument"
        else:
            self._failed[op] += 1
            count, what = self._failed[op], "failed"
        if count == 1 or count % 100 == 0:
            self._logger.warning(
                "kvtiers: %s %s (%d so far), served as a miss: %s",
                op,
                what,
                count,
                why,
                exc_info=count == 1 and isinstance(why, Exception) and what == "failed",
            )

    def guarded(self, op: str, default: _T, call: Callable[..., _T], *args: Any) -> _T:
        """Return `call(*args)`; a bad argument or any other failure gives `default`."""
        try:
            return call(*args)
        except Exception as exc:  # never an exception into SGLang's threads
            self.miss(op, exc)
            return default

    def run(self, op: str, make: Any, default: _T, entry: SharedCache | None) -> _T:
        """Run `make(cache)` on the loop of `entry`; a failure or timeout gives `default`."""
        if entry is None:
            self.miss(op, "no host pool registered yet")
            return default
        try:
            coro: Awaitable[_T] = make(entry.cache)
            return entry.loop.run(_within(coro, self._timeout), self._timeout + 5.0)
        except Exception as exc:
            self.miss(op, exc)
            return default


async def _within(op: Awaitable[_T], timeout: float) -> _T:
    # NOTE: wait_for cancels the operation and waits for it to unwind, so no tier is still
    # writing into a host page when the caller gives the page back to SGLang.
    return await asyncio.wait_for(op, timeout)
