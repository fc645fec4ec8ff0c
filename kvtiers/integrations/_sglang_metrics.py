"""SGLang's storage metrics of the kvtiers backend: pages and bandwidth per call.

Imports no SGLang module: `TransferMetrics.take` fills the `StorageMetrics` it is given.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["TransferMetrics"]


class TransferMetrics:
    """Pages and bandwidth of each prefetch and backup call, until SGLang takes them."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        # NOTE: the backup and prefetch threads record while the scheduler takes the
        # metrics (`get_stats`); without the lock a record between the copy and the clear
        # is lost, and a call's pages and bandwidth can land in different snapshots.
        self._lock = threading.Lock()

    def record(self, write: bool, num_pages: int, seconds: float, chunk_bytes: int) -> None:
        """Record one call: `num_pages` pages of `chunk_bytes` moved in `seconds`."""
        kind = "backup" if write else "prefetch"
        gb = num_pages * chunk_bytes / 1e9
        with self._lock:
            self._values[f"{kind}_pgs"].append(num_pages)
            self._values[f"{kind}_bandwidth"].append(gb / seconds if seconds > 0 else 0.0)

    def take(self, into: Any) -> Any:
        """Move every record since the last take into `into` (a `StorageMetrics`)."""
        with self._lock:
            for name, values in self._values.items():
                getattr(into, name).extend(values)
                values.clear()
        return into
