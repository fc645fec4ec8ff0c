"""Write-through queues: one bounded queue and one writer task per write-through tier."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvtiers._residency import Residency
from kvtiers._slot import Slot
from kvtiers.core.errors import CacheStateError
from kvtiers.core.keys import ChunkKey

__all__ = ["WriteQueues"]

logger = logging.getLogger("kvtiers")

_WRITE_BATCH = 64  # chunks a writer takes from its queue per tier call
_FAILED_KEPT = 65_536  # keys per tier whose failed copy a later hit may queue again


class WriteQueues(Residency):
    """Copy chunks placed in the top tier to every write-through tier, in the background.

    `store` enqueues keys (waiting when a queue is full: back-pressure); each writer takes
    batches, pins their top-tier blocks and puts them into its tier. A key is pending
    (never evicted from the top tier) until its copy is written or has failed.
    """

    _writers: tuple[asyncio.Task[None], ...] = ()  # set by `start`
    _stopped = False  # set by `stop`: nothing is queued any more

    def start(self, group: asyncio.TaskGroup) -> None:
        """Start one background writer per write-through tier in `group`."""
        writers = []
        for slot in self._through:
            slot.queue = asyncio.Queue(maxsize=self._queue_chunks)
            name = f"kvtiers-writer-{slot.tier.name}"
            writers.append(group.create_task(self._writer(slot), name=name))
        self._writers = tuple(writers)

    def stop(self) -> None:
        """Stop the writers now and drop what their queues hold (a close cut short).

        Calls waiting to queue a copy then raise `CacheStateError`; `flush` returns.
        """
        self._stopped = True
        for task in self._writers:
            task.cancel()
        for slot in self._through:
            queue = slot.queue
            while queue is not None and not queue.empty():
                key = queue.get_nowait()
                if key is not None:
                    slot.queued.discard(key)
                    self._release_pending(key)
                queue.task_done()
            slot.room.set()

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
                await self._put_job(slot, key)
                queued += 1
        finally:
            for slot, key in jobs[queued:]:
                slot.queued.discard(key)
                self._release_pending(key)

    async def _put_job(self, slot: Slot, key: ChunkKey) -> None:
        """Queue `key` for `slot`'s writer, waiting while the queue is full.

        Raises:
            CacheStateError: the writers were stopped (a close cut short) meanwhile.
        """
        queue = slot.queue
        assert queue is not None
        # NOTE: not `queue.put`: a put waiting on a full queue would wait forever once
        # `stop` has cancelled the writer that takes from it.
        while queue.full() and not self._stopped:
            slot.room.clear()
            await slot.room.wait()
        if self._stopped:
            raise CacheStateError("the cache was closed while this call queued copies")
        queue.put_nowait(key)

    def _queue_copies(self, slots: Sequence[Slot], keys: Sequence[ChunkKey]) -> None:
        """Queue copies of top-tier `keys` for the write-through `slots`, without waiting.

        Keys a slot holds or has queued, and keys no longer in the top tier, are skipped;
        so is the rest once a queue is full (a later hit may queue them).
        """
        for slot in slots:
            queue, bit = slot.queue, 1 << slot.idx
            if queue is None or self._stopped:
                continue
            for key in keys:
                if queue.full():
                    break
                mask = self._index.tiers_of(key)
                if mask & bit or not mask & 1 or key in slot.queued:
                    continue
                slot.queued.add(key)
                slot.failed.pop(key, None)
                self._pending[key] += 1
                queue.put_nowait(key)

    def _retry_failed(self, keys: Sequence[ChunkKey]) -> None:
        """Queue again the failed copies among top-tier hits `keys`.

        While the store is still failing, its breaker refuses the retry at once (and the
        key stays remembered); after the cool-down the retry is the breaker's probe.
        """
        for slot in self._through:
            if slot.failed:
                self._queue_copies([slot], [key for key in keys if key in slot.failed])

    def _remember_failed(self, slot: Slot, keys: Sequence[ChunkKey]) -> None:
        failed = slot.failed
        for key in keys:
            failed.pop(key, None)
            failed[key] = None
        while len(failed) > _FAILED_KEPT:
            del failed[next(iter(failed))]

    async def _writer(self, slot: Slot) -> None:
        queue = slot.queue
        assert queue is not None and self._memtop is not None
        while True:
            batch = [await queue.get()]
            while batch[-1] is not None and len(batch) < _WRITE_BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            slot.room.set()  # calls waiting on a full queue go on
            keys = [key for key in batch if key is not None]
            try:
                if keys:
                    failures = _failures(slot)
                    async with self._memtop.pinned(keys) as views:
                        held = [(k, v) for k, v in zip(keys, views, strict=True) if v is not None]
                        flags = await self._put(slot, [k for k, _ in held], [v for _, v in held])
                    landed = [key for (key, _), flag in zip(held, flags, strict=True) if flag]
                    await self._index_copies(slot, landed)
                    if _failures(slot) != failures:  # failed, not declined for want of room
                        lost = [k for (k, _), f in zip(held, flags, strict=True) if not f]
                        self._remember_failed(slot, lost)
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


def _failures(slot: Slot) -> int:
    """Return the tier's failed requests so far (errors and calls its breaker refused)."""
    counters = slot.tier.counters
    return counters.errors + counters.unavailable
