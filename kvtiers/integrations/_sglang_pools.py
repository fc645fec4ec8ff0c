"""Hybrid models' extra HiCache pools (Mamba state, sliding-window KV, ...) in kvtiers.

Beside its KV pages, a hybrid model keeps pools whose pages SGLang keys by the same page
hashes: a Mamba pool holds the recurrent state at some page boundaries, an SWA pool the
last pages of a sliding window. HiCache hands them to the storage layer in its v2 calls
(`PoolTransfer`), each with a hit policy that says which pages must be present.

A page of such a pool has its own size and shape, so each pool gets a `TieredCache` of its
own, under the model name plus `#<pool>`, so its keys never meet the KV pages' keys. Its
tiers are the KV config's, with each LMDB path suffixed `-<pool>` (an LMDB environment
opens once per process), unless the backend's `pools` option names a config for the pool.

A KV-like pool (an SWA window, a draft model's KV) gets a KV layout and moves in place
through its page views (`PoolViews`), like the KV pool. Any other pool (Mamba state) is
stored as opaque bytes (one layer, the pool's page size in tokens, `size_per_token`
uint8 elements each) and moves by copy through the flat-page calls every SGLang host
pool has (`get_data_page`, `set_from_flat_data_page`), like SGLang's own file backend
(`PoolPages`).

Imports no SGLang module: it reads pools' and transfers' attributes only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtiers.cache import TieredCache
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from kvtiers.integrations._runtime import CACHES, Lease, SharedCache, config_identity
from kvtiers.integrations._sglang_args import BadArgumentError, capacity_of, page_starts
from kvtiers.integrations._sglang_options import BackendOptions
from kvtiers.integrations._sglang_pages import PageMap, pool_pages
from kvtiers.integrations._side_caches import lmdb_paths, pool_config

__all__ = ["ExtraPools", "PoolPages", "PoolViews", "fold_hits", "pool_config", "pool_layout"]

_WHERE = "hicache host pool"
_OPTIONS = "hicache-storage-backend-extra-config"

#: Pools that SGLang shards by tensor-parallel rank even where the KV pages are shared
#: (an MLA model's Mamba state).
_RANK_SHARDED = frozenset({"mamba"})


def pool_layout(pool: Any, name: str, kv_layout: KVLayout, storage_config: Any) -> KVLayout:
    """Return the layout of an extra pool's pages: opaque bytes under `model#name`.

    Pages are keyed per rank where the KV pages are (MHA) or SGLang shards the pool
    (Mamba); else, like MLA pages, as rank 0 of 1 and shared by every rank.

    Raises:
        ConfigError: the pool has no flat pages, or their size is not whole tokens.
    """
    try:
        page_size = int(getattr(pool, "page_size", 1) or 1)
        probe = pool.get_dummy_flat_data_page()
        page_bytes = probe.numel() * probe.element_size()
    except Exception as exc:
        raise ConfigError(f"{_WHERE} {name!r}: no flat pages to store ({exc})") from exc
    if page_bytes <= 0 or page_bytes % page_size:
        raise ConfigError(
            f"{_WHERE} {name!r}: a page of {page_bytes} bytes is not {page_size} whole tokens"
        )
    sharded = kv_layout.kind == "mha" or name in _RANK_SHARDED
    return KVLayout(
        f"{kv_layout.model}#{name}",
        1,
        1,
        page_bytes // page_size,
        "uint8",
        page_size,
        kind="mla",
        model_revision=kv_layout.model_revision,
        tp_rank=int(storage_config.tp_rank) if sharded else 0,
        tp_size=int(storage_config.tp_size) if sharded else 1,
    )


class PoolPages:
    """Copies of one extra pool's pages, as the cache's chunks.

    Pages are read into flat staging pages, then copied into the pool's slots; a few
    staging pages are kept for the next read (SGLang's prefetch thread reads one request's
    state per call, and allocating a page each time cost a tenth of a warm read).

    Args:
        pool: the SGLang host pool (`MambaPoolHost`, ...).
        layout: its layout (`pool_layout`).
    """

    _SPARE = 8  # staging pages kept between reads

    def __init__(self, pool: Any, layout: KVLayout) -> None:
        self.pool = pool
        self.layout = layout
        self._spare: list[Any] = []
        self._lock = threading.Lock()  # SGLang's prefetch and backup threads call at once

    def starts(self, keys: Sequence[str], host_indices: Any, *, write: bool) -> list[int]:
        """Return each key's first host slot (`page_starts`, within the pool's `size`).

        Raises:
            BadArgumentError: the host indices do not give one page of the pool per key.
        """
        size, capacity = self.layout.chunk_size, capacity_of(self.pool)
        return page_starts(host_indices, len(keys), size, capacity, write=write)

    def sources(self, starts: Sequence[int]) -> list[Any]:
        """Return each page's bytes (the chunk to store), as the pool gives them."""
        return [_bytes(self.pool.get_data_page(start, flat=True)) for start in starts]

    def targets(self, starts: Sequence[int]) -> list[Any]:
        """Return a chunk to read each page into (`finish` puts the hits in place)."""
        with self._lock:
            taken, self._spare = self._spare[: len(starts)], self._spare[len(starts) :]
        fresh = len(starts) - len(taken)
        return taken + [_bytes(self.pool.get_dummy_flat_data_page()) for _ in range(fresh)]

    def finish(self, starts: Sequence[int], targets: Sequence[Any], hits: Sequence[bool]) -> None:
        """Copy each page read into the pool's slots; keep a few staging pages."""
        for start, page, hit in zip(starts, targets, hits, strict=True):
            if hit:
                self.pool.set_from_flat_data_page(start, torch.from_numpy(page))
        with self._lock:
            self._spare.extend(targets[: self._SPARE - len(self._spare)])


class PoolViews(PoolPages):
    """A KV-like extra pool's pages (an SWA window, a draft model's KV) read in place.

    Its pages are payload-order views of the pool's own memory (`PageMap`, as for the KV
    pool): the tiers read into them and write from them directly; a miss leaves its page
    untouched.
    """

    def __init__(self, pages: PageMap) -> None:
        super().__init__(pages.pool, pages.layout)
        self.map = pages

    def sources(self, starts: Sequence[int]) -> list[Any]:
        # docstring inherited
        return self.map.pages_at(starts)

    def targets(self, starts: Sequence[int]) -> list[Any]:
        # docstring inherited
        return self.map.pages_at(starts)

    def finish(self, starts: Sequence[int], targets: Sequence[Any], hits: Sequence[bool]) -> None:
        # docstring inherited
        return None


def _bytes(page: torch.Tensor) -> Any:
    return page.contiguous().reshape(-1).view(torch.uint8).numpy()


class ExtraPools:
    """The extra pools registered with one backend, each in a cache of its own.

    Caches are shared within the process like the KV cache (`CACHES`), by config, pool and
    layout; each pool's config must name LMDB paths of its own. Calls go through the
    backend's `run` (a failure or timeout gives the default) and `fail` (log and count).

    Args:
        options: the backend's options (the KV config, per-pool configs, salt).
        run: runs `make(cache)` on an entry's loop: `run(op, make, default, entry)`.
        fail: records a failed call: `fail(op, why)`.
        record: records a transfer's pages and time:
            `record(write, num_pages, seconds, chunk_bytes)`.
    """

    def __init__(
        self,
        options: BackendOptions,
        run: Callable[..., Any],
        fail: Callable[[str, object], None],
        record: Callable[..., None],
    ) -> None:
        self._options = options
        self._run, self._fail, self._record = run, fail, record
        self._pools: dict[str, tuple[SharedCache, PoolPages]] = {}
        self._leases: dict[str, Lease] = {}  # released by close, or with self

    def register(
        self, name: str, pool: Any, kv_layout: KVLayout, storage_config: Any
    ) -> TieredCache:
        """Open (or share) the cache of pool `name`; a pool registered again replaces it.

        Returns:
            The pool's cache.

        Raises:
            ConfigError: the pool or its config cannot be used; nothing is kept.
        """
        pages = self._pages_of(pool, name, kv_layout, storage_config)
        layout = pages.layout
        source, own = self._options.source, self._options.pools.get(name)
        config = pool_config(source, own, name)
        paths = lmdb_paths(config)
        for other, (entry_, _) in self._pools.items():
            shared = paths & lmdb_paths(entry_.cache.config) if other != name else set()
            if shared:
                raise ConfigError(
                    f"{_OPTIONS}.pools.{name}: lmdb path {min(shared)!r} is pool "
                    f"{other!r}'s; an LMDB environment opens once per process"
                )
        key = (config_identity(source if own is None else own), name, layout)
        entry = CACHES.acquire(key, lambda: TieredCache.from_config(config, layout=layout))
        old = self._leases.get(name)
        self._pools[name] = (entry, pages)
        self._leases[name] = Lease(self, entry, CACHES)
        if old is not None:
            old.release()
        return entry.cache

    def _pages_of(
        self, pool: Any, name: str, kv_layout: KVLayout, storage_config: Any
    ) -> PoolPages:
        """Return views of a KV-like pool's pages where it has them, else copies."""
        if hasattr(pool, "kv_buffer") and hasattr(pool, "layer_num"):
            model = f"{self._options.model or storage_config.model_name or 'sglang-model'}"
            try:
                return PoolViews(pool_pages(pool, storage_config, f"{model}#{name}"))
            except ConfigError:
                pass  # a KV pool kvtiers cannot view: its pages are copied
        return PoolPages(pool, pool_layout(pool, name, kv_layout, storage_config))

    def entries(self) -> list[SharedCache]:
        """Return the caches of every registered pool."""
        return [entry for entry, _ in self._pools.values()]

    def named_entries(self) -> list[tuple[str, SharedCache]]:
        """Return each registered pool's name and cache."""
        return [(name, entry) for name, (entry, _) in self._pools.items()]

    def present(self, name: str, hashes: list[str]) -> list[bool]:
        """Return, per page hash, whether pool `name`'s cache holds its page."""
        missed = [False] * len(hashes)
        found = self._pools.get(name)
        if found is None:
            self._fail("batch_exists_v2", BadArgumentError("pool", f"{name!r} is not registered"))
            return missed
        salt = self._options.salt

        async def go(cache: TieredCache) -> list[bool]:
            return await cache.contains_keys(cache.chunk_keys(hashes, salt=salt))

        return self._run("batch_exists_v2", go, missed, found[0]) if hashes else []

    def transfer(
        self, op: str, name: str, keys: list[str], host_indices: Any, write: bool
    ) -> list[bool]:
        """Store or read pool `name`'s pages at `host_indices`; per key, whether done."""
        # NOTE: every rank writes its extra pools: HiCache itself decides which pools a
        # rank backs up (a Mamba state is per rank even where MLA pages are shared).
        missed = [False] * len(keys)
        found = self._pools.get(name)
        if not keys:
            return missed
        try:
            if found is None:
                raise BadArgumentError("pool", f"{name!r} is not registered")
            entry, pages = found
            starts = pages.starts(keys, host_indices, write=write)
        except BadArgumentError as exc:
            self._fail(op, exc)
            return missed
        salt, begin = self._options.salt, time.perf_counter()
        try:
            chunks = pages.sources(starts) if write else pages.targets(starts)

            async def go(cache: TieredCache) -> list[bool]:
                chunk_keys = cache.chunk_keys(keys, salt=salt)
                if write:
                    return await cache.put_chunks(chunk_keys, chunks)
                return await cache.get_chunks(chunk_keys, chunks)

            flags: list[bool] = self._run(op, go, missed, entry)
            if not write:
                pages.finish(starts, chunks, flags)
        except Exception as exc:  # SGLang's own page calls
            self._fail(op, exc)
            return missed
        self._record(write, sum(flags), time.perf_counter() - begin, pages.layout.chunk_bytes)
        return flags

    def close(self) -> None:
        """Release every pool's cache (the last user closes it); idempotent."""
        leases, self._leases = self._leases, {}
        self._pools = {}
        for lease in leases.values():
            lease.release()  # once, even when two threads close at once


def fold_hits(
    kv_pages: int, transfers: Sequence[Any], present: Callable[[str], list[bool]]
) -> tuple[int, dict[str, int], list[int]]:
    """Fold the KV hit and each extra pool's presence into HiCache's usable prefix.

    `present(name)` says, for each of the first `kv_pages` pages, whether pool `name`
    holds it. A pool with `"all_pages"` must hold every page up to a prefix length; one
    with `"trailing_pages"` only the last `len(keys)` pages before it (a Mamba state, an
    SWA window), so some lengths can be restorable and shorter ones not. A pool of another
    policy gives no verdict and does not limit the prefix.

    Returns:
        The usable prefix in pages (the longest length every pool can restore), each
        pool's own boundary (KV included, absent where 0), and every restorable length.
    """
    hit_count: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
        if policy not in ("all_pages", "trailing_pages"):
            continue
        flags = present(str(transfer.name))
        if policy == "all_pages":
            boundary = next((i for i, flag in enumerate(flags) if not flag), len(flags))
            ok = set(range(1, boundary + 1))
        else:
            window = max(1, len(transfer.keys or ()))
            ok = {n for n in range(1, kv_pages + 1) if all(flags[max(0, n - window) : n])}
            boundary = max(ok, default=0)
        if boundary:
            hit_count[str(transfer.name)] = boundary
        restorable = [n for n in restorable if n in ok]
    return (restorable[-1] if restorable else 0), hit_count, restorable
