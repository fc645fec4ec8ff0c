"""Moving chunks through the tier cascade: lookups, loads, stores, eviction, write queues.

Everything here runs on the cache's event loop, so the index, the policies and the pending
sets need no locks; the only suspension points are awaits on tiers and queues, and every
invariant that must hold across one is guarded: reserved blocks are invisible until
committed, pinned blocks are never reused, and chunks still queued for a write-through tier
(`_pending`) or being evicted (`_evicting`) are never chosen as victims.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import torch

from kvtiers._endpoints import Sink, Source
from kvtiers.core.config import TierConfig
from kvtiers.core.events import ChunkRemoved, ChunkStored, EventQueue
from kvtiers.core.index import PrefixIndex
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.eviction.base import EvictionPolicy
from kvtiers.tiers.base import Buffer, Tier
from kvtiers.tiers.blocks import BlockTier

__all__ = ["Mover", "Slot"]

logger = logging.getLogger("kvtiers")

_T = TypeVar("_T")
View = Buffer | torch.Tensor
"""A block view: host bytes (DRAM) or a device tensor (HBM)."""
_WRITE_BATCH = 64  # chunks a writer takes from its queue per tier call
_STAGE_BATCH = 32  # chunks staged in host memory at once when no block is free
_RECENTLY_EVICTED = 65_536  # keys remembered as evicted, to tell "evicted" from "never_stored"


@dataclass(slots=True, eq=False)
class Slot:
    """One tier in the cascade with the cache's state for it."""

    idx: int
    """Position, top first; also the tier's bit in index masks."""
    tier: Tier
    config: TierConfig
    policy: EvictionPolicy | None
    """The cache's eviction policy for it; `None` when the tier evicts by itself."""
    queue: asyncio.Queue[ChunkKey | None] | None = None
    """Write-through queue of chunk keys (`None` ends the writer)."""
    queued: set[ChunkKey] = field(default_factory=set)
    """Keys in the write-through queue or being written, so a key is queued once."""


def _leading(flags: Sequence[bool]) -> int:
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


class Mover:
    """Carry out lookups, loads, stores and evictions over the slots of one cache."""

    def __init__(
        self,
        layout: KVLayout,
        index: PrefixIndex,
        slots: list[Slot],
        queue_chunks: int,
        events: EventQueue | None = None,
    ) -> None:
        self._layout = layout
        self._events = events
        """Where residency changes go; `None` when events are off (nothing is allocated)."""
        self.miss_reasons: Counter[str] = Counter()
        """Per lookup or short load, why the first chunk not served was not (see `lookup`)."""
        # NOTE: a dict as a bounded insertion-ordered set: the oldest key goes first.
        self._evicted: dict[ChunkKey, None] = {}
        self._errors = 0  # tier calls failed so far (`_call`)
        self._drops = 0  # residencies dropped so far (`_drop`)
        self._index = index
        self._slots = slots
        self._queue_chunks = queue_chunks
        top = slots[0].tier
        self._memtop: BlockTier[Any] | None = top if isinstance(top, BlockTier) else None
        self._shared = [s for s in slots if s.tier.shared]
        # Index bits of tiers whose residency the index knows exactly (the cache evicts them).
        self._local_bits = sum(1 << s.idx for s in slots if not s.tier.shared)
        self._through = [s for s in slots[1:] if s.config.write_policy == "write_through"]
        self._pending: Counter[ChunkKey] = Counter()
        self._evicting: set[ChunkKey] = set()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, group: asyncio.TaskGroup) -> None:
        """Start one background writer per write-through tier in `group`."""
        for slot in self._through:
            slot.queue = asyncio.Queue(maxsize=self._queue_chunks)
            group.create_task(self._writer(slot), name=f"kvtiers-writer-{slot.tier.name}")

    async def drain(self) -> None:
        """Let every writer finish its queue, then stop."""
        for slot in self._through:
            if slot.queue is not None:
                await slot.queue.put(None)
        for slot in self._through:
            if slot.queue is not None:
                await slot.queue.join()

    async def flush(self) -> None:
        """Wait until every write-through queue is empty and its writes are done."""
        for slot in self._through:
            if slot.queue is not None:
                await slot.queue.join()

    def queued_chunks(self) -> int:
        """Return the chunks waiting in write-through queues."""
        return sum(s.queue.qsize() for s in self._through if s.queue is not None)

    # -- lookup ------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """`longest_prefix`, counting in `miss_reasons` why the chunk after the hit was missed.

        Reasons: "tier_error" (a tier call failed during the lookup), "evicted" (the cache
        evicted or dropped the chunk recently), "never_stored" (nothing known of it).
        """
        errors = self._errors
        num_chunks = await self.longest_prefix(keys)
        if num_chunks < len(keys):
            if self._errors != errors:
                reason = "tier_error"
            elif keys[num_chunks] in self._evicted:
                reason = "evicted"
            else:
                reason = "never_stored"
            self.miss_reasons[reason] += 1
        return num_chunks

    async def longest_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Return how many leading `keys` some tier holds.

        The index is trusted for tiers the cache evicts itself. From the first chunk that
        only a shared tier holds (by the index, a hint: such tiers evict on their own and
        other processes write them), the shared tiers are asked, and stale hints dropped.
        """
        match = self._index.match(keys)
        trusted = 0
        for mask in match.tiers:
            if not mask & self._local_bits:
                break
            trusted += 1
        if trusted == len(keys) or not self._shared:
            return match.num_chunks
        rest = keys[trusted:]
        found = [False] * len(rest)
        for slot in self._shared:
            flags = await self._call(slot, slot.tier.contains(rest), [False] * len(rest))
            for j, flag in enumerate(flags):
                if flag:
                    found[j] = True
                    self._index.add(keys, trusted + j, slot.idx)
                else:
                    self._drop(slot, rest[j])
        return trusted + _leading(found)

    # -- load --------------------------------------------------------------------------

    async def load(self, keys: Sequence[ChunkKey], sink: Sink) -> int:
        """Deliver the leading cached chunks of `keys` to `sink`; return how many.

        A load that delivers fewer chunks than the index knew of counts one miss reason:
        "corrupt" (a tier found an entry corrupt), "tier_error", or else "load_short".
        """
        corrupt, errors, drops = self._corrupt_count(), self._errors, self._drops
        done = [False] * len(keys)
        await self._gather(keys, sink, done)
        loaded = _leading(done)
        # NOTE: decided after the fact, with no extra index walk on the hot path: the first
        # chunk not delivered was known if the index still holds it or this load dropped it.
        if loaded < len(keys) and (
            self._index.tiers_of(keys[loaded])
            or (self._drops != drops and keys[loaded] in self._evicted)
        ):
            if self._corrupt_count() != corrupt:
                reason = "corrupt"
            elif self._errors != errors:
                reason = "tier_error"
            else:
                reason = "load_short"
            self.miss_reasons[reason] += 1
        return loaded

    async def gather(self, keys: Sequence[ChunkKey], sink: Sink) -> list[bool]:
        """Deliver every chunk of `keys` that some tier holds to `sink`; return which were.

        Unlike `load`, the keys need not be a prefix: each is served on its own.
        """
        done = [False] * len(keys)
        if keys:
            await self._gather(keys, sink, done)
        return done

    def held(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Return, for each key, whether the index knows a tier holding it."""
        return [bool(self._index.tiers_of(key)) for key in keys]

    async def clear(self) -> int:
        """Remove every chunk the index knows from every tier; return the residencies removed.

        Waits for the write-through queues first, so no queued write lands afterwards.
        """
        await self.flush()
        removed = 0
        for slot in self._slots:
            keys = list(self._index.keys_in(slot.idx))
            for lo in range(0, len(keys), _WRITE_BATCH * 16):
                part = keys[lo : lo + _WRITE_BATCH * 16]
                await self._call(slot, slot.tier.delete(part), None)
                for key in part:
                    self._drop(slot, key)
                    if slot.policy is not None:
                        slot.policy.remove(key)
            removed += len(keys)
        return removed

    def _corrupt_count(self) -> int:
        return sum(slot.tier.counters.corrupt for slot in self._slots)

    async def prefetch(self, keys: Sequence[ChunkKey]) -> int:
        """Promote the cached prefix of `keys` into the top memory tier; return its chunks."""
        num_chunks = await self.longest_prefix(keys)
        if self._memtop is None:
            return num_chunks
        done = [False] * num_chunks
        await self._gather(keys[:num_chunks], None, done)
        return _leading(done)

    async def _gather(self, keys: Sequence[ChunkKey], sink: Sink | None, done: list[bool]) -> None:
        """Deliver each chunk from the highest tier holding it, promoting lower-tier hits."""
        start = 0
        if self._memtop is not None:
            await self._gather_top(keys, sink, done)
            start = 1
        for slot in self._slots[start:]:
            bit = 1 << slot.idx
            todo = [
                i
                for i, key in enumerate(keys)
                if not done[i] and (slot.tier.shared or self._index.tiers_of(key) & bit)
            ]
            if todo:
                await self._gather_from(slot, keys, todo, sink, done)

    async def _gather_top(
        self, keys: Sequence[ChunkKey], sink: Sink | None, done: list[bool]
    ) -> None:
        top = self._slots[0]
        assert self._memtop is not None
        async with self._memtop.pinned(keys) as views:
            hits = [i for i, view in enumerate(views) if view is not None]
            if sink is not None:
                await sink.deliver(hits, [view for view in views if view is not None])
        for i in hits:
            done[i] = True
        counters = top.tier.counters
        counters.hits += len(hits)
        counters.misses += len(keys) - len(hits)
        counters.bytes_read += len(hits) * self._layout.chunk_bytes
        if top.policy is not None:
            # NOTE: deepest chunk first, so a prefix is always more recent than its suffix.
            for i in reversed(hits):
                top.policy.touch(keys[i])

    async def _gather_from(
        self,
        slot: Slot,
        keys: Sequence[ChunkKey],
        todo: list[int],
        sink: Sink | None,
        done: list[bool],
    ) -> None:
        todo_keys = [keys[i] for i in todo]
        found: list[bool] = []
        if self._memtop is not None:
            top = self._slots[0]
            await self._make_room(top, len(todo), protect=set(keys))
            async with self._memtop.reserve(todo_keys) as res:
                num = len(res.views)
                found = await self._get_into(slot, todo_keys[:num], res.views)
                res.keep[:] = found
                hit = [j for j, flag in enumerate(found) if flag]
                if sink is not None:
                    await sink.deliver([todo[j] for j in hit], [res.views[j] for j in hit])
            self._record_inserts(top, keys, [todo[j] for j in hit])
            top.tier.counters.promotions += len(hit)
        rest = todo[len(found) :]
        direct = [sink.direct(i) for i in rest] if sink is not None else []
        if rest and direct and all(d is not None for d in direct):
            # Straight into the caller's memory: one copy.
            dsts = [d for d in direct if d is not None]
            rest_keys = [keys[i] for i in rest]
            found += await self._call(slot, slot.tier.get(rest_keys, dsts), [False] * len(rest))
        elif rest:
            found += await self._get_staged(slot, keys, rest, sink)
        for i, flag in zip(todo, found, strict=True):
            if flag:
                done[i] = True
                self._index.add(keys, i, slot.idx)
            else:
                self._drop(slot, keys[i])

    async def _get_into(
        self, slot: Slot, keys: list[ChunkKey], views: Sequence[View]
    ) -> list[bool]:
        """Read chunks from `slot` into block views, staging through host memory for device
        blocks (a tier reads into host buffers)."""
        default = [False] * len(keys)
        host = [v for v in views if isinstance(v, np.ndarray)]
        if len(host) == len(views):
            return await self._call(slot, slot.tier.get(keys, host), default)
        stage = np.empty((len(keys), self._layout.chunk_bytes), dtype=np.uint8)
        found = await self._call(slot, slot.tier.get(keys, list(stage)), default)
        for row, view, flag in zip(stage, views, found, strict=True):
            if flag and isinstance(view, torch.Tensor):
                view.copy_(torch.from_numpy(row))
        return found

    async def _get_staged(
        self, slot: Slot, keys: Sequence[ChunkKey], idxs: list[int], sink: Sink | None
    ) -> list[bool]:
        found: list[bool] = []
        for lo in range(0, len(idxs), _STAGE_BATCH):
            part = idxs[lo : lo + _STAGE_BATCH]
            stage = np.empty((len(part), self._layout.chunk_bytes), dtype=np.uint8)
            bufs = list(stage)
            flags = await self._call(
                slot, slot.tier.get([keys[i] for i in part], bufs), [False] * len(part)
            )
            hit = [j for j, flag in enumerate(flags) if flag]
            if sink is not None:
                await sink.deliver([part[j] for j in hit], [bufs[j] for j in hit])
            found.extend(flags)
        return found

    # -- store -------------------------------------------------------------------------

    async def store(self, keys: Sequence[ChunkKey], source: Source) -> int:
        """Place the chunks of `source` in the top tier and queue write-through copies.

        Returns:
            Chunks that no tier held before.
        """
        new = await self._count_new(keys)
        placed = await self._place_top(keys, source)
        await self._enqueue(keys, placed)
        return new

    async def _count_new(self, keys: Sequence[ChunkKey]) -> int:
        unknown = [i for i, key in enumerate(keys) if not self._index.tiers_of(key)]
        elsewhere: set[int] = set()
        for slot in self._shared:
            if not unknown:
                break
            ask = [keys[i] for i in unknown]
            flags = await self._call(slot, slot.tier.contains(ask), [False] * len(ask))
            for i, flag in zip(unknown, flags, strict=True):
                if flag:
                    elsewhere.add(i)
                    self._index.add(keys, i, slot.idx)
            unknown = [i for i in unknown if i not in elsewhere]
        return len(unknown)

    async def _place_top(self, keys: Sequence[ChunkKey], source: Source) -> list[int]:
        """Write the chunks missing from the top tier; return the indices it holds now."""
        top = self._slots[0]
        need = [i for i, key in enumerate(keys) if not self._index.tiers_of(key) & 1]
        placed: list[int] = []
        if self._memtop is not None and need:
            await self._make_room(top, len(need), protect=set(keys))
            async with self._memtop.reserve([keys[i] for i in need]) as res:
                placed = need[: len(res.views)]
                await source.fill(placed, res.views)
            self._record_inserts(top, keys, placed)
        overflow = need[len(placed) :]
        if overflow:
            await self._put_overflow(keys, source, overflow)
        return [i for i, key in enumerate(keys) if self._index.tiers_of(key) & 1]

    async def _put_overflow(
        self, keys: Sequence[ChunkKey], source: Source, idxs: list[int]
    ) -> None:
        """Write chunks the top memory tier could not take straight into the tiers below."""
        start = 1 if self._memtop is not None else 0
        for lo in range(0, len(idxs), _STAGE_BATCH):
            part = idxs[lo : lo + _STAGE_BATCH]
            stage = np.empty((len(part), self._layout.chunk_bytes), dtype=np.uint8)
            await source.fill(part, list(stage))
            # Each chunk goes to the first tier below that takes it, and to every
            # write-through tier under that one, so those still hold all that was stored.
            left = list(range(len(part)))
            placed: list[int] = []
            for slot in self._slots[start:]:
                through = slot.config.write_policy == "write_through"
                todo = sorted(set(left) | set(placed)) if through else list(left)
                if not todo:
                    continue
                todo_keys = [keys[part[j]] for j in todo]
                flags = await self._put(slot, todo_keys, [stage[j] for j in todo])
                for j, flag in zip(todo, flags, strict=True):
                    if flag:
                        if self._index.add(keys, part[j], slot.idx):
                            self._stored(slot, keys[part[j]])
                        if j in left:
                            left.remove(j)
                            placed.append(j)

    async def _enqueue(self, keys: Sequence[ChunkKey], placed: list[int]) -> None:
        if self._memtop is None:
            return
        jobs: list[tuple[Slot, ChunkKey]] = []
        for slot in self._through:
            bit = 1 << slot.idx
            for i in placed:
                key = keys[i]
                if not self._index.tiers_of(key) & bit and key not in slot.queued:
                    slot.queued.add(key)
                    jobs.append((slot, key))
        # NOTE: mark every job pending before the first await, so no chunk can be evicted from
        # the top tier between being placed there and being queued.
        for _, key in jobs:
            self._pending[key] += 1
        queued = 0
        try:
            for slot, key in jobs:
                assert slot.queue is not None
                await slot.queue.put(key)
                queued += 1
        finally:
            for slot, key in jobs[queued:]:
                slot.queued.discard(key)
                self._release_pending(key)

    def _release_pending(self, key: ChunkKey) -> None:
        self._pending[key] -= 1
        if self._pending[key] <= 0:
            del self._pending[key]

    async def _writer(self, slot: Slot) -> None:
        queue = slot.queue
        assert queue is not None and self._memtop is not None
        while True:
            batch = [await queue.get()]
            while batch[-1] is not None and len(batch) < _WRITE_BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            keys = [key for key in batch if key is not None]
            try:
                if keys:
                    async with self._memtop.pinned(keys) as views:
                        held = [(k, v) for k, v in zip(keys, views, strict=True) if v is not None]
                        flags = await self._put(slot, [k for k, _ in held], [v for _, v in held])
                    for (key, _), flag in zip(held, flags, strict=True):
                        if flag and self._index.mark(key, slot.idx):
                            self._stored(slot, key)
            except Exception:  # a writer must outlive any one failed batch
                logger.exception("kvtiers: write-through to %s failed", slot.tier.name)
                slot.tier.counters.errors += len(keys)
            finally:
                for key in keys:
                    slot.queued.discard(key)
                    self._release_pending(key)
                for _ in batch:
                    queue.task_done()
            if batch[-1] is None:
                return

    # -- eviction ----------------------------------------------------------------------

    async def _put(self, slot: Slot, keys: list[ChunkKey], views: Sequence[View]) -> list[bool]:
        """Put chunks into a tier, first making room when the cache evicts for it.

        Device views (HBM blocks) are copied to host memory first: tiers take host buffers.
        """
        if not keys:
            return []
        srcs = [v.cpu().numpy() if isinstance(v, torch.Tensor) else v for v in views]
        if isinstance(slot.tier, BlockTier):
            await self._make_room(slot, len(keys), protect=set(keys))
        flags = await self._call(slot, slot.tier.put(keys, srcs), [False] * len(keys))
        if slot.policy is not None:
            for key, flag in zip(reversed(keys), reversed(flags), strict=True):
                if flag:
                    slot.policy.insert(key)
        return flags

    def _record_inserts(self, slot: Slot, keys: Sequence[ChunkKey], idxs: list[int]) -> None:
        for i in idxs:
            if self._index.add(keys, i, slot.idx):
                self._stored(slot, keys[i])
        if slot.policy is not None:
            for i in reversed(idxs):
                slot.policy.insert(keys[i])

    async def _make_room(self, slot: Slot, count: int, protect: set[ChunkKey]) -> None:
        """Evict leaf chunks from a memory tier until `count` blocks are free (or none can go)."""
        tier, policy = slot.tier, slot.policy
        if not isinstance(tier, BlockTier) or policy is None:
            return
        while (need := count - tier.num_free_chunks) > 0:
            victims = self._pick_victims(slot, tier, policy, need, protect)
            if not victims:
                return
            await self._evict(slot, tier, victims)

    def _pick_victims(
        self,
        slot: Slot,
        tier: BlockTier[Any],
        policy: EvictionPolicy,
        need: int,
        protect: set[ChunkKey],
    ) -> list[ChunkKey]:
        # NOTE: only leaves of this tier go, so no tier holds a suffix without its prefix;
        # a parent counts as a leaf once all its children in this tier are already picked.
        gone: Counter[ChunkKey] = Counter()
        victims: list[ChunkKey] = []
        for candidate in policy.candidates():
            key = cast(ChunkKey, candidate)
            if (
                key in protect
                or key in self._evicting
                or key in self._pending
                or tier.is_pinned(key)
                or self._index.children_in(key, slot.idx) > gone[key]
            ):
                continue
            victims.append(key)
            parent = self._index.parent_of(key)
            if parent is not None:
                gone[parent] += 1
            if len(victims) >= need:
                break
        return victims

    async def _evict(self, slot: Slot, tier: BlockTier[Any], victims: list[ChunkKey]) -> None:
        self._evicting.update(victims)
        try:
            below = self._slots[slot.idx + 1] if slot.idx + 1 < len(self._slots) else None
            if below is not None and below.config.write_policy == "write_back":
                async with tier.pinned(victims) as views:
                    held = [(k, v) for k, v in zip(victims, views, strict=True) if v is not None]
                    flags = await self._put(below, [k for k, _ in held], [v for _, v in held])
                for (key, _), flag in zip(held, flags, strict=True):
                    if flag:
                        if self._index.mark(key, below.idx):
                            self._stored(below, key)
                        below.tier.counters.demotions += 1
            await tier.delete(victims)
            assert slot.policy is not None
            for key in victims:
                self._drop(slot, key)
                slot.policy.evicted(key)
            tier.counters.evictions += len(victims)
        finally:
            self._evicting.difference_update(victims)

    async def _call(self, slot: Slot, op: Awaitable[_T], default: _T) -> _T:
        """Await a tier operation, turning a tier failure into `default` (misses).

        Any exception a tier raises counts: a backend error that escaped the tier's own
        translation must not reach the engine either. Cancellation still propagates.
        """
        try:
            return await op
        except Exception:
            logger.warning(
                "kvtiers: tier %s failed; served as misses", slot.tier.name, exc_info=True
            )
            slot.tier.counters.errors += 1
            self._errors += 1
            return default

    # -- events ------------------------------------------------------------------------

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
        evicted[key] = None
        if len(evicted) > _RECENTLY_EVICTED:
            del evicted[next(iter(evicted))]
        if self._events is not None:
            self._events.append(ChunkRemoved(slot.tier.name, key, self._layout.chunk_size))
