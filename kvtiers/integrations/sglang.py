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
(`False`, `0`, `None`, an aligned list of them), logs it and counts it in `failures`
(`_sglang_calls`). Arguments are checked before any page moves (`_sglang_args`): a bad one
is such a miss, also counted by the argument at fault in `rejected`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
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
from kvtiers.core.errors import CacheStateError, ConfigError
from kvtiers.core.stats import CacheStats
from kvtiers.integrations._runtime import CACHES, Lease, SharedCache, config_identity
from kvtiers.integrations._sglang_args import (
    BadArgumentError,
    Transfer,
    checked_transfers,
    count_of,
    missed_transfers,
    page_keys,
    parent_hash,
)
from kvtiers.integrations._sglang_calls import Calls
from kvtiers.integrations._sglang_kv import KVPages
from kvtiers.integrations._sglang_metrics import TransferMetrics
from kvtiers.integrations._sglang_options import BackendOptions, default_config
from kvtiers.integrations._sglang_pages import pool_pages
from kvtiers.integrations._sglang_pools import ExtraPools, fold_hits

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
        self._entry: SharedCache | None = None
        self._lease: Lease | None = None
        self._kv: KVPages | None = None
        self._calls = Calls(logger, options.timeout)
        self.failures = self._calls.failures
        """Calls that failed (served as misses), by method."""
        self.rejected = self._calls.rejected
        """Calls refused for a bad argument (also in `failures`), by the argument at fault."""
        self._metrics = TransferMetrics()
        self._extras = ExtraPools(options, self._run, self._calls.miss, self._metrics.record)

    # -- set-up --------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool whose pages this backend reads and writes; open the cache.

        Raises:
            ConfigError: the pool or the kvtiers config cannot be used.
        """
        self._register(PoolName.KV, mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register a host pool for the v2 calls; an extra pool gets a cache of its own.

        Raises:
            ConfigError: the pool, its name or its config cannot be used, or the KV pool
                is not registered yet.
        """
        if not isinstance(host_pool_name, str) or not host_pool_name:
            raise ConfigError(
                f"hicache host pool name: expected a PoolName, got {host_pool_name!r}"
            )
        if host_pool_name == PoolName.KV:
            self._register(PoolName.KV, host_pool)
        elif self._entry is None:
            raise ConfigError(f"hicache host pool {str(host_pool_name)!r}: register KV first")
        else:
            kv = self._entry.cache
            name, config = str(host_pool_name), self.storage_config
            kv.serve_metrics_of(self._extras.register(name, host_pool, kv.layout, config))
        super().register_mem_host_pool_v2(host_pool, host_pool_name)  # once it is usable

    def _register(self, name: str, pool: Any) -> None:
        pages = pool_pages(pool, self.storage_config, self._model)
        layout = pages.layout
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
            raise ConfigError(f"hicache host pool {str(name)!r}: another layout than the KV pool's")
        writer = bool(self.storage_config.is_storage_writer)
        self._kv = KVPages(pages, self._run, self._metrics.record, self._salt, writer)

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

    # -- running calls from SGLang's threads ----------------------------------------

    def _run(self, op: str, make: Any, default: _T, entry: SharedCache | None = None) -> _T:
        """Run `make(cache)` on the loop of `entry` (default: the KV cache's)."""
        return self._calls.run(op, make, default, entry or self._entry)

    def _kv_pages(self) -> KVPages:
        if self._kv is None:
            raise CacheStateError("no host pool registered yet")
        return self._kv

    # -- lookups -------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Return whether some tier holds the page of `key`."""
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Return how many leading pages of `keys` some tier holds."""
        return self._calls.guarded("batch_exists", 0, self._exists, keys, extra_info)

    def _exists(self, keys: Any, extra_info: Any) -> int:
        hashes = page_keys(keys)
        parent_hash(extra_info)  # checked only: a lookup links no pages
        if not hashes:
            return 0

        async def go(cache: TieredCache) -> int:
            return await cache.lookup_keys(cache.chunk_keys(hashes, salt=self._salt))

        return self._run("batch_exists", go, 0)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """Return the usable prefix: the KV hit, cut to what every extra pool restores.

        Each transfer's hit policy says which pages its pool must hold (`fold_hits`); a
        malformed transfer gives no usable prefix.
        """
        missed = PoolTransferResult(0, {}, [])
        return self._calls.guarded(
            "batch_exists_v2", missed, self._exists_v2, keys, pool_transfers, extra_info
        )

    def _exists_v2(self, keys: Any, transfers: Any, extra_info: Any) -> PoolTransferResult:
        hashes, (good, bad) = page_keys(keys), checked_transfers(transfers, optional=True)
        parent_hash(extra_info)
        if bad:
            raise bad[0]  # a pool left unchecked could not restore the prefix
        hit = self.batch_exists(hashes, extra_info)
        extra = [t for t in good if t.name != PoolName.KV]
        final, counts, restorable = fold_hits(
            hit, extra, lambda name: self._extras.present(name, hashes[:hit])
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
        return self._kv_transfer("batch_get_v1", keys, host_indices, extra_info, False)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store pages straight from the host pool's slots; per key, whether a tier holds it."""
        return self._kv_transfer("batch_set_v1", keys, host_indices, extra_info, True)

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
        self, op: str, transfers: Any, extra_info: Any, *, write: bool
    ) -> dict[str, list[bool]]:
        """Run each pool's transfer; a malformed one is a miss of its pool alone."""
        answer = missed_transfers(transfers)
        try:
            parent_hash(extra_info)
            good, bad = checked_transfers(transfers)
        except BadArgumentError as exc:
            self._calls.miss(op, exc)
            return answer
        for why in bad:
            self._calls.miss(op, why)
        for t in good:
            missed = [False] * len(t.keys)
            answer[t.name] = self._calls.guarded(
                op, missed, self._pool_transfer, op, t, extra_info, write
            )
        return answer

    def _pool_transfer(
        self, op: str, transfer: Transfer, extra_info: Any, write: bool
    ) -> list[bool]:
        if transfer.name == PoolName.KV:
            return self._transfer(op, transfer.keys, transfer.host_indices, extra_info, write)
        name, keys = str(transfer.name), transfer.keys
        return self._extras.transfer(op, name, keys, transfer.host_indices, write)

    def _kv_transfer(
        self, op: str, keys: Any, host_indices: Any, extra_info: Any, write: bool
    ) -> list[bool]:
        missed = [False] * count_of(keys)
        return self._calls.guarded(
            op, missed, self._transfer, op, keys, host_indices, extra_info, write
        )

    def _transfer(
        self, op: str, keys: Any, host_indices: Any, extra_info: Any, write: bool
    ) -> list[bool]:
        hashes, parent = page_keys(keys), parent_hash(extra_info)
        return self._kv_pages().transfer(op, hashes, parent, host_indices, write) if hashes else []

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
        missed: list[torch.Tensor | None] = [None] * count_of(keys)
        return self._calls.guarded("batch_get", missed, self._get_flat, keys, target_locations)

    def _get_flat(self, keys: Any, targets: Any) -> list[torch.Tensor | None]:
        hashes = page_keys(keys)
        return self._kv_pages().get_flat(hashes, targets) if hashes else []

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
        return self._calls.guarded("batch_set", False, self._set_flat, keys, values)

    def _set_flat(self, keys: Any, values: Any) -> bool:
        return self._kv_pages().set_flat(page_keys(keys), values)

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

        return self._metrics.take(StorageMetrics())

    def kvtiers_stats(self) -> CacheStats | None:
        """Return the KV cache's own counters (hits, tiers, miss reasons)."""
        return self.cache.stats() if self.cache is not None else None

    def pool_stats(self) -> dict[str, CacheStats]:
        """Return each extra pool's cache counters, by pool name."""
        return {name: entry.cache.stats() for name, entry in self._extras.named_entries()}
