"""Named counters that an adapter's threads add to and its reporter takes."""

from __future__ import annotations

import threading

__all__ = ["Counters"]


class Counters:
    """Thread-safe running counts, handed out and reset by `take`.

    An engine calls an adapter from several threads (vLLM's engine core and its
    connector's loop, SGLang's prefetch and backup threads), so every add takes a lock.
    """

    __slots__ = ("_lock", "_values")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def add(self, name: str, amount: float = 1) -> None:
        """Add `amount` to counter `name` (created at 0)."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def take(self) -> dict[str, float]:
        """Return the non-zero counters since the last call, and reset them all."""
        with self._lock:
            values, self._values = self._values, {}
        return {name: value for name, value in values.items() if value}
