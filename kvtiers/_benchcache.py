"""The cache `kvtiers bench` measures one tier through, and how `--cold` empties its files.

See `kvtiers._tierbench` for the bench, and `kvtiers._page_cache` for the dropping.
"""

from __future__ import annotations

import os

from kvtiers import _page_cache
from kvtiers.cache import TieredCache
from kvtiers.core.config import CacheConfig
from kvtiers.core.keys import ChunkKey
from kvtiers.tiers.base import Tier
from kvtiers.tiers.registry import TierRegistry

__all__ = ["BenchCache"]


class BenchCache:
    """The bench's cache of one tier; reopened when the tier maps the files to drop.

    With `cold`, `drop()` gets the tier's files (`files`, once the keys are known) out of
    the page cache; the cache object may then be a new one, so it is read from here.
    """

    def __init__(self, config: CacheConfig, registry: TierRegistry, *, cold: bool) -> None:
        self._config, self._registry = config, registry
        self.cache = TieredCache(config, registry=registry)
        self.cold = cold
        self.files: list[str] | None = None
        """The tier's files to drop (None: it has none on this machine, or not cold)."""
        self.reopen = False
        """Whether the tier maps its files (lmdb): the cache is closed to drop them."""
        self.most_resident: float | None = 0.0
        self._evicted = self._start = 0

    @property
    def tier(self) -> Tier:
        tier: Tier = self.cache.tiers[0]
        return tier

    @property
    def evicted(self) -> int:
        """Entries the tier evicted since the first open, over every reopen."""
        return self._evicted + self.tier.counters.evictions - self._start

    async def __aenter__(self) -> BenchCache:
        await self.cache.open()
        self._start = self.tier.counters.evictions
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.cache.close()

    async def drop(self) -> str:
        """Get the tier's files out of the page cache (with `cold`), and check what stayed.

        Returns:
            "" once done (or with nothing to drop), else why the files could not be dropped;
            the cache is open again either way, so the bench can still clean up.
        """
        if self.files is None:
            return ""
        if self.reopen:
            self._evicted = self.evicted
            await self.cache.close()
        try:
            _page_cache.drop(self.files)
            resident = _page_cache.resident_fraction(self.files)
        except OSError as exc:
            return f"could not drop its files from the page cache: {exc}"
        finally:
            if self.reopen:
                self.cache = TieredCache(self._config, registry=self._registry)
                await self.__aenter__()
        if resident is None or self.most_resident is None:
            self.most_resident = None
        else:
            self.most_resident = max(self.most_resident, resident)
        return ""

    def find_files(self, keys: list[ChunkKey]) -> str:
        """Set the files `drop` drops, if the tier has some; return a note if it cannot."""
        if not self.cold:
            return ""
        tier = self.tier
        files: list[str] | None = None
        if tier.kind == "lmdb":
            from kvtiers.tiers.lmdb import LMDBTier  # already imported: the tier is one

            if isinstance(tier, LMDBTier):
                files, self.reopen = [os.path.join(tier.options.path, "data.mdb")], True
        elif tier.kind == "remote":
            from kvtiers.tiers.remote import RemoteTier  # already imported: the tier is one

            files = tier.object_files(keys) if isinstance(tier, RemoteTier) else None
        if files is not None and not _page_cache.can_drop():
            return "not cold: this platform cannot drop files from the page cache"
        self.files = files
        return ""
