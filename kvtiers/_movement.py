"""Moving chunks through the tier cascade: lookups, loads, stores and clears.

`Mover` answers the cache's calls on top of the residency bookkeeping (`Residency`) and the
write-through queues (`WriteQueues`); see those modules for the invariants it relies on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from kvtiers._endpoints import Sink, Source
from kvtiers._gathering import Gatherer
from kvtiers._residency import CallerCopyFailed
from kvtiers._slot import Slot
from kvtiers.core.keys import ChunkKey

__all__ = ["Mover"]

_CLEAR_BATCH = 1024  # keys per tier call when clearing


def _leading(flags: Sequence[bool]) -> int:
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


def _faults(slots: Sequence[Slot]) -> tuple[int, int, int, int]:
    """Return the tiers' running totals of what turns a chunk into a miss.

    Corrupt entries, entries of another layout, failures (tier calls that raised, the
    tiers' own failed requests to their stores, calls refused by an open breaker), and
    of those, requests that timed out. A miss reason compares two of these.
    """
    corrupt = foreign = failed = timeouts = 0
    for slot in slots:
        counters = slot.tier.counters
        corrupt += counters.corrupt
        foreign += counters.foreign
        failed += counters.errors + counters.unavailable
        timeouts += counters.timeouts
    return corrupt, foreign, failed, timeouts


def _fault_reason(before: tuple[int, ...], after: tuple[int, ...]) -> str | None:
    """Name what went wrong between two `_faults` totals (`None`: nothing)."""
    corrupt, foreign, failed, timeouts = (a - b for a, b in zip(after, before, strict=True))
    if corrupt:
        return "corrupt"
    if foreign:
        return "layout_mismatch"
    if timeouts:
        return "timeout"
    if failed:
        return "tier_unavailable"
    return None


class Mover(Gatherer):
    """Carry out lookups, loads, stores and evictions over the slots of one cache."""

    async def lookup(
        self, keys: Sequence[ChunkKey], other_salt: Callable[[], bool] | None = None
    ) -> int:
        """`longest_prefix`, counting in `miss_reasons` why the chunk after the hit was missed.

        Reasons: "timeout" (a request of a tier to its store got no answer in time),
        "tier_unavailable" (a tier call failed, a tier's request to its store failed, or
        its open breaker answered misses at once), "evicted" (the cache evicted or dropped
        the chunk recently; `evicted_from` counts the tier that dropped it last),
        "salt_mismatch" (a first chunk that `other_salt` says was stored under another
        salt), "never_stored" (nothing known of it).
        """
        before = _faults(self._slots)
        num_chunks = await self.longest_prefix(keys)
        if num_chunks < len(keys):
            reason = _fault_reason(before, _faults(self._slots))
            if reason is None:
                self.reap()  # so that a tier's own eviction counts as "evicted"
                reason = self._absence_reason(keys[num_chunks], num_chunks == 0, other_salt)
            self.miss_reasons[reason] += 1
        return num_chunks

    def _absence_reason(
        self, key: ChunkKey, first: bool, other_salt: Callable[[], bool] | None
    ) -> str:
        """Say why no tier held `key`, with no tier fault to blame."""
        dropped_by = self._evicted.get(key)
        if dropped_by is not None:
            self.evicted_from[dropped_by] += 1
            return "evicted"
        # NOTE: another salt changes every key of the chain, so such a miss is at chunk 0.
        if first and other_salt is not None and other_salt():
            return "salt_mismatch"
        return "never_stored"

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
            flags = await self._call(
                slot, "contains", slot.tier.contains(rest), [False] * len(rest)
            )
            for j, flag in enumerate(flags):
                if flag:
                    found[j] = True
                    self._index.add(keys, trusted + j, slot.idx)
                else:
                    self._drop(slot, rest[j])
        return trusted + _leading(found)

    def top_tiers(self, keys: Sequence[ChunkKey]) -> tuple[str, ...]:
        """Return the name of the highest tier holding each of `keys` (by the index).

        Meant for the hit of a `lookup`, whose keys the index then knows; a key no tier
        holds (evicted since) gets the empty name.
        """
        names = [slot.tier.name for slot in self._slots]
        tiers: list[str] = []
        for key in keys:
            mask = self._index.tiers_of(key)
            # NOTE: bit t is tier t, top first, so the lowest set bit is the highest tier.
            tiers.append(names[(mask & -mask).bit_length() - 1] if mask else "")
        return tuple(tiers)

    async def load(self, keys: Sequence[ChunkKey], sink: Sink) -> int:
        """Deliver the leading cached chunks of `keys` to `sink`; return how many.

        A load that delivers fewer chunks than the index knew of counts one miss reason:
        "corrupt" (a tier found an entry corrupt), "layout_mismatch" (an entry of another
        layout under the key), "timeout", "tier_unavailable" (as for `lookup`), or else
        "load_short".
        """
        before, drops = _faults(self._slots), self._drops
        done = [False] * len(keys)
        with contextlib.suppress(CallerCopyFailed):  # logged and counted: a shorter load
            await self._gather(keys, sink, done)
        loaded = _leading(done)
        # NOTE: decided after the fact, with no extra index walk on the hot path: the first
        # chunk not delivered was known if the index still holds it or this load dropped it.
        if loaded < len(keys) and (
            self._index.tiers_of(keys[loaded])
            or (self._drops != drops and keys[loaded] in self._evicted)
        ):
            self.miss_reasons[_fault_reason(before, _faults(self._slots)) or "load_short"] += 1
        return loaded

    async def gather(self, keys: Sequence[ChunkKey], sink: Sink) -> list[bool]:
        """Deliver every chunk of `keys` that some tier holds to `sink`; return which were.

        Unlike `load`, the keys need not be a prefix: each is served on its own.
        """
        done = [False] * len(keys)
        if keys:
            with contextlib.suppress(CallerCopyFailed):  # logged and counted: misses
                await self._gather(keys, sink, done)
        return done

    async def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Return, for each key on its own (not a chain), whether some tier holds it.

        Local tiers are answered from the index; the keys it places in no local tier are
        asked of the shared tiers (other processes write them). Pure query: the index is
        left as it was.
        """
        found = [bool(self._index.tiers_of(key) & self._local_bits) for key in keys]
        rest = [i for i, hit in enumerate(found) if not hit]
        for slot in self._shared:
            if not rest:
                break
            part = [keys[i] for i in rest]
            none = [False] * len(part)
            flags = await self._call(slot, "contains", slot.tier.contains(part), none)
            for i, flag in zip(rest, flags, strict=True):
                found[i] = flag
            rest = [i for i in rest if not found[i]]
        return found

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
            for lo in range(0, len(keys), _CLEAR_BATCH):
                part = keys[lo : lo + _CLEAR_BATCH]
                await self._call(slot, "delete", slot.tier.delete(part), None)
                for key in part:
                    self._drop(slot, key)
                    if slot.policy is not None:
                        slot.policy.remove(key)
            removed += len(keys)
        return removed

    async def prefetch(self, keys: Sequence[ChunkKey]) -> int:
        """Promote the cached prefix of `keys` into the top memory tier; return its chunks."""
        num_chunks = await self.longest_prefix(keys)
        if self._memtop is None:
            return num_chunks
        done = [False] * num_chunks
        await self._gather(keys[:num_chunks], None, done)
        return _leading(done)

    async def store(self, keys: Sequence[ChunkKey], source: Source, keep: int | None = None) -> int:
        """Place the chunks of `source` in the top tier and queue write-through copies.

        New chunks from `keep` on go into the top memory tier cold (evicted first).

        Returns:
            Chunks that no tier held before and one holds now. A copy out of `source`
            that failed ends the store with what was copied before it; a chunk no tier
            took (cold without room, every tier full of pinned chunks) is not counted.
        """
        new = await self._new_chunks(keys)
        # NOTE: a failed copy is logged and counted; what was copied before it stays.
        with contextlib.suppress(CallerCopyFailed):
            await self._place_top(keys, source, keep)
        new = [i for i in new if self._index.tiers_of(keys[i])]
        await self._enqueue(
            keys, [i for i, key in enumerate(keys) if self._index.tiers_of(key) & 1]
        )
        return len(new)

    async def _new_chunks(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Return the indices of the chunks no tier holds (shared tiers are asked)."""
        unknown = [i for i, key in enumerate(keys) if not self._index.tiers_of(key)]
        elsewhere: set[int] = set()
        for slot in self._shared:
            if not unknown:
                break
            ask = [keys[i] for i in unknown]
            flags = await self._call(slot, "contains", slot.tier.contains(ask), [False] * len(ask))
            for i, flag in zip(unknown, flags, strict=True):
                if flag:
                    elsewhere.add(i)
                    self._index.add(keys, i, slot.idx)
            unknown = [i for i in unknown if i not in elsewhere]
        return unknown

    async def _place_top(
        self, keys: Sequence[ChunkKey], source: Source, keep: int | None = None
    ) -> None:
        """Write the chunks missing from the top tier (those it cannot take, below it)."""
        top = self._slots[0]
        need = [i for i, key in enumerate(keys) if not self._index.tiers_of(key) & 1]
        placed: list[int] = []
        if self._memtop is not None and need:
            held = sorted(set(range(len(keys))).difference(need))
            # NOTE: cold chunks (past `keep`) get room only from other cold chunks; those
            # that find none go to the tiers below (see `HintedPolicy`).
            kept = len(need) if keep is None else sum(1 for i in need if i < keep)
            await self._make_room(top, kept, protect=set(keys))
            if kept < len(need):
                await self._make_room(top, len(need), protect=set(keys), cold_only=True)
            async with self._memtop.reserve([keys[i] for i in need]) as res:
                placed = need[: len(res.views)]
                await self._caller_copy(source.fill(placed, res.views), "out of")
            # NOTE: the chunks held already are touched too, or a prefix loaded (and
            # touched) before its new suffix was inserted would be older than that suffix.
            self._record_inserts(top, keys, placed, touched=held, keep=keep)
        overflow = need[len(placed) :]
        if overflow:
            cold = frozenset(keys[i] for i in overflow if keep is not None and i >= keep)
            await self._put_overflow(keys, source, overflow, cold)

    async def _put_overflow(
        self,
        keys: Sequence[ChunkKey],
        source: Source,
        idxs: list[int],
        cold: frozenset[ChunkKey] = frozenset(),
    ) -> None:
        """Write chunks the top memory tier could not take straight into the tiers below.

        `cold` are those past the caller's reuse hint (`Residency._put`).
        """
        start = 1 if self._memtop is not None else 0
        rows = self._stages.rows
        for lo in range(0, len(idxs), rows):
            part = idxs[lo : lo + rows]
            # NOTE: a lone chunk goes direct whatever its size: with no batch to pack, the
            # stage is a copy more (2.1 MiB chunks into lmdb, one per call: 2.57 -> 2.13 ms
            # a put, A/B; 256 KiB: 1.02 -> 0.98 ms).
            direct = [source.direct(i) for i in part] if self._direct_puts or len(idxs) == 1 else []
            if direct and all(buf is not None for buf in direct):
                # The caller's contiguous host bytes: the tiers read them in place.
                await self._place_below(keys, part, direct, start, cold)
                continue
            with self._stages.take(len(part)) as stage:
                await self._caller_copy(source.fill(part, list(stage)), "out of")
                await self._place_below(keys, part, stage, start, cold)

    async def _place_below(
        self,
        keys: Sequence[ChunkKey],
        part: list[int],
        stage: Any,
        start: int,
        cold: frozenset[ChunkKey],
    ) -> None:
        """Put staged chunks into the tiers from `start` down (see `_put_overflow`)."""
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
            flags = await self._put(slot, todo_keys, [stage[j] for j in todo], cold)
            for j, flag in zip(todo, flags, strict=True):
                if flag:
                    if self._index.add(keys, part[j], slot.idx):
                        self._stored(slot, keys[part[j]])
                    if j in left:
                        left.remove(j)
                        placed.append(j)
