"""The cache's residency bookkeeping: slots, eviction, tier calls and residency events.

`Residency` holds the state every part of the cascade shares (the index, the slots with their
policies, the pending and evicting sets) and the operations that change where a chunk is
resident: putting into a tier (making room first), evicting leaves, dropping stale hints.
`WriteQueues` and `Mover` build on it.

Everything here runs on the cache's event loop, so the index, the policies and the pending
sets need no locks; the only suspension points are awaits on tiers and queues, and every
invariant that must hold across one is guarded: reserved blocks are invisible until
committed, pinned blocks are never reused, and chunks still queued for a write-through tier
(`_pending`) or being evicted (`_evicting`) are never chosen as victims.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Collection, Sequence
from typing import Any, TypeVar, cast

import torch

from kvtiers._logs import RateLimitedLog
from kvtiers._slot import Slot, View
from kvtiers._stages import StagePool
from kvtiers.core.errors import CacheStateError, InvalidInputError
from kvtiers.core.events import ChunkRemoved, ChunkStored, EventQueue
from kvtiers.core.index import PrefixIndex
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.gpu.hbm import HBMTier
from kvtiers.gpu.pinned import pinned_allocator
from kvtiers.tiers.base import Buffer
from kvtiers.tiers.blocks import BlockTier
from kvtiers.tiers.dram import MemoryTier

__all__ = ["CallerCopyFailed", "Residency"]

logger = logging.getLogger("kvtiers")

_T = TypeVar("_T")
DIRECT_PUT_BYTES = 4 * 2**20
"""Chunks this big or bigger are put from the caller's contiguous bytes, unstaged."""
_RECENTLY_EVICTED = 65_536  # keys remembered as evicted, to tell "evicted" from "never_stored"


class CallerCopyFailed(Exception):
    """A copy between the tiers and the caller's memory failed (logged and counted).

    Raised out of a sink's `deliver` or a source's `fill` by `Residency._caller_copy`, and
    caught where the load or store began, which then ends with what was copied before it.
    """


class Residency:
    """Where each chunk is resident, and the operations that change it."""

    def __init__(
        self,
        layout: KVLayout,
        index: PrefixIndex,
        slots: list[Slot],
        queue_chunks: int,
        events: EventQueue | None = None,
        concurrent_reads: bool = True,
    ) -> None:
        self._layout = layout
        self._concurrent_reads = concurrent_reads
        self._events = events
        """Where residency changes go; `None` when events are off (nothing is allocated)."""
        self.miss_reasons: Counter[str] = Counter()
        """Per lookup or short load, why the first chunk not served was not (see `lookup`)."""
        # NOTE: a dict as a bounded insertion-ordered set: the oldest key goes first.
        self._evicted: dict[ChunkKey, str] = {}
        """Keys recently dropped, with the tier that dropped them last, oldest first."""
        self.evicted_from: Counter[str] = Counter()
        """Of the "evicted" misses, per tier that dropped the chunk last."""
        self._log = RateLimitedLog(logger)
        self._drops = 0  # residencies dropped so far (`_drop`)
        self._index = index
        self._slots = slots
        self._queue_chunks = queue_chunks
        top = slots[0].tier
        self._memtop: BlockTier[Any] | None = top if isinstance(top, BlockTier) else None
        self._hbm = top if isinstance(top, HBMTier) else None  # the only tier of tensor views
        self._shared = [s for s in slots if s.tier.shared]
        # Index bits of tiers whose residency the index knows exactly (the cache evicts them).
        self._local_bits = sum(1 << s.idx for s in slots if not s.tier.shared)
        self._through = [s for s in slots[1:] if s.config.write_policy == "write_through"]
        self._self_evicting = [s for s in slots if s.tier.manages_eviction]
        self._pending: Counter[ChunkKey] = Counter()
        self._evicting: set[ChunkKey] = set()
        # NOTE: on a GPU the stage is one side of the HBM tier's copies (promotions from,
        # demotions into tiers of host buffers): pinned, those copies run by DMA.
        on_gpu = self._hbm is not None and self._hbm.device.type == "cuda"
        self._stages = StagePool(
            layout.chunk_bytes, allocate=pinned_allocator() if on_gpu else None
        )
        # NOTE: big chunks that the caller holds as contiguous host bytes go to the tiers
        # below without a stage copy. Measured on a 2-vCPU VM (puts into lmdb): 8 and 32 MiB
        # chunks stored 10-35% faster that way, 256 KiB chunks 30% slower (a batch of small
        # chunks staged into one reused buffer packs faster than from scattered memory).
        self._direct_puts = layout.chunk_bytes >= DIRECT_PUT_BYTES

    def _release_pending(self, key: ChunkKey) -> None:
        self._pending[key] -= 1
        if self._pending[key] <= 0:
            del self._pending[key]

    async def _put(
        self,
        slot: Slot,
        keys: list[ChunkKey],
        views: Sequence[View],
        cold: Collection[ChunkKey] = (),
    ) -> list[bool]:
        """Put chunks into a tier, first making room when the cache evicts for it.

        Views are host buffers, or all HBM blocks (demotions and write-through copies from
        an HBM tier on top), which `_put_blocks` moves. The chunks in `cold`, and those the
        top tier holds cold, carry the reuse hint down: the tier's policy or the tier
        itself (`Tier.put_hinted`) evicts them first.
        """
        if not keys:
            return []
        top = self._slots[0].policy
        if top is not None and slot.idx > 0:
            cold = {key for key in keys if key in cold or top.is_cold(key)}
        if isinstance(slot.tier, BlockTier):
            # NOTE: room for the chunks it lacks only: the cache's index knows a block tier's
            # residency exactly, and a demotion often finds its chunks there already.
            bit = 1 << slot.idx
            new = sum(1 for key in keys if not self._index.tiers_of(key) & bit)
            await self._make_room(slot, new, protect=set(keys))
        if isinstance(views[0], torch.Tensor):
            flags = await self._put_blocks(slot, keys, cast(list[torch.Tensor], views), cold)
        else:
            srcs = cast(Sequence[Buffer], views)
            put = slot.tier.put_hinted(keys, srcs, cold) if cold else slot.tier.put(keys, srcs)
            flags = await self._call(slot, "put", put, [False] * len(keys))
        if slot.tier.manages_eviction:
            self._reap_slot(slot)
        if slot.policy is not None:
            for key, flag in zip(reversed(keys), reversed(flags), strict=True):
                if flag:
                    (slot.policy.insert_cold if key in cold else slot.policy.insert)(key)
        return flags

    async def _put_blocks(
        self,
        slot: Slot,
        keys: list[ChunkKey],
        blocks: list[torch.Tensor],
        cold: Collection[ChunkKey],
    ) -> list[bool]:
        """Put HBM blocks into a lower tier, in one batch of copies on the HBM tier's stream.

        A host block tier (DRAM) gets them straight into blocks it reserves: one copy (by
        DMA, as its memory is pinned when CUDA is present). Other tiers take host buffers,
        so the blocks go through a reused stage first.
        """
        tier, default = slot.tier, [False] * len(keys)
        if not isinstance(tier, MemoryTier):
            with self._stages.take(len(keys)) as stage:
                rows = list(stage)
                pairs = [(torch.from_numpy(row), b) for row, b in zip(rows, blocks, strict=True)]
                if not await self._copy_blocks(pairs, "get"):
                    return default
                put = tier.put_hinted(keys, rows, cold) if cold else tier.put(keys, rows)
                return await self._call(slot, "put", put, default)
        start = time.perf_counter()
        stored = await tier.contains(keys)
        todo = [i for i, held in enumerate(stored) if not held]
        async with tier.reserve([keys[i] for i in todo]) as res:
            dsts = [torch.from_numpy(view) for view in res.views]
            copied = await self._copy_blocks(
                [(dst, blocks[i]) for dst, i in zip(dsts, todo, strict=False)], "get"
            )
            res.keep[:] = [copied] * len(dsts)
        for i in todo[: len(dsts)]:
            stored[i] = copied
        tier.counters.declined += len(todo) - len(dsts)
        tier.counters.observe("put", time.perf_counter() - start)
        return stored

    async def _copy_blocks(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], op: str) -> bool:
        """Copy pairs with one side an HBM block; return whether the copies landed.

        See `HBMTier.copy_views`. A failure counts against the HBM tier, under its `op`
        ("get": out of its blocks, "put": into them).
        """
        assert self._hbm is not None  # HBM views exist only with an HBM tier on top
        hbm = self._hbm

        async def copy() -> bool:
            await hbm.copy_views(pairs)
            return True

        return await self._call(self._slots[0], op, copy(), False)

    def _record_inserts(
        self,
        slot: Slot,
        keys: Sequence[ChunkKey],
        idxs: list[int],
        touched: Sequence[int] = (),
        keep: int | None = None,
    ) -> None:
        """Index the chunks `idxs` of `keys` as held by `slot`, and tell its policy.

        `touched` are chunks of the same request the tier held already: they are touched in
        the same pass, deepest chunk first, so a prefix ends more recent than its suffix
        even when the suffix is new (the leaf-first order eviction relies on). New chunks
        from `keep` on are inserted cold (the caller expects no reuse of them).
        """
        for i in idxs:
            if self._index.add(keys, i, slot.idx):
                self._stored(slot, keys[i])
        if slot.policy is not None:
            new = set(idxs)
            keep = len(keys) if keep is None else keep
            for i in sorted(new.union(touched), reverse=True):
                if i not in new:
                    slot.policy.touch(keys[i])
                elif i < keep:
                    slot.policy.insert(keys[i])
                else:
                    slot.policy.insert_cold(keys[i])

    async def _make_room(
        self, slot: Slot, count: int, protect: set[ChunkKey], cold_only: bool = False
    ) -> None:
        """Evict leaf chunks from a memory tier until `count` blocks are free (or none can go).

        With `cold_only`, only chunks stored cold go (room for more cold chunks).
        """
        tier, policy = slot.tier, slot.policy
        if not isinstance(tier, BlockTier) or policy is None:
            return
        while (need := count - tier.num_free_chunks) > 0:
            candidates = policy.cold_candidates() if cold_only else policy.candidates()
            victims = self._index.pick_leaves(
                candidates,
                slot.idx,
                need,
                lambda key: (
                    key in protect
                    or key in self._evicting
                    or key in self._pending
                    or tier.is_pinned(key)
                ),
            )
            if not victims:
                return
            await self._evict(slot, tier, victims)

    async def _evict(self, slot: Slot, tier: BlockTier[Any], victims: list[ChunkKey]) -> None:
        self._evicting.update(victims)
        try:
            below = self._slots[slot.idx + 1] if slot.idx + 1 < len(self._slots) else None
            if below is not None and below.config.write_policy == "write_back":
                async with tier.pinned(victims) as views:
                    held = [(k, v) for k, v in zip(victims, views, strict=True) if v is not None]
                    flags = await self._put(below, [k for k, _ in held], [v for _, v in held])
                landed = [key for (key, _), flag in zip(held, flags, strict=True) if flag]
                below.tier.counters.demotions += await self._index_copies(below, landed)
            await tier.delete(victims)
            assert slot.policy is not None
            for key in victims:
                self._drop(slot, key)
                slot.policy.evicted(key)
            tier.counters.evictions += len(victims)
        finally:
            self._evicting.difference_update(victims)

    async def _index_copies(self, slot: Slot, keys: Sequence[ChunkKey]) -> int:
        """Index `keys`, which a demotion or a write-through copy just put into `slot`.

        A key the index no longer knows was removed by a `clear` while the copy ran: with
        no chain left to index it under, it is deleted from the tier again, so no tier keeps
        a chunk the cache can neither find nor account for.

        Returns:
            The chunks indexed.
        """
        gone: list[ChunkKey] = []
        for key in keys:
            if self._index.mark(key, slot.idx):
                self._stored(slot, key)
            elif not self._index.tiers_of(key):
                gone.append(key)
        if gone:
            await self._call(slot, "delete", slot.tier.delete(gone), None)
            if slot.policy is not None:
                for key in gone:
                    slot.policy.remove(key)
        return len(keys) - len(gone)

    async def _caller_copy(self, copy: Awaitable[None], what: str) -> None:
        """Await a sink's delivery or a source's fill; a failure becomes `CallerCopyFailed`.

        Such a copy fails when a device copy does (an HBM tier's, or one into or out of
        the caller's GPU tensor). It counts as a failure of the top tier, whose blocks or
        copy stream it used, and is logged; the caller gets a shorter load, or a store of
        fewer chunks, never the exception. Bad input (a block table naming blocks the
        engine's KV lacks, say) still raises its `InvalidInputError`.
        """
        try:
            await copy
        except (InvalidInputError, CacheStateError):
            raise
        except Exception as exc:
            top = self._slots[0].tier
            self._log.warning(
                top.name,
                "kvtiers: copying chunks %s the caller's memory failed (%s); served as misses",
                what,
                type(exc).__name__,
                exc=exc,
            )
            top.counters.errors += 1
            raise CallerCopyFailed(str(exc)) from exc

    async def _call(self, slot: Slot, name: str, op: Awaitable[_T], default: _T) -> _T:
        """Await the tier operation `name`, turning a tier failure into `default` (misses).

        Any exception a tier raises counts: a backend error that escaped the tier's own
        translation must not reach the engine either. Cancellation still propagates; a
        `CancelledError` while this task is not being cancelled is the tier's own future
        cancelled under it (its close cancels requests not yet started), so a failure. The
        call's duration goes into the tier's latency histogram of `name`, failed or not.
        """
        start = time.perf_counter()
        try:
            return await op
        except (Exception, asyncio.CancelledError) as exc:
            task = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and (task is None or task.cancelling()):
                raise
            self._log.warning(
                slot.tier.name,
                "kvtiers: tier %s failed (%s); served as misses",
                slot.tier.name,
                type(exc).__name__,
                exc=exc,
            )
            slot.tier.counters.errors += 1
            return default
        finally:
            slot.tier.counters.observe(name, time.perf_counter() - start)

    def reap(self) -> None:
        """Drop the residencies that tiers evicting by themselves removed (see `_drop`)."""
        for slot in self._self_evicting:
            self._reap_slot(slot)

    def _reap_slot(self, slot: Slot) -> None:
        for key in slot.tier.take_evicted():
            self._drop(slot, key)

    def _stored(self, slot: Slot, key: ChunkKey) -> None:
        """Report that `key` became resident in `slot` (when events are on)."""
        if self._events is not None:
            self._events.append(ChunkStored(slot.tier.name, key, self._layout.chunk_size))

    def _drop(self, slot: Slot, key: ChunkKey) -> None:
        """Forget that `slot` holds `key`: evicted, a stale hint, or found corrupt.

        Only a residency the index knew is reported and remembered as evicted.
        """
        if not self._index.discard(key, slot.idx):
            return
        self._drops += 1
        evicted = self._evicted
        evicted.pop(key, None)
        evicted[key] = slot.tier.name
        if len(evicted) > _RECENTLY_EVICTED:
            del evicted[next(iter(evicted))]
        if self._events is not None:
            self._events.append(ChunkRemoved(slot.tier.name, key, self._layout.chunk_size))
