"""SGLang adapter: kvtiers as HiCache's storage layer (L3), a `HiCacheStorage` backend.

SGLang builds it through its `dynamic` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvtiers", "module_path": "kvtiers.integrations.sglang",
        "class_name": "KVTiersStorage", "interface_v1": 1, "config": "/etc/kvtiers/tiers.toml"}'

The layout (model, TP shard, MLA or not, dtype, page size) is known only when SGLang
registers its host pool, so the cache is opened then. SGLang's page hashes are mapped to
chunk keys under the layout's fingerprint (`TieredCache.chunk_keys`); the backend keeps no
cache state of its own: every call goes to the cache's key-level API. A hybrid model's
extra pools (Mamba state, SWA windows) each get a cache of their own (`_sglang_pools`).

SGLang calls storage backends synchronously from its prefetch and backup threads, where an
exception would stop the thread for good. So every method here turns a failure into a miss
(`False`, `0`, `None`), logs it (the first of each kind with its traceback, then one line
per hundred) and counts it in `failures`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtiers.cache import TieredCache
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.stats import CacheStats
from kvtiers.integrations._runtime import CACHES, Lease, SharedCache, config_identity
from kvtiers.integrations._sglang_options import BackendOptions, default_config
from kvtiers.integrations._sglang_pages import PageMap, layout_of
from kvtiers.integrations._sglang_pools import ExtraPools, PoolPages, fold_hits

__all__ = ["KVTiersStorage", "default_config"]

logger = logging.getLogger("kvtiers.sglang")

_T = TypeVar("_T")


class KVTiersStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang ships no types
    """A HiCache storage backend on a kvtiers `TieredCache`.

    Args:
        storage_config: SGLang's `HiCacheStorageConfig` (ranks, model, MLA, extra config).
        kwargs: what the dynamic factory passes beside it (unused).

    Raises:
        ConfigError: an unknown extra-config key, or a bad value (at construction), or a
            kvtiers config or host pool kvtiers cannot use (when the pool is registered).
    """

    def __init__(
        self,
        storage_config: HiCacheStorageConfig,
        kwargs: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> None:
        self.storage_config = storage_config
        options = BackendOptions.from_extra_config(storage_config.extra_config)
        self._source, self._salt, self._model = options.source, options.salt, options.model
        self._timeout = options.timeout
        self._entry: SharedCache | None = None
        self._lease: Lease | None = None
        self._pages: dict[str, PageMap] = {}
        self._extras = ExtraPools(options, self._run, self._fail, self._record)
        self.failures: Counter[str] = Counter()
        """Calls that failed (served as misses), by method."""
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        # NOTE: the backup and prefetch threads record while the scheduler takes the
        # metrics (`get_stats`); without the lock a record between the copy and the clear
        # is lost, and a call's pages and bandwidth can land in different snapshots.
        self._metrics_lock = threading.Lock()

    # -- set-up --------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool whose pages this backend reads and writes; open the cache.

        Raises:
            ConfigError: the pool or the kvtiers config cannot be used.
        """
        super().register_mem_pool_host(mem_pool_host)
        self._register(PoolName.KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register a host pool for the v2 calls; an extra pool gets a cache of its own.

        Raises:
            ConfigError: the pool or its config cannot be used, or the KV pool is not
                registered yet.
        """
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool_name == PoolName.KV:
            self._register(PoolName.KV, host_pool)
            return
        if self._entry is None:
            raise ConfigError(f"hicache host pool {str(host_pool_name)!r}: register KV first")
        kv = self._entry.cache
        pool = self._extras.register(str(host_pool_name), host_pool, kv.layout, self.storage_config)
        kv.serve_metrics_of(pool)  # one endpoint: the KV cache's `[metrics]`

    def _register(self, name: str, pool: Any) -> None:
        layout = layout_of(pool, self.storage_config, self._model)
        pages = PageMap.of(pool, layout)
        if self._entry is None:
            source = self._source
            self._entry = CACHES.acquire(
                (config_identity(source), layout),
                lambda: TieredCache.from_config(source, layout=layout),
            )
            self._lease = Lease(self, self._entry, CACHES)  # released by close, or with self
            logger.info(
                "kvtiers: HiCache storage on %s (%s pages of %d tokens, %d bytes each)",
                ", ".join(t.name for t in self._entry.cache.tiers),
                layout.kind,
                layout.chunk_size,
                layout.chunk_bytes,
            )
        elif self._entry.cache.layout != layout:
            raise ConfigError(f"hicache host pool {name!r}: another layout than the KV pool's")
        self._pages[str(name)] = pages

    def close(self) -> None:
        """Release the caches (the last user closes each); idempotent, also when racing.

        A backend dropped without `close` releases them when it is garbage-collected.
        """
        self._extras.close()
        lease, self._entry = self._lease, None
        if lease is not None:
            lease.release()  # once, even when two threads close at once

    @property
    def cache(self) -> TieredCache | None:
        """The underlying cache, once a host pool is registered."""
        return self._entry.cache if self._entry is not None else None

    # -- running cache calls from SGLang's threads ---------------------------------

    def _run(self, op: str, make: Any, default: _T, entry: SharedCache | None = None) -> _T:
        """Run `make(cache)` on the loop of `entry` (default: the KV cache's).

        A failure or timeout gives `default`.
        """
        entry = entry or self._entry
        if entry is None:
            self._fail(op, "no host pool registered yet")
            return default
        try:
            coro: Awaitable[_T] = make(entry.cache)
            return entry.loop.run(_within(coro, self._timeout), self._timeout + 5.0)
        except Exception as exc:
            self._fail(op, exc)
            return default

    def _fail(self, op: str, why: object) -> None:
        self.failures[op] += 1
        count = self.failures[op]
        if count == 1 or count % 100 == 0:
            logger.warning(
                "kvtiers: %s failed (%d so far), served as a miss: %s",
                op,
                count,
                why,
                exc_info=isinstance(why, BaseException) and count == 1,
            )

    def _keys(self, hashes: list[str], extra_info: Any) -> tuple[list[ChunkKey], ChunkKey | None]:
        cache = self.cache
        assert cache is not None
        keys = cache.chunk_keys(hashes, salt=self._salt)
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        parent = cache.chunk_keys(prefix[-1:], salt=self._salt)[0] if prefix else None
        return keys, parent

    # -- lookups -------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Return whether some tier holds the page of `key`."""
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Return how many leading pages of `keys` some tier holds."""
        if not keys:
            return 0

        async def go(cache: TieredCache) -> int:
            return await cache.lookup_keys(self._keys(keys, extra_info)[0])

        return self._run("batch_exists", go, 0)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """Return the usable prefix: the KV hit, cut to what every extra pool restores.

        Each transfer's hit policy says which pages its pool must hold (`fold_hits`).
        """
        hit = self.batch_exists(keys, extra_info)
        extra = [t for t in pool_transfers or [] if t.name != PoolName.KV]
        final, counts, restorable = fold_hits(
            hit, extra, lambda name: self._extras.present(name, keys[:hit])
        )
        return PoolTransferResult(final, counts, restorable)

    # -- zero-copy page transfers (v1 and v2) ---------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages straight into the host pool's slots; per key, whether it was read."""
        return self._transfer("batch_get_v1", PoolName.KV, keys, host_indices, extra_info, False)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store pages straight from the host pool's slots; per key, whether a tier holds it."""
        return self._transfer("batch_set_v1", PoolName.KV, keys, host_indices, extra_info, True)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages into its host pool; per pool, per key, whether read."""
        return self._transfers("batch_get_v2", transfers, extra_info, write=False)

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages from its host pool; per pool, per key, whether held."""
        return self._transfers("batch_set_v2", transfers, extra_info, write=True)

    def _transfers(
        self, op: str, transfers: list[PoolTransfer], extra_info: Any, *, write: bool
    ) -> dict[str, list[bool]]:
        return {
            t.name: (
                self._transfer(op, t.name, t.keys or [], t.host_indices, extra_info, write)
                if t.name == PoolName.KV
                else self._extras.transfer(op, str(t.name), t.keys or [], t.host_indices, write)
            )
            for t in transfers
        }

    def _transfer(
        self,
        op: str,
        pool: Any,
        keys: list[str],
        host_indices: torch.Tensor | None,
        extra_info: Any,
        write: bool,
    ) -> list[bool]:
        missed = [False] * len(keys)
        if not keys:
            return []
        if write and not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # MLA: one rank writes the pages every rank shares
        pages = self._pages.get(str(pool))
        if pages is None or host_indices is None:
            self._fail(op, f"no registered host pool {str(pool)!r} (only KV is stored)")
            return missed
        start = time.perf_counter()

        async def go(cache: TieredCache) -> list[bool]:
            chunk_keys, parent = self._keys(keys, extra_info)
            views = pages.pages(host_indices, len(keys))
            if write:
                return await cache.put_chunks(chunk_keys, views, parent=parent)
            return await cache.get_chunks(chunk_keys, views, parent=parent)

        flags = self._run(op, go, missed)
        self._record(write, sum(flags), time.perf_counter() - start, pages)
        return flags

    def _record(
        self, write: bool, num_pages: int, seconds: float, pages: PageMap | PoolPages
    ) -> None:
        kind = "backup" if write else "prefetch"
        gb = num_pages * pages.layout.chunk_bytes / 1e9
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(num_pages)
            self._metrics[f"{kind}_bandwidth"].append(gb / seconds if seconds > 0 else 0.0)

    # -- the generic path: flat page copies -----------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Fill `target_location` (a flat page) with the page of `key`; `None` on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Fill each flat page of `target_locations`; `None` where a page is missing."""
        pages = self._pages.get(str(PoolName.KV))
        if pages is None or target_locations is None or len(target_locations) != len(keys):
            self._fail("batch_get", "no host pool registered, or no target for every key")
            return [None] * len(keys)
        targets = list(target_locations)

        async def go(cache: TieredCache) -> list[bool]:
            views = [pages.flat(t) for t in targets]
            return await cache.get_chunks(self._keys(keys, None)[0], views)

        flags = self._run("batch_get", go, [False] * len(keys))
        return [t if ok else None for t, ok in zip(targets, flags, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store one flat page under `key`."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages under `keys`; whether a tier holds every one of them."""
        pages = self._pages.get(str(PoolName.KV))
        if pages is None or values is None or len(values) != len(keys):
            self._fail("batch_set", "no host pool registered, or no value for every key")
            return False
        if not self.storage_config.is_storage_writer:
            return True
        try:
            data = [v.contiguous() for v in values]
        except Exception as exc:  # not tensors: a miss, never an exception into SGLang
            self._fail("batch_set", exc)
            return False

        async def go(cache: TieredCache) -> list[bool]:
            views = [pages.flat(v) for v in data]
            return await cache.put_chunks(self._keys(keys, None)[0], views)

        return all(self._run("batch_set", go, [False] * len(keys)))

    # -- administration ------------------------------------------------------------

    def clear(self) -> bool:
        """Remove every page this server's cache knows of, from every tier.

        Pages that only other servers stored in a shared tier stay (they are theirs).
        """

        async def go(cache: TieredCache) -> bool:
            await cache.clear()
            return True

        cleared = [self._run("clear", go, False, entry) for entry in self._extras.entries()]
        return self._run("clear", go, False) and all(cleared)

    def get_stats(self) -> Any:
        """Return SGLang's `StorageMetrics` for the calls since the last call."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._metrics_lock:
            for name, values in self._metrics.items():
                getattr(metrics, name).extend(values)
                values.clear()
        return metrics

    def kvtiers_stats(self) -> CacheStats | None:
        """Return the KV cache's own counters (hits, tiers, miss reasons)."""
        return self.cache.stats() if self.cache is not None else None

    def pool_stats(self) -> dict[str, CacheStats]:
        """Return each extra pool's cache counters, by pool name."""
        return {name: entry.cache.stats() for name, entry in self._extras.named_entries()}


async def _within(op: Awaitable[_T], timeout: float) -> _T:
    # NOTE: wait_for cancels the operation and waits for it to unwind, so no tier is still
    # writing into a host page when the caller gives the page back to SGLang.
    return await asyncio.wait_for(op, timeout)
