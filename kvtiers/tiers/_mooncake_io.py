"""The mooncake tier's calls to its synchronous client, and its registered staging memory.

`StoreCalls` runs the client's blocking calls in a bounded thread pool, each timed out; a
batched call whose every key failed raises `StoreFailed` (the store failed, not the keys).

The mooncake tier registers one staging buffer with its store and splits it into regions,
one per call in flight; a region holds `slots` stored values. A call takes a region, lets
the store fill it (a read) or packs values into it and lets the store send them (a write),
and gives it back. A call that ends while the store still uses its region (a timeout, a
cancellation: the store's call runs on in its thread) gives the region back only once the
store's call returns, so no later call reuses bytes the store is still writing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtiers.core.errors import ConfigError
from kvtiers.tiers._cancellation import wait_out
from kvtiers.tiers._pool_options import MooncakeOptions

__all__ = [
    "LOST",
    "NOT_FOUND",
    "NOT_READY",
    "NO_SPACE",
    "TOO_LARGE",
    "Region",
    "Staging",
    "StoreCalls",
    "StoreFailed",
    "client_classes",
    "setup_client",
]

NOT_FOUND = -704
"""The client's code for a key the store does not hold (OBJECT_NOT_FOUND)."""
LOST = -800
"""The client's code for a failed transfer; for a read, mostly an object lost with its segment."""
NOT_READY = -703
"""The client's code for a key whose value is still being written (REPLICA_IS_NOT_READY)."""
NO_SPACE = -200
"""The client's code for a write the pool has no room for (NO_AVAILABLE_HANDLE): its
segments are full (or smaller than the value), not failing."""
TOO_LARGE = -600
"""The client's code for invalid parameters; for a read, a value larger than its buffer."""


class Region:
    """One region of the staging buffer: `slots` slots of `slot_bytes` bytes."""

    def __init__(self, index: int, memory: npt.NDArray[np.uint8], slot_bytes: int) -> None:
        self.index = index
        self.memory = memory
        self.slot_bytes = slot_bytes
        self.busy: asyncio.Future[Any] | None = None
        """The store call still using the region, if any."""

    def slot(self, i: int) -> npt.NDArray[np.uint8]:
        """Return slot `i`."""
        return self.memory[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def address(self, i: int) -> int:
        """Return the address of slot `i`, for the store."""
        return int(self.memory.ctypes.data) + i * self.slot_bytes


class Staging:
    """A host buffer split into `regions` regions of `slots` slots of `slot_bytes` bytes.

    Args:
        regions: regions, i.e. calls in flight at once.
        slots: slots per region, i.e. values per call.
        slot_bytes: bytes per slot, i.e. the largest value.
    """

    def __init__(self, regions: int, slots: int, slot_bytes: int) -> None:
        self.region_bytes = slots * slot_bytes
        # NOTE: np.empty of this size is mmap'd by the allocator: page-aligned, untouched.
        self.memory = np.empty(regions * self.region_bytes, dtype=np.uint8)
        self._free: asyncio.Queue[Region] = asyncio.Queue()
        for i in range(regions):
            part = self.memory[i * self.region_bytes : (i + 1) * self.region_bytes]
            self._free.put_nowait(Region(i, part, slot_bytes))

    @property
    def address(self) -> int:
        """The buffer's address, for registering it with the store."""
        return int(self.memory.ctypes.data)

    @contextlib.asynccontextmanager
    async def region(self, timeout: float) -> AsyncIterator[Region]:
        """Hold a free region for the duration of the context (see the module doc).

        Raises:
            TimeoutError: no region came free within `timeout` seconds (the store's calls
                that hold them all hang).
        """
        region = await asyncio.wait_for(self._free.get(), timeout)
        try:
            yield region
        finally:
            busy, region.busy = region.busy, None
            if busy is None or busy.done():
                self._free.put_nowait(region)
            else:
                busy.add_done_callback(lambda _: self._free.put_nowait(region))


class StoreFailed(Exception):
    """A store call failed as a whole (every key), or could not be made."""


class StoreCalls:
    """Run a synchronous client's calls in a thread pool of `threads`, each timed out.

    Args:
        threads: threads, i.e. calls in flight at once.
        timeout: seconds one call may take.
        name: the threads' name prefix.
    """

    def __init__(self, threads: int, timeout: float, name: str) -> None:
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)

    async def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        region: Region | None = None,
        on_done: Callable[[Any], None] | None = None,
    ) -> Any:
        """Run `fn(*args)` in the pool, for at most `timeout` seconds.

        On a timeout the call runs on in its thread: `region` (if any) stays busy until it
        returns, and `on_done` (if any) sees its result then. On a cancellation the call is
        waited for (at most `timeout` seconds) before the cancellation goes on, so that the
        caller's accounting matches the store.

        Raises:
            TimeoutError: the call took longer than `timeout`.
        """
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        if region is not None:
            region.busy = fut
        if on_done is not None:
            fut.add_done_callback(lambda f: _report(f, on_done))
        try:
            done, _ = await asyncio.wait({fut}, timeout=self.timeout)
        except asyncio.CancelledError:
            await wait_out({fut}, self.timeout)
            raise
        if not done:
            raise TimeoutError(f"a store call took longer than {self.timeout:g} s")
        return fut.result()

    async def batch(
        self,
        fn: Callable[..., list[int]],
        *args: Any,
        region: Region | None = None,
        on_done: Callable[[Any], None] | None = None,
        answers: tuple[int, ...] = (NOT_FOUND, TOO_LARGE),
    ) -> list[int]:
        """Run a batched call that returns a code per key, as `run` does.

        Raises:
            StoreFailed: every key failed with a code that is not in `answers` (codes that
                answer about a key, not failures of the store).
            TimeoutError: the call took longer than `timeout`.
        """
        codes: list[int] = await self.run(fn, *args, region=region, on_done=on_done)
        if codes and all(code < 0 and code not in answers for code in codes):
            raise StoreFailed(f"every key failed (code {codes[0]})")
        return codes

    async def close(self) -> None:
        """Wait for the running calls and stop the threads."""
        await asyncio.to_thread(self._pool.shutdown, wait=True)


def _report(fut: asyncio.Future[Any], on_done: Callable[[Any], None]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        on_done(fut.result())


def setup_client(store: Any, options: MooncakeOptions, buffer_size: int, staging: Staging) -> None:
    """Connect `store` (a new client) to the master; register `staging` with it.

    Blocks (run it in a thread).

    Raises:
        StoreFailed: the client could not be set up.
    """
    code = store.setup(
        options.local_hostname,
        options.metadata,
        options.segment_size,
        buffer_size,
        options.protocol,
        "",  # RDMA devices: found by the engine
        options.master,
    )
    if code != 0:
        raise StoreFailed(f"setup failed with code {code}")
    code = store.register_buffer(staging.address, staging.memory.nbytes)
    if code != 0:
        store.close()
        raise StoreFailed(f"registering the staging buffer failed with code {code}")


def client_classes(where: str) -> tuple[Any, Any]:
    """Return the Mooncake client's store class and its replication-config class.

    Raises:
        ConfigError: the client is not installed (`where` names the tier's `kind`).
    """
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise ConfigError(
            f"{where}.kind: the mooncake tier needs the Mooncake client: pip install "
            f"'kvtiers[mooncake]', and on Debian apt-get install libibverbs1 ({exc})"
        ) from exc
    return MooncakeDistributedStore, ReplicateConfig


def bind_tcp(options: MooncakeOptions) -> None:
    """Make TCP transfers use `local_hostname` (an IP address), unless told otherwise.

    Without `MC_TCP_BIND_ADDRESS` the transfer engine binds the machine's outward interface,
    also when every process is on this machine.
    """
    try:
        ipaddress.ip_address(options.local_hostname)
    except ValueError:
        return
    if options.protocol == "tcp":
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", options.local_hostname)
