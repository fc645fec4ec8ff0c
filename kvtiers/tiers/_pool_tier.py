"""The base of the pool tiers (redis, mooncake): a tier over a shared key-value store.

Both pool tiers keep whole values in the chunk format (`StoredValues`), send every request
to their store through a `StoreGuard` (slots, a circuit breaker, errors translated), count
their calls in flight so that `close` waits for them, and count the writes a full pool
refuses (`FullEpisodes`). `PoolTier` owns those parts and what follows from them alike in
both: the store's health, `delete`, and a batched read with its tally. A subclass builds
its options, values and guard, implements the rest of the contract, and removes keys from
its store in `_remove`.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

from kvtiers.core.config import TierConfig
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import StoreHealth
from kvtiers.tiers._chunk_format import Verdict
from kvtiers.tiers._pool_guard import (
    FullEpisodes,
    InFlight,
    StoredValues,
    StoreGuard,
    StoreUnavailable,
    check_keys,
    tally_reads,
)
from kvtiers.tiers._remote_breaker import IOCounters, gather_all, health_of
from kvtiers.tiers.base import Buffer, Tier

__all__ = ["PoolTier", "ReadPart"]

_T = TypeVar("_T")
_F = TypeVar("_F")

ReadPart = Callable[[Sequence[ChunkKey], Sequence[Buffer]], Awaitable[list[Verdict | None]]]
"""Read one request's worth of keys into their buffers; a verdict per key, `None` if absent."""


class PoolTier(Tier):
    """A tier of chunks in a key-value store that many processes share.

    Args:
        config: the tier's config.
        layout: the KV layout of its chunks.
        values: the stored form of its chunks.
        guard: the guard of every request to the store.
        batch_bytes: bytes of values one request carries, at most (one value may be more).
    """

    shared = True
    manages_eviction = True

    def __init__(
        self,
        config: TierConfig,
        layout: KVLayout,
        *,
        values: StoredValues,
        guard: StoreGuard,
        batch_bytes: int,
    ) -> None:
        super().__init__(config, layout)
        self._values = values
        self._guard = guard
        self.value_bytes = values.value_bytes
        """Bytes of one stored value (header and payload)."""
        self.max_entries = self.capacity_bytes // self.value_bytes
        """Chunks the capacity holds."""
        self._per_call = max(1, batch_bytes // self.value_bytes)  # chunks per request
        self._in_flight = InFlight()  # `close` waits for them
        self._full = FullEpisodes(guard, guard.label)

    @property
    def io_counters(self) -> IOCounters:
        """What the requests to the store went through: failures, timeouts, refusals."""
        return self._guard.counters

    def store_health(self) -> StoreHealth:
        # docstring inherited
        return health_of(self._guard.breaker, self._guard.counters)

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Check that the tier is open; count the call in flight until it ends."""
        self._ensure_open()
        with self._in_flight.call():
            yield

    async def _guarded(self, call: Callable[[], Awaitable[_T]], failed: _F) -> _T | _F:
        """Return `call()`, run under the guard, or `failed` where the store cannot answer.

        A store not reachable, refused by the breaker or timed out is counted, never raised.
        """
        try:
            return await self._guard.call(call)
        except StoreUnavailable as exc:
            self.counters.fail(timed_out=exc.timed_out)
            return failed

    async def delete(self, keys: Sequence[ChunkKey]) -> None:
        # docstring inherited
        with self._running():
            check_keys(keys)
            if keys:
                await self._remove(keys)

    @abstractmethod
    async def _remove(self, keys: Sequence[ChunkKey]) -> None:
        """Remove `keys` from the store; a failure is counted, never raised."""

    async def _read_batches(
        self,
        keys: Sequence[ChunkKey],
        dsts: Sequence[Buffer],
        read: ReadPart,
        hit_bytes: int,
        *,
        tally: bool = True,
        reachable: bool = True,
    ) -> list[bool]:
        """Read `keys` a request's worth at a time with `read`; count, remove bad values.

        Args:
            keys: the keys to read.
            dsts: their destinations, aligned.
            read: reads one request's part (the parts run at once, under the guard's slots).
            hit_bytes: the payload bytes one hit reads (a chunk's, or the layers read).
            tally: whether to count hits and misses.
            reachable: `False` when the store cannot be asked (no client): all misses.

        Returns:
            Whether each key was a hit, aligned with `keys`.
        """
        if not keys:
            return []
        if not reachable or self._guard.refuses():
            self.counters.misses += len(keys) if tally else 0
            self.counters.unavailable += 1
            return [False] * len(keys)
        per_call = self._per_call
        found = await gather_all(
            read(keys[i : i + per_call], dsts[i : i + per_call])
            for i in range(0, len(keys), per_call)
        )
        hits, bad = tally_reads(self.counters, keys, found, hit_bytes, tally=tally)
        if bad:
            await self._remove(bad)
        return hits
