"""The redis tier: chunks pooled in a Redis or Valkey server, shared by every process.

A chunk lives under `<prefix>:<layout fingerprint hex>:c:<key>` in the lmdb tier's format
(`_chunk_format`), so a value that is garbage, truncated, of another layout or written
behind kvtiers' back reads as a miss (deleted and counted), never as wrong KV.

The tier evicts by capacity itself (`manages_eviction`), least recently used over every
process: a sorted set `<prefix>:<fingerprint hex>:lru` holds each chunk key with the time
of its last write or read. A `put` runs one Lua script per batch (`_redis_scripts`), which
writes the values, records them, and evicts the oldest entries past the capacity,
atomically; a chunk that does not fit without evicting one of the batch's own chunks is
declined, and so is every deeper one. Chunks put cold (`put_hinted`: no reuse expected) are
scored to go before all others until read, and take room only from other cold ones. A `get`
is one pipeline: the GETs and a script that touches the hits. Since every value of a layout
has the same size, the set's cardinality is the usage. The server's own `maxmemory`
eviction may still drop values (a miss); the set then forgets them on the next write of the
key or by age.

Every request is a pipeline behind the breaker of `_pool_guard`: while the server fails,
calls return misses at once and `put` drops its chunks (counted); nothing raises. A server
out of memory (past `maxmemory` with a policy that does not evict, such as `noeviction`)
is not failing: its writes are declined and counted (`io_counters.full`), reads go on.
`close` waits for the calls in flight, so no connection is taken back after it.
Keys name other keys from inside scripts, so the tier needs a standalone server (or a
proxy that keeps one layout's keys on one shard), not Redis Cluster.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

import numpy as np

try:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import OutOfMemoryError, RedisError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # the registry shows this as the reason the kind is unavailable
    raise ImportError(
        f"the redis tier needs redis-py: pip install 'kvtiers[redis]' ({exc})"
    ) from exc

from kvtiers.core.config import TierConfig, format_size
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierUsage
from kvtiers.tiers._chunk_format import Verdict
from kvtiers.tiers._pool_guard import (
    StoredValues,
    StoreGuard,
    StoreUnavailable,
    check_keys,
    plan_put,
)
from kvtiers.tiers._pool_options import RedisOptions
from kvtiers.tiers._pool_tier import PoolTier
from kvtiers.tiers._redis_layers import LayerRanges
from kvtiers.tiers._redis_requests import RedisRequests, Touched
from kvtiers.tiers._remote_breaker import CircuitBreaker
from kvtiers.tiers._remote_layers import LayerPlan
from kvtiers.tiers._remote_options import Redactor, display_url
from kvtiers.tiers.base import Buffer

__all__ = ["RedisOptions", "RedisTier"]


# Bytes of values one request (a put script, a pipeline of GETs) carries, at most (one value
# may be more): the requests of a large batch run concurrently, over several connections.
_BATCH_BYTES = 64 * 2**20


class RedisTier(PoolTier):
    """A tier of chunks in a Redis or Valkey server, shared by every process that uses it.

    `used_bytes` counts whole stored values (header and payload) of every process, as of
    this process's last request.

    Args:
        config: capacity, eviction (only `"lru"`) and the options of `RedisOptions`.
        layout: the KV layout of the chunks it holds.

    Raises:
        ConfigError: an option is invalid, the capacity cannot hold one chunk, or a stored
            chunk would be larger than the server accepts (`max_value_bytes`).
    """

    kind = "redis"

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        self.options = options = RedisOptions.from_config(config)
        guard = StoreGuard(
            f"redis tier {config.name or self.kind!r}",
            display_url(options.url),
            # NOTE: the client's socket timeout bounds each wait for the server instead: a
            # whole request may rightly take longer while the server serves the tier's others.
            timeout=None,
            slots=options.max_connections,
            breaker=CircuitBreaker(options.breaker_failures, options.breaker_cooldown),
            errors=(RedisError, OSError),
            timeouts=(RedisTimeoutError,),
            redact=Redactor({}, options.url),
        )
        values = StoredValues(config, layout, layer_checksums=True)
        super().__init__(config, layout, values=values, guard=guard, batch_bytes=_BATCH_BYTES)
        self._ranges = LayerRanges(layout, values.header_len, layout.fingerprint)
        if self.value_bytes > options.max_value_bytes:
            raise ConfigError(
                f"{config.where}.max_value_bytes: a stored chunk takes "
                f"{format_size(self.value_bytes)} ({self.value_bytes} bytes), more than the "
                f"server accepts per value ({format_size(self.options.max_value_bytes)}); use a "
                f"smaller chunk_size, or raise the server's proto-max-bulk-len and this option"
            )
        self.namespace = base = f"{options.prefix}:{layout.fingerprint.hex()}"
        """The first part of every key of this tier's layout."""
        self._io = RedisRequests(base, self._ttl_ms(), self._ranges)
        self._lru = self._io.lru
        self._num_entries = 0  # the recency set's size, as of the last request

    # -- lifecycle ---------------------------------------------------------------------

    async def _open(self) -> None:
        # docstring inherited
        options = self.options
        self._io.client = aioredis.Redis.from_url(
            options.url,
            max_connections=options.max_connections,
            socket_timeout=options.timeout,
            socket_connect_timeout=options.timeout,
            retry=Retry(NoBackoff(), options.retries),
        )
        try:
            await self._guard.call(self._refresh_usage)
        except StoreUnavailable as exc:  # served as misses until the breaker lets a probe through
            self.counters.fail(timed_out=exc.timed_out)
            return
        limit = await self._io.max_value_bytes()
        if limit is not None and limit < self.value_bytes:
            await self._io.redis.aclose()
            raise ConfigError(
                f"{self.config.where}.max_value_bytes: {self._guard.where} accepts values of "
                f"at most {format_size(limit)} ({limit} bytes, its proto-max-bulk-len); a "
                f"stored chunk takes {self.value_bytes} bytes, and the server would drop the "
                f"connection of every write; raise its proto-max-bulk-len, or use a smaller "
                f"chunk_size"
            )

    async def _refresh_usage(self) -> None:
        self._num_entries = await self._io.count()

    async def _close(self) -> None:
        # docstring inherited
        # NOTE: calls in flight finish first: a connection they take back after the pool
        # closed would stay open (and a write would be cut short).
        await self._in_flight.ended()
        if self._io.client is not None:
            await self._io.client.aclose()

    @property
    def _redis(self) -> aioredis.Redis:
        return self._io.redis

    # -- the contract ------------------------------------------------------------------

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # docstring inherited
        with self._running():
            check_keys(keys)
            if not keys:
                return []
            if self._guard.refuses():
                self.counters.unavailable += 1
                return [False] * len(keys)

            answer = await self._guarded(functools.partial(self._io.exists, keys), None)
            if answer is None:
                return [False] * len(keys)
            found, self._num_entries = answer
            return found

    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        with self._running():
            check_keys(keys)
            self._check_buffers(keys, dsts)
            return await self._read_batches(keys, dsts, self._get_some, self.layout.chunk_bytes)

    async def _get_some(
        self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer], *, touch: bool = True
    ) -> list[Verdict | None]:
        """Read one pipeline's worth of keys into `dsts`; `None` where there was no value."""
        answer = await self._guarded(functools.partial(self._io.read, keys, touch), None)
        if answer is None:
            return [None] * len(keys)
        values, touched = answer
        self._note_touch(touched)
        return [
            None if raw is None else self._values.read_into(key, raw, dst)
            for key, raw, dst in zip(keys, values, dsts, strict=True)
        ]

    def _note_touch(self, touched: Touched | None) -> None:
        """Take in what a read's touch answered (`None`: no touch, or it was refused)."""
        if touched is not None:
            self._num_entries = touched.entries
            self.counters.cold_hits += touched.were_cold

    # -- layer-wise reads --------------------------------------------------------------

    @property
    def layer_reads(self) -> bool:
        """Whether `get_layers` reads byte ranges (`layer_reads`; never with integrity)."""
        return self.options.layer_reads and self._values.auth_key is None

    async def get_layers(
        self,
        keys: Sequence[ChunkKey],
        layers: Sequence[int],
        dsts: Sequence[Buffer],
        *,
        tally: bool = True,
    ) -> list[bool]:
        """Fill only `layers` of each destination, reading them as byte ranges (GETRANGE).

        Each layer is verified by its own checksum before a byte reaches the destination;
        a value whose ranges do not verify is read whole and judged like `get` (a bad one
        is deleted and counted). Only a tallied call touches the values' recency. Arguments
        as for `Tier.get_layers`.
        """
        if not self.layer_reads:
            return await super().get_layers(keys, layers, dsts, tally=tally)
        with self._running():
            check_keys(keys)
            self._check_buffers(keys, dsts)
            plan = self._ranges.plan(layers)
            read = functools.partial(self._layers_some, plan=plan, touch=tally)
            hit_bytes = len(plan.layers) * self.layout.layer_bytes
            return await self._read_batches(keys, dsts, read, hit_bytes, tally=tally)

    async def _layers_some(
        self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer], *, plan: LayerPlan, touch: bool
    ) -> list[Verdict | None]:
        """Read one pipeline's worth of keys' layers; read whole those that do not verify."""
        read = functools.partial(self._io.read_ranges, keys, plan, touch)
        answer = await self._guarded(read, None)
        if answer is None:
            return [None] * len(keys)
        parts, touched = answer
        self._note_touch(touched)
        verdicts, again = self._ranges.deliver(keys, plan, parts, dsts)
        if again:  # values that did not verify: judged whole
            scratch = np.empty((len(again), self.layout.chunk_bytes), dtype=np.uint8)
            whole = await self._get_some([keys[i] for i in again], list(scratch), touch=touch)
            for i, row, verdict in zip(again, scratch, whole, strict=True):
                verdicts[i] = verdict
                if verdict is Verdict.OK:
                    self._ranges.deliver_whole(plan, row, dsts[i])
        return verdicts

    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        return await self.put_hinted(keys, srcs, ())

    async def put_hinted(
        self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer], cold: Collection[ChunkKey]
    ) -> list[bool]:
        # docstring inherited
        cold = frozenset(cold)
        with self._running():
            check_keys(keys)
            self._check_buffers(keys, srcs)
            plan = plan_put(keys, srcs)
            order, sources, per_call = plan.order, plan.sources, self._per_call
            for start in range(0, len(order), per_call):
                batch = order[start : start + per_call]
                try:
                    write = functools.partial(self._write, batch, sources, cold)
                    results = await self._guard.call(write)
                except StoreUnavailable as exc:
                    self.counters.fail(timed_out=exc.timed_out)
                    self._guard.counters.dropped_writes += len(order) - start
                    break
                plan.held.update(zip(batch, results, strict=True))
                if not all(results):  # full: no deeper chunk is stored without this one
                    break
            self.counters.declined += plan.num_declined
            return plan.results(keys)

    async def _write(
        self, keys: Sequence[ChunkKey], sources: dict[ChunkKey, Buffer], cold: frozenset[bytes]
    ) -> list[bool]:
        """Store `keys` with one script call; return which are held after it."""
        values = [self._pack(key, sources[key]) for key in keys]
        try:
            done = await self._io.write(keys, values, self.max_entries, cold)
        except OutOfMemoryError as exc:  # an answer, not a failure: reads still work
            self._out_of_memory(len(keys), exc)
            return [False] * len(keys)
        self._num_entries = done.entries
        self._full.took()
        self.counters.evictions += len(done.evicted)
        self._note_evicted(done.evicted)
        self.counters.puts += len(done.new)
        self.counters.bytes_written += len(done.new) * self.layout.chunk_bytes
        self.counters.cold_puts += sum(1 for key in done.new if key in cold)
        return done.held

    def _out_of_memory(self, num_chunks: int, exc: OutOfMemoryError) -> None:
        """Count a write the server refused past its `maxmemory` (`FullEpisodes`)."""
        why = (
            f"{self._guard.where} is out of memory ({self._guard.describe(exc)}); give it a "
            "maxmemory-policy that evicts, such as allkeys-lru"
        )
        self._full.refused(num_chunks, why)

    def _pack(self, key: ChunkKey, src: Buffer) -> bytes:
        payload = np.ascontiguousarray(src).reshape(-1)
        return self._values.pack(key, payload.data)

    async def _remove(self, keys: Sequence[ChunkKey]) -> None:
        # docstring inherited
        self._ranges.forget(keys)
        count = await self._guarded(functools.partial(self._io.delete, keys), None)
        self._num_entries = self._num_entries if count is None else count

    def usage(self) -> TierUsage:
        """Return the capacity and what every process holds, as of the last request."""
        return TierUsage(
            self.capacity_bytes, self._num_entries * self.value_bytes, self._num_entries
        )

    def explain_lines(self) -> list[str]:
        """Return what `kvtiers explain` shows of this tier beyond its config."""
        ttl = self.options.ttl
        expiry = "never" if ttl is None else f"{ttl:g} s after a chunk's last write or read"
        return [
            f"  server      {display_url(self.options.url)}, keys {self.namespace}:c:<key>",
            f"  holds       up to {self.max_entries:,} chunks of {format_size(self.value_bytes)} "
            f"(header included), counted over all processes",
            f"  server      its maxmemory must exceed {format_size(self.capacity_bytes)}",
            f"  expiry      {expiry}",
            f"  layer reads {'on' if self.layer_reads else 'off'} (see layer_reads)",
        ]

    # -- helpers -----------------------------------------------------------------------

    def _chunk_key(self, key: ChunkKey) -> bytes:
        return self._io.name(key)

    def _ttl_ms(self) -> int:
        ttl = self.options.ttl
        return 0 if ttl is None else max(1, round(ttl * 1000))
