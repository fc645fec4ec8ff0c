"""The redis tier's requests on one layout's keys: pipelines and scripts, no accounting.

Each method is one round trip to the server. Those that touch the recency set return its
size as the server answered it (the tier's usage), or `None` when the request did not ask;
reads that touch also say how many of the chunks read were cold (`Touched`).
Errors propagate to the caller, which runs every request behind the tier's `StoreGuard`.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvtiers.core.keys import ChunkKey
from kvtiers.tiers._redis_answers import read_answers
from kvtiers.tiers._redis_layers import LayerRanges, Ranged
from kvtiers.tiers._redis_scripts import COLD_SHIFT, PUT_SCRIPT, TOUCH_SCRIPT
from kvtiers.tiers._remote_layers import LayerPlan

__all__ = ["RedisRequests", "Touched", "Written"]


class Written(NamedTuple):
    """What a write's script call answered."""

    held: list[bool]
    """Per key, whether the chunk is held after the call (written now, or before)."""
    new: list[ChunkKey]
    """The keys written by this call."""
    entries: int
    """The recency set's size after the call."""
    evicted: list[ChunkKey]
    """The chunks the call evicted (for room, or past their ttl)."""


class Touched(NamedTuple):
    """What a read's touch of the recency set answered."""

    entries: int
    """The recency set's size: every chunk of the layout, of every process."""
    were_cold: int
    """Chunks read that were cold (written cold, not read since) until this touch."""


class RedisRequests:
    """Requests on the keys of one namespace (`<prefix>:<layout fingerprint hex>`).

    Args:
        namespace: the first part of every key of the layout.
        ttl_ms: a chunk's time to live in milliseconds after its last write or read (0: none).
        ranges: plans and splits the ranged reads of layer-wise loads.
    """

    def __init__(self, namespace: str, ttl_ms: int, ranges: LayerRanges) -> None:
        self.lru = f"{namespace}:lru".encode()
        """The recency set: every chunk's name, scored by its last write or read."""
        self.chunk_prefix = f"{namespace}:c:".encode()
        self.ttl_ms = ttl_ms
        self._ranges = ranges
        self.client: aioredis.Redis | None = None
        """The connection pool, set while the tier is open."""

    @property
    def redis(self) -> aioredis.Redis:
        assert self.client is not None  # NOTE: set by the tier's _open; callers check the state
        return self.client

    def name(self, key: ChunkKey) -> bytes:
        """Return the server's key of chunk `key`."""
        return self.chunk_prefix + key

    def _touch(self, pipe: Any, names: Sequence[bytes]) -> None:
        """Queue the recency update of `names` (it answers a `Touched`'s two numbers)."""
        pipe.eval(TOUCH_SCRIPT, len(names) + 1, self.lru, *names, repr(time.time()))

    async def max_value_bytes(self) -> int | None:
        """Return the server's `proto-max-bulk-len`; `None` where it does not say.

        Best effort: servers that refuse CONFIG (managed services, ACLs) say nothing.
        """
        try:
            answer: dict[Any, Any] = await self.redis.config_get("proto-max-bulk-len")
            return int(answer["proto-max-bulk-len"])
        except (RedisError, OSError, KeyError, TypeError, ValueError):
            return None

    async def count(self) -> int:
        """Return the recency set's size."""
        return int(await self.redis.zcard(self.lru))

    async def exists(self, keys: Sequence[ChunkKey]) -> tuple[list[bool], int]:
        """Return which chunks have a value, and the recency set's size."""
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.name(key))
        pipe.zcard(self.lru)
        *found, count = await pipe.execute()
        return [bool(n) for n in found], int(count)

    async def read(
        self, keys: Sequence[ChunkKey], touch: bool
    ) -> tuple[list[bytes | None], Touched | None]:
        """Read the values of `keys` (`None`: none) and, when `touch`, touch them."""
        names = [self.name(key) for key in keys]
        pipe = self.redis.pipeline(transaction=False)
        ttl_ms = self.ttl_ms if touch else 0
        for name in names:
            if ttl_ms:
                pipe.getex(name, px=ttl_ms)
            else:
                pipe.get(name)
        if touch:  # not for a later wave of a layer-wise load: the first touched them
            self._touch(pipe, names)
        values, rest = read_answers(await pipe.execute(raise_on_error=False), len(names))
        return values, _touched(rest) if touch else None

    async def read_ranges(
        self, keys: Sequence[ChunkKey], plan: LayerPlan, touch: bool
    ) -> tuple[list[Ranged], Touched | None]:
        """Read the ranges of each key's value (empty for a missing value); touch if asked."""
        names = [self.name(key) for key in keys]
        pipe = self.redis.pipeline(transaction=False)
        planned = self._ranges.queue(pipe, names, keys, plan)
        num_reads = len(pipe)
        if touch:
            self._touch(pipe, names)
            for name in names if self.ttl_ms else ():
                pipe.pexpire(name, self.ttl_ms)  # a GET refreshes it with GETEX
        reads, rest = read_answers(await pipe.execute(raise_on_error=False), num_reads)
        return self._ranges.split(reads, plan, planned), _touched(rest) if touch else None

    async def write(
        self,
        keys: Sequence[ChunkKey],
        values: Sequence[bytes],
        max_entries: int,
        cold: Collection[bytes] = (),
    ) -> Written:
        """Store values with one script call (`_redis_scripts.PUT_SCRIPT`).

        The new chunks among `cold` go first in line for eviction.
        """
        names = [self.name(key) for key in keys]
        now = time.time()
        flags = "".join("1" if key in cold else "0" for key in keys)
        argv = (repr(now), max_entries, self.ttl_ms, repr(now - COLD_SHIFT), flags)
        out = await self.redis.eval(PUT_SCRIPT, len(names) + 1, self.lru, *names, *argv, *values)
        codes = [int(x) for x in out[: len(keys)]]
        evicted = [ChunkKey(bytes(n)[len(self.chunk_prefix) :]) for n in out[len(keys) + 1 :]]
        new = [key for key, code in zip(keys, codes, strict=True) if code == 2]
        return Written([code > 0 for code in codes], new, int(out[len(keys)]), evicted)

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Delete the chunks' values and recency entries; return the recency set's size."""
        names = [self.name(key) for key in keys]
        pipe = self.redis.pipeline(transaction=True)
        pipe.unlink(*names)
        pipe.zrem(self.lru, *names)
        pipe.zcard(self.lru)
        *_, count = await pipe.execute()
        return int(count)


def _touched(rest: Sequence[Any]) -> Touched | None:
    """Return what a touch answered; `None` if it was refused."""
    return None if rest[0] is None else Touched(int(rest[0][0]), int(rest[0][1]))
