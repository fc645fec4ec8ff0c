"""The offline ceiling: Belady's farthest-next-use eviction, and the infinite cache.

Belady's rule (L. A. Belady, "A study of replacement algorithms for a virtual-storage
computer", IBM Systems Journal 5(2), 1966) evicts the block whose next use is farthest in
the future, blocks never used again first. It needs the future, so no online policy can run
it; it is the ceiling to compare policies against.

With prefix semantics it stays consistent: every request that uses a block also uses its
parent, so a parent's next use is never later than its child's; ties go to the deeper
block. The cache therefore never holds a suffix without its prefix, and a block hits exactly
when it is cached. It replays under the same rules as `replay` (offer every block, then
evict down to capacity), on plain integers, without the index.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from kvtiers.replay.simulate import PROGRESS_EVERY
from kvtiers.replay.trace import Trace

__all__ = ["OptimumResult", "ideal_hits", "optimum"]


@dataclass(frozen=True, slots=True)
class OptimumResult:
    """Belady's hits at one capacity."""

    capacity_blocks: int
    hits: int
    """Blocks served from cache."""
    total_blocks: int
    """Blocks requested, over all requests."""

    @property
    def hit_rate(self) -> float:
        """Return the share of requested blocks served from cache."""
        return self.hits / self.total_blocks if self.total_blocks else 0.0


def ideal_hits(trace: Trace) -> int:
    """Return the hits of an infinite cache: leading blocks of each request seen before."""
    seen = bytearray(trace.unique_blocks)
    hits = 0
    for ids in trace.requests:
        for i in ids:
            if not seen[i]:
                break
            hits += 1
        for i in ids:
            seen[i] = 1
    return hits


def optimum(
    trace: Trace, capacity_blocks: int, *, progress: Callable[[int], None] | None = None
) -> OptimumResult:
    """Replay `trace` through one tier that evicts by Belady's rule.

    Args:
        trace: the requests, replayed in order.
        capacity_blocks: blocks the tier holds.
        progress: called with the number of requests replayed since the last call.

    Returns:
        The hits at that capacity.
    """
    if capacity_blocks < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity_blocks}")
    next_uses = _next_uses(trace)
    depth_span = max((len(ids) for ids in trace.requests), default=0) + 1
    # A block's priority packs (next use, depth) into one int: heapq on ints is fast. The
    # heap is a max-heap by negation; an entry is stale once the block's priority changed.
    priority = [-1] * trace.unique_blocks  # -1: not cached
    heap: list[int] = []
    cached = hits = done = 0
    for r, ids in enumerate(trace.requests):
        for i in ids:
            if priority[i] < 0:
                break
            hits += 1
        for depth, (i, nxt) in enumerate(zip(ids, next_uses[r], strict=True)):
            if priority[i] < 0:
                cached += 1
            priority[i] = nxt * depth_span + depth
            heapq.heappush(heap, -priority[i] * _ID_SPAN - i)
        while cached > capacity_blocks:
            entry = -heapq.heappop(heap)
            i = entry % _ID_SPAN
            if priority[i] == entry // _ID_SPAN:
                priority[i] = -1
                cached -= 1
        done += 1
        if progress is not None and done == PROGRESS_EVERY:
            progress(done)
            done = 0
    if progress is not None and done:
        progress(done)
    return OptimumResult(capacity_blocks, hits, trace.total_blocks)


# NOTE: a heap entry is priority * _ID_SPAN + block id; ids stay below 2**40 in any trace
# that fits in memory.
_ID_SPAN = 1 << 40


def _next_uses(trace: Trace) -> list[list[int]]:
    """Return, per request and block, the index of the next request using it.

    A block never used again gets `num_requests`, later than any real use.
    """
    never = trace.num_requests
    upcoming = [never] * trace.unique_blocks
    out: list[list[int]] = [[] for _ in trace.requests]
    for r in range(trace.num_requests - 1, -1, -1):
        ids = trace.requests[r]
        out[r] = [upcoming[i] for i in ids]
        for i in ids:
            upcoming[i] = r
    return out
