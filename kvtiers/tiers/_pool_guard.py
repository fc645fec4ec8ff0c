"""Requests of a pool tier (redis, mooncake): bounded, timed out, behind a circuit breaker.

The pool tiers reuse the remote tier's `CircuitBreaker` and `IOCounters`: after
`breaker_failures` failed requests in a row every request is refused at once (a miss for
the caller) until a probe after `breaker_cooldown` seconds succeeds.

Beside the guard, the parts of a batch both pool tiers share: key checks, the plan of a
`put`, the tally of a `get`, and the stored form of their values.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierCounters
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers._integrity import auth_key_from_config
from kvtiers.tiers._remote_breaker import CircuitBreaker, IOCounters, StoreUnavailable
from kvtiers.tiers._remote_options import Redactor
from kvtiers.tiers.base import Buffer, check_keys

__all__ = [
    "FullEpisodes",
    "InFlight",
    "PutPlan",
    "StoreGuard",
    "StoreUnavailable",
    "StoredValues",
    "check_keys",
    "plan_put",
    "tally_reads",
]

logger = logging.getLogger("kvtiers")

_T = TypeVar("_T")

_REWARN_FULL = 300.0  # seconds between two warnings that a pool is full


class InFlight:
    """The calls of a tier running now, so that closing it waits for them.

    A call that goes on after its tier closed would use a closed client (and, for redis,
    give a connection back to a closed pool, where it stays open).
    """

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Count one call in flight until the block ends."""
        self._count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._count -= 1
            if not self._count:
                self._idle.set()

    async def ended(self) -> None:
        """Return once no call is in flight."""
        await self._idle.wait()


class FullEpisodes:
    """Writes a pool refused for lack of room: counted, and warned of once per episode.

    A full pool answers; it is not failing, so the breaker stays closed and reads go on.
    An episode ends with the next write the pool takes.

    Args:
        guard: the tier's guard, whose `counters.full` counts the refused chunks.
        what: the tier, as messages name it (`"redis tier 'pool'"`).
    """

    def __init__(self, guard: StoreGuard, what: str) -> None:
        self._guard, self._what = guard, what
        self.active = False
        self._warned_at = -math.inf

    def refused(self, num_chunks: int, why: str) -> None:
        """Count `num_chunks` refused; warn, saying `why`, if an episode starts."""
        self._guard.counters.full += num_chunks
        now = time.monotonic()
        if not self.active and now - self._warned_at >= _REWARN_FULL:
            self._warned_at = now
            logger.warning(
                "kvtiers: %s: %s; writes are declined until it has room", self._what, why
            )
        self.active = True

    def took(self) -> None:
        """Note a write the pool took: the episode, if any, ends."""
        if self.active:
            self.active = False
            logger.debug("kvtiers: %s: the pool takes writes again", self._what)

    def note(self, num_refused: int, num_took: int, why: str) -> None:
        """Note what one call's writes got: refusals (saying `why`), else any it took."""
        if num_refused:
            self.refused(num_refused, why)
        elif num_took:
            self.took()


class StoreGuard:
    """Run a tier's requests to its store under a slot limit, a timeout and a breaker.

    Args:
        label: the tier, for logs (`"redis tier 'pool'"`).
        where: the store, for logs (an address without credentials).
        timeout: seconds one request may take; `None` where the request times itself.
        slots: requests in flight at once.
        breaker: the circuit breaker.
        errors: exception types that mean the store failed; others propagate.
        timeouts: of those, the types that mean a request timed out (counted apart).
        redact: scrubs credentials from logged error text.
    """

    def __init__(
        self,
        label: str,
        where: str,
        *,
        timeout: float | None,
        slots: int,
        breaker: CircuitBreaker,
        errors: tuple[type[BaseException], ...],
        timeouts: tuple[type[BaseException], ...] = (),
        redact: Redactor | None = None,
    ) -> None:
        self.label, self.where, self.timeout = label, where, timeout
        self.breaker = breaker
        self.counters = IOCounters()
        self._errors: tuple[type[BaseException], ...] = (*errors, TimeoutError)
        self._timeouts: tuple[type[BaseException], ...] = (*timeouts, TimeoutError)
        self._slots = asyncio.Semaphore(slots)
        self._redact = redact or Redactor({})

    @property
    def available(self) -> bool:
        """Whether a request would be tried now (the breaker is not refusing)."""
        return self.breaker.would_allow()

    def refuses(self) -> bool:
        """Return whether the breaker refuses requests now (counted as one refusal)."""
        if self.breaker.would_allow():
            return False
        self.counters.refused += 1
        return True

    async def call(self, request: Callable[[], Awaitable[_T]]) -> _T:
        """Run one request; translate the store's failures.

        Raises:
            StoreUnavailable: the breaker refused it, or it failed or timed out.
        """
        async with self._slots:
            if not self.breaker.allow():
                self.counters.refused += 1
                raise StoreUnavailable(f"{self.where}: unavailable (circuit breaker open)")
            self.counters.requests += 1
            try:
                async with asyncio.timeout(self.timeout):
                    result = await request()
            except asyncio.CancelledError:
                self.breaker.abandon()
                raise
            except self._errors as exc:
                self._failed(exc)
                raise StoreUnavailable(
                    f"{self.where}: {self.describe(exc)}",
                    timed_out=isinstance(exc, self._timeouts),
                ) from exc
            except BaseException:
                self.breaker.abandon()
                raise
        if self.breaker.success():
            logger.info("kvtiers: %s: %s is reachable again", self.label, self.where)
        return result

    def describe(self, exc: BaseException) -> str:
        """Return `exc` as text without credentials."""
        return self._redact(f"{type(exc).__name__}: {exc}")

    def _failed(self, exc: BaseException) -> None:
        self.counters.failures += 1
        self.counters.timeouts += isinstance(exc, self._timeouts)
        if self.breaker.failure():
            logger.warning(
                "kvtiers: %s: %s failed %d times in a row (%s); serving misses for %.1f s",
                self.label,
                self.where,
                self.breaker.consecutive,
                self.describe(exc),
                self.breaker.cooldown,
            )
        else:
            logger.debug("kvtiers: %s: %s", self.label, self.describe(exc))


@dataclass(frozen=True, slots=True)
class PutPlan:
    """A pool tier's `put` batch: each key once, its source, and whether it is held."""

    order: list[ChunkKey]
    """The batch's keys in order, a repeated key once (it is written once)."""
    sources: dict[ChunkKey, Buffer]
    """The buffer to store under each key."""
    held: dict[ChunkKey, bool]
    """Whether the tier holds each key; all `False` at first, set as it finds or writes them."""

    @property
    def num_declined(self) -> int:
        """How many of the batch's distinct keys the tier does not hold."""
        return len(self.order) - sum(self.held.values())

    def results(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Return, aligned with `keys`, whether the tier holds each one."""
        return [self.held[key] for key in keys]


def plan_put(keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> PutPlan:
    """Return the plan of a `put` of `srcs` under `keys`, nothing held yet.

    The caller has checked `keys` and `srcs`; a repeated key keeps its last source.
    """
    order = list(dict.fromkeys(keys))
    return PutPlan(order, dict(zip(keys, srcs, strict=True)), dict.fromkeys(order, False))


def tally_reads(
    counters: TierCounters,
    keys: Sequence[ChunkKey],
    found: Iterable[Sequence[fmt.Verdict | None]],
    chunk_bytes: int,
    *,
    tally: bool = True,
) -> tuple[list[bool], list[ChunkKey]]:
    """Count a `get` of `keys` in `counters`; return its hits and the keys read as bad.

    Args:
        counters: the tier's counters.
        keys: the keys read.
        found: the verdicts of each request's part of `keys`, in order; `None` where the
            store had no value.
        chunk_bytes: the payload bytes one hit read (a chunk's, or the layers read).
        tally: whether to count hits and misses (bad values and bytes are always counted).

    Returns:
        Whether each key was a hit, aligned with `keys`; and the keys whose values were
        bad (corrupt, foreign or forged), for the tier to delete.
    """
    verdicts = [verdict for part in found for verdict in part]
    hits = [verdict is fmt.Verdict.OK for verdict in verdicts]
    bad = [k for k, v in zip(keys, verdicts, strict=True) if v not in (None, fmt.Verdict.OK)]
    fmt.count_verdicts(counters, verdicts)
    if tally:
        counters.hits += sum(hits)
        counters.misses += len(keys) - sum(hits)
    counters.bytes_read += sum(hits) * chunk_bytes
    return hits, bad


class StoredValues:
    """The stored form of one pool tier's chunks: sizes, packing and checked reads.

    Shared by the tiers that keep whole values in a key-value store (redis, mooncake): the
    chunk format's header and checksum, and the integrity tag when the tier's options ask
    for one, so a value that is garbage, truncated, foreign or forged is a miss.

    Args:
        config: the tier's config (capacity, integrity options).
        layout: the layout of its chunks.
        layer_checksums: also write a checksum per layer, so that some layers of a value
            can be read and verified alone (`_chunk_format`).

    Raises:
        ConfigError: bad integrity options, or a capacity that cannot hold one value.
    """

    def __init__(self, config: TierConfig, layout: KVLayout, *, layer_checksums: bool = False):
        self.fingerprint = layout.fingerprint
        self.payload_len = layout.chunk_bytes
        self.auth_key = auth_key_from_config(config)
        self.num_layers = layout.num_layers if layer_checksums else 0
        """Layers with a checksum of their own in each value (0: none)."""
        self.header_len = fmt.header_bytes(
            self.fingerprint,
            layout.chunk_bytes,
            num_layers=self.num_layers,
            tagged=self.auth_key is not None,
        )
        """Bytes of one value's length prefix and header."""
        self.value_bytes = self.header_len + layout.chunk_bytes
        """Bytes of one stored value (header and payload)."""
        if config.capacity_bytes < self.value_bytes:
            raise ConfigError(
                f"{config.where}.capacity: capacity too small for one chunk; a stored chunk "
                f"takes {self.value_bytes} bytes (header and payload), got "
                f"{config.capacity_bytes}"
            )

    def pack(self, key: bytes, payload: Any) -> bytes:
        """Return the stored value of a contiguous payload under `key`."""
        return fmt.pack_value(
            self.fingerprint, key, payload, num_layers=self.num_layers, auth_key=self.auth_key
        )

    def read_into(self, key: bytes, raw: Any, dst: Buffer) -> fmt.Verdict:
        """Verify a value read under `key`; copy its payload into `dst` only when intact."""
        return fmt.check_into(
            raw,
            dst,
            fingerprint=self.fingerprint,
            key=key,
            payload_len=self.payload_len,
            auth_key=self.auth_key,
            num_layers=self.num_layers,
        )
