"""Rate-limited warnings: a failing tier logs once per interval, with a count, not per call."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RateLimitedLog"]


@dataclass(slots=True)
class _Source:
    last: float  # when a line was last written for it
    suppressed: int = 0  # calls since then that wrote nothing


class RateLimitedLog:
    """Write at most one warning per source per `interval_s`, counting the rest.

    The first warning of a source carries its traceback; later ones say how many were
    suppressed since the previous line.

    Args:
        logger: where the lines go.
        interval_s: the least time between two lines of one source.
        clock: seconds, monotonic (injected for tests).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._sources: dict[str, _Source] = {}

    def warning(
        self, source: str, msg: str, *args: object, exc: BaseException | None = None
    ) -> bool:
        """Log `msg % args` for `source` unless it logged within the interval.

        Returns:
            Whether a line was written.
        """
        now = self._clock()
        state = self._sources.get(source)
        if state is not None and now - state.last < self._interval_s:
            state.suppressed += 1
            return False
        if state is None:
            self._logger.warning(msg, *args, exc_info=exc)
            self._sources[source] = _Source(now)
            return True
        self._logger.warning(
            msg + " (%d more since the last report %.0f s ago)",
            *args,
            state.suppressed,
            now - state.last,
        )
        state.last, state.suppressed = now, 0
        return True
