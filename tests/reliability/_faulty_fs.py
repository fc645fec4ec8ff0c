"""A fault-injecting fsspec filesystem: an in-memory store that is slow, fails, truncates, fills.

`faulty://<path>` behaves as `memory://` (one process-wide store), but each request may,
at the rates its `Faults` sets: sleep `delay` seconds first (a slow store), raise an
`OSError` like an HTTP 503 (a failing one), return a read cut short (a truncated body),
or refuse a write with `ENOSPC` once `quota_bytes` are stored (a full disk). Faults are
drawn from a seeded generator, so a run is repeatable up to thread timing; every fault
injected is counted in `Faults.injected`.
"""

from __future__ import annotations

import errno
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

PROTOCOL = "faulty"


@dataclass
class Faults:
    """What goes wrong, and how often; shared by every `FaultyFileSystem` of a test."""

    slow_rate: float = 0.0
    delay: float = 0.0
    error_rate: float = 0.0
    truncate_rate: float = 0.0
    quota_bytes: int | None = None
    """Bytes the store may hold before writes fail with ENOSPC; `None`: no limit."""
    seed: int = 0
    injected: Counter[str] = field(default_factory=Counter)
    _rng: random.Random = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def draw(self, rate: float, kind: str) -> bool:
        if rate <= 0:
            return False
        with self._lock:
            hit = self._rng.random() < rate
            if hit:
                self.injected[kind] += 1
        return hit

    def off(self) -> None:
        self.slow_rate = self.error_rate = self.truncate_rate = 0.0
        self.quota_bytes = None


ACTIVE = Faults()
"""The faults every `faulty://` filesystem applies now; tests replace or edit it."""


class FaultyFileSystem(MemoryFileSystem):
    """`memory://` with the faults of `ACTIVE` injected into every request."""

    protocol = PROTOCOL
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix(f"{PROTOCOL}://")
        return super()._strip_protocol(path)

    def _before(self) -> None:
        faults = ACTIVE
        if faults.draw(faults.slow_rate, "slow"):
            time.sleep(faults.delay)
        if faults.draw(faults.error_rate, "error"):
            raise OSError(errno.EIO, "503 Service Unavailable (injected)")

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> bytes:
        self._before()
        data: bytes = super().cat_file(path, start, end, **kw)
        if len(data) > 1 and ACTIVE.draw(ACTIVE.truncate_rate, "truncated"):
            return data[: len(data) // 2]
        return data

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kw: Any) -> None:
        self._before()
        quota = ACTIVE.quota_bytes
        if quota is not None and self.used_bytes() + len(value) > quota:
            with ACTIVE._lock:
                ACTIVE.injected["enospc"] += 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        super().pipe_file(path, value, mode=mode, **kw)

    def info(self, path: str, **kw: Any) -> dict[str, Any]:
        self._before()
        details: dict[str, Any] = super().info(path, **kw)
        return details

    def rm_file(self, path: str) -> None:
        self._before()
        super().rm_file(path)

    def find(self, path: str, *args: Any, **kw: Any) -> Any:
        self._before()
        return super().find(path, *args, **kw)

    def used_bytes(self) -> int:
        return sum(len(f.getbuffer()) for f in self.store.values())


def register() -> None:
    """Make `faulty://` URLs resolve to `FaultyFileSystem`."""
    fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
