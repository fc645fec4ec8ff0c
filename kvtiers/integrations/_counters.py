"""Named counters that an adapter's threads add to and its reporter takes."""

from __future__ import annotations

import threading
from collections.abc import Collection

__all__ = ["Counters"]


class Counters:
    """Thread-safe running counts, handed out and reset by `take`.

    An engine calls an adapter from several threads (vLLM's engine core and its
    connector's loop, SGLang's prefetch and backup threads), so every add takes a lock.

    Args:
        names: the counters that may be added to (`None`: any); those the reporter
            exports, so that a misspelt name fails where it is counted.
    """

    __slots__ = ("_lock", "_names", "_values")

    def __init__(self, names: Collection[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._names = None if names is None else frozenset(names)
        self._values: dict[str, float] = {}

    def add(self, name: str, amount: float = 1) -> None:
        """Add `amount` to counter `name` (created at 0).

        Raises:
            KeyError: `name` is not one of the counters' `names`.
        """
        if self._names is not None and name not in self._names:
            raise KeyError(f"no counter named {name!r}")
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def take(self) -> dict[str, float]:
        """Return the non-zero counters since the last call, and reset them all."""
        with self._lock:
            values, self._values = self._values, {}
        return {name: value for name, value in values.items() if value}
