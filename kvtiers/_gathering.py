"""Reading chunks through the tier cascade into a sink: promotions, staging, layer waves.

`Gatherer` is the load half of `Mover`: each chunk comes from the highest tier holding it,
lower-tier hits are promoted into the top memory tier, and a layer-wise load
(`LayerStream`) reads tiers that can read some layers wave by wave.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import Any, cast

import numpy as np
import torch

from kvtiers._endpoints import Sink
from kvtiers._slot import Slot, View
from kvtiers._streaming import LayerStream
from kvtiers._writes import WriteQueues
from kvtiers.core.keys import ChunkKey
from kvtiers.tiers._cancellation import wait_out
from kvtiers.tiers.base import Buffer
from kvtiers.tiers.blocks import BlockTier
from kvtiers.tiers.dram import MemoryTier

__all__ = ["Gatherer"]


class Gatherer(WriteQueues):
    """Deliver chunks from the tiers to a sink, promoting lower-tier hits."""

    async def _gather(self, keys: Sequence[ChunkKey], sink: Sink | None, done: list[bool]) -> None:
        """Deliver each chunk from the highest tier holding it, promoting lower-tier hits.

        First every lower tier reads, all at once, the chunks the index places highest in
        it (a load split between lmdb and a remote store waits for the slower of the two,
        not their sum; skipped with `concurrent_reads` off); then, tier by tier, what is
        left: chunks whose hint was stale, and chunks only a shared tier may hold (another
        process wrote them).
        """
        lower = self._slots[1:] if self._memtop is not None else self._slots
        if self._memtop is not None:
            await self._gather_top(keys, sink, done)
        plan: dict[int, list[int]] = {}
        for i, key in enumerate(keys if len(lower) > 1 and self._concurrent_reads else ()):
            mask = 0 if done[i] else self._index.tiers_of(key)
            for slot in lower:
                if mask & (1 << slot.idx):
                    plan.setdefault(slot.idx, []).append(i)
                    break
        if len(plan) > 1:
            await _all(
                [
                    self._gather_from(self._slots[idx], keys, todo, sink, done)
                    for idx, todo in plan.items()
                ]
            )
        for slot in lower:
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
                found = [view for view in views if view is not None]
                await self._caller_copy(sink.deliver(hits, found), "into")
        for i in hits:
            done[i] = True
        if hits:
            self._retry_failed([keys[i] for i in hits])
        num_hits = len(hits)
        top.tier.counters.read(num_hits, len(keys) - num_hits, num_hits * self._layout.chunk_bytes)
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
        kept: set[int] = set()  # chunks the tier returned that could not be copied up
        if self._memtop is None:
            found = await self._get_rest(slot, keys, todo, sink)
        else:
            found, kept = await self._promote_from(slot, keys, todo, sink)
        for i, flag in zip(todo, found, strict=True):
            if flag:
                done[i] = True
                # NOTE: only a shared tier's hits teach the index anything. The index knows
                # the other tiers' chunks exactly, and one this load read may have been
                # evicted meanwhile (it was read pinned): indexing it again would be a lie.
                if slot.tier.shared:
                    self._index.add(keys, i, slot.idx)
            elif i not in kept and not (
                isinstance(slot.tier, BlockTier) and slot.tier.holds(keys[i])
            ):
                # NOTE: a miss is as stale as a hit: a chunk evicted from a block tier just
                # as this load pinned it may be back there (put by a demotion or a write
                # since, and indexed again by it).
                self._drop(slot, keys[i])

    async def _promote_from(
        self, slot: Slot, keys: Sequence[ChunkKey], todo: list[int], sink: Sink | None
    ) -> tuple[list[bool], set[int]]:
        """Read chunks `todo` of `keys` from `slot` up into the top memory tier.

        Those that find no block there go straight to `sink`.

        Returns:
            Per chunk of `todo`, whether it was read, and the chunks the tier returned
            but that could not be copied up (it still holds them).
        """
        assert self._memtop is not None  # NOTE: the caller checks
        todo_keys = [keys[i] for i in todo]
        kept: set[int] = set()
        top = self._slots[0]
        # NOTE: room in the top tier may demote chunks into this tier (write-back), and
        # a tier that evicts by itself must not make that room from the chunks we read.
        slot.tier.touch(todo_keys)
        await self._make_room(top, len(todo), protect=set(keys))
        async with self._memtop.reserve(todo_keys) as res:
            num = len(res.views)
            # NOTE: the chunks that got a top-tier block and the rest are read at once,
            # so a load waits for one round of calls to this tier (one deadline of a
            # remote tier), not two in a row.
            (held, landed), rest_found = await _all(
                [
                    self._get_into(slot, todo_keys[:num], res.views, sink, todo[:num]),
                    self._get_rest(slot, keys, todo[num:], sink),
                ]
            )
            promoted = held if landed else [False] * num
            if not landed:
                # NOTE: the tier still holds these chunks; only the copy up failed.
                kept = {todo[j] for j, flag in enumerate(held) if flag}
            res.keep[:] = promoted
            hit = [j for j, flag in enumerate(promoted) if flag]
            if sink is not None:
                delivery = sink.deliver([todo[j] for j in hit], [res.views[j] for j in hit])
                await self._caller_copy(delivery, "into")
        self._record_inserts(top, keys, [todo[j] for j in hit])
        top.tier.counters.promotions += len(hit)
        # Write-through tiers above the source receive what it promoted (an lmdb
        # tier between the top and a remote pool becomes the node's copy of it).
        above = [s for s in self._through if s.idx < slot.idx]
        if above and hit:
            self._queue_copies(above, [todo_keys[j] for j in hit])
        return promoted + rest_found, kept

    async def _get_rest(
        self, slot: Slot, keys: Sequence[ChunkKey], rest: list[int], sink: Sink | None
    ) -> list[bool]:
        """Read chunks that got no top-tier block: into the caller's memory, or staged."""
        if not rest:
            return []
        direct = [sink.direct(i) for i in rest] if sink is not None else []
        if direct and all(d is not None for d in direct):
            # Straight into the caller's memory: one copy.
            dsts = [d for d in direct if d is not None]
            rest_keys = [keys[i] for i in rest]
            return await self._read(slot, rest_keys, dsts, sink, rest, in_place=True)
        return await self._get_staged(slot, keys, rest, sink)

    async def _read(
        self,
        slot: Slot,
        keys: list[ChunkKey],
        dsts: Sequence[Buffer],
        sink: Sink | None,
        idxs: list[int],
        *,
        in_place: bool = False,
    ) -> list[bool]:
        """Read `keys` (chunks `idxs` of the load) from `slot` into host buffers `dsts`.

        Whole chunks in one call, or, for a layer-wise load (`LayerStream`) from a tier
        that reads some layers only, wave by wave, each wave delivered as it arrives
        (`in_place`: `dsts` are the sink's own memory). The sink's later `deliver` of
        these chunks then copies nothing again.
        """
        if not isinstance(sink, LayerStream) or not slot.tier.layer_reads or not keys:
            found = await self._call(slot, "get", slot.tier.get(keys, dsts), [False] * len(keys))
            if isinstance(sink, LayerStream) and in_place:
                sink.delivered([i for i, hit in zip(idxs, found, strict=True) if hit])
            return found
        return await self._read_waves(slot, keys, dsts, sink, idxs, in_place=in_place)

    async def _read_waves(
        self,
        slot: Slot,
        keys: list[ChunkKey],
        dsts: Sequence[Buffer],
        sink: LayerStream,
        idxs: list[int],
        *,
        in_place: bool,
    ) -> list[bool]:
        """Read `keys` from `slot` wave by wave, delivering each wave to `sink` as it arrives."""

        # NOTE: the first wave is read alone, so it has the store to itself and arrives
        # first; then every other wave is asked for at once (a store answers each after
        # its own first byte, not after the waves before it) and each is delivered in
        # order as it arrives, for the chunks whose earlier waves all arrived.
        async def read(wave: int, which: list[int]) -> list[bool]:
            """Read wave `wave` of chunks `which` (positions in `keys`); flags aligned."""
            part = [keys[j] for j in which]
            op = slot.tier.get_layers(
                part, sink.waves[wave], [dsts[j] for j in which], tally=wave == 0
            )
            return await self._call(slot, "get", op, [False] * len(which))

        async def deliver(wave: int, live: list[int]) -> None:
            part = [idxs[j] for j in live]
            delivery = sink.deliver_wave(wave, part, [dsts[j] for j in live], in_place=in_place)
            await self._caller_copy(delivery, "into")

        every = list(range(len(keys)))
        first = await read(0, every)
        live = [j for j in every if first[j]]
        await deliver(0, live)
        # NOTE: later waves ask only for the chunks the first found (a miss or a bad object
        # is not asked for again).
        asked = live
        reads = [asyncio.ensure_future(read(w, asked)) for w in range(1, len(sink.waves)) if asked]
        try:
            for wave, task in enumerate(reads, start=1):
                got = dict(zip(asked, await task, strict=True))
                live = [j for j in live if got[j]]
                await deliver(wave, live)
        finally:
            await _reap(reads)
        found = [False] * len(keys)
        for j in live:
            found[j] = True
        return found

    async def _get_into(
        self,
        slot: Slot,
        keys: list[ChunkKey],
        views: Sequence[View],
        sink: Sink | None = None,
        idxs: list[int] | None = None,
    ) -> tuple[list[bool], bool]:
        """Read chunks from `slot` into top-tier block views.

        Host views (DRAM on top) are read into directly. HBM blocks are filled in one batch
        of copies on the HBM tier's stream: from a host block tier's (DRAM's) own blocks,
        pinned for the copy, or else from a stage the tier reads into.

        Returns:
            Per key, whether the tier holds the chunk, and whether the copies into the
            views landed (if not, no view holds a chunk).
        """
        if not keys:
            return [], True
        host = [v for v in views if isinstance(v, np.ndarray)]
        if len(host) == len(views):
            return await self._read(slot, keys, host, sink, idxs or []), True
        blocks = cast(list[torch.Tensor], views)
        if isinstance(slot.tier, MemoryTier):
            return await self._promote_blocks(slot.tier, keys, blocks)
        # NOTE: a reused stage: a fresh one faults in its pages on every load (a 36 MiB
        # promotion into HBM took 12-270 ms instead of 12-15). One call to the tier all the
        # same, however large the batch: a load waits for one round of it.
        with self._stages.take(len(keys)) as stage:
            default = [False] * len(keys)
            found = await self._call(slot, "get", slot.tier.get(keys, list(stage)), default)
            pairs = [
                (block, torch.from_numpy(row))
                for row, block, flag in zip(stage, blocks, found, strict=True)
                if flag
            ]
            return found, await self._copy_blocks(pairs, "put")

    async def _promote_blocks(
        self, tier: MemoryTier, keys: list[ChunkKey], blocks: list[torch.Tensor]
    ) -> tuple[list[bool], bool]:
        """Copy chunks from a host block tier's blocks into HBM blocks: one copy each.

        Returns:
            As `_get_into`.
        """
        start = time.perf_counter()
        async with tier.pinned(keys) as srcs:
            pairs = [
                (block, torch.from_numpy(src))
                for block, src in zip(blocks, srcs, strict=True)
                if src is not None
            ]
            copied = await self._copy_blocks(pairs, "put")
        held = [src is not None for src in srcs]
        hits = len(pairs) if copied else 0  # a failed copy is counted against the HBM tier
        tier.counters.read(hits, len(keys) - len(pairs), hits * self._layout.chunk_bytes)
        tier.counters.observe("get", time.perf_counter() - start)
        return held, copied

    async def _get_staged(
        self, slot: Slot, keys: Sequence[ChunkKey], idxs: list[int], sink: Sink | None
    ) -> list[bool]:
        found: list[bool] = []
        rows = self._stages.rows
        for lo in range(0, len(idxs), rows):
            part = idxs[lo : lo + rows]
            with self._stages.take(len(part)) as stage:
                bufs = list(stage)
                flags = await self._read(slot, [keys[i] for i in part], bufs, sink, part)
                hit = [j for j, flag in enumerate(flags) if flag]
                if sink is not None:
                    delivery = sink.deliver([part[j] for j in hit], [bufs[j] for j in hit])
                    await self._caller_copy(delivery, "into")
            found.extend(flags)
        return found


async def _all(aws: Sequence[Awaitable[Any]]) -> list[Any]:
    """Await `aws` at once and return their results in order.

    Unlike `asyncio.gather`, nothing outlives the call: when one fails (or the caller is
    cancelled) the others are cancelled and waited for before the error propagates, since
    they may still be copying into the caller's memory.
    """
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _reap(tasks)


async def _reap(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel the tasks not done yet and wait for all of them to end.

    Their own errors are dropped: the error that made the caller give up is the one that
    propagates.
    """
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    # NOTE: not `asyncio.wait`: a second cancellation of the caller would end that wait
    # while the branches still copy into its memory.
    if pending and await wait_out(pending):
        raise asyncio.CancelledError
    for task in tasks:
        if not task.cancelled():
            task.exception()
