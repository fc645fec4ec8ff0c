"""Reuse hints for a replay: what a caller would tell the cache about each request's future.

`TieredCache.store(..., keep_tokens=n)` takes the caller's word that only the first `n`
tokens of a prompt will be asked for again; the chunks past them are stored cold, evicted
first (`HintedPolicy`). A trace records no such words, so these functions derive them from
the trace's own future, to show what hints of a given quality would buy:

- `turn_hints`: the whole prompt when a later request continues it (starts with all its
  blocks but the last, which the next turn's longer text replaces), else nothing. What a
  chat application that knows whether a conversation goes on, or an agent that knows its
  next call extends this context, can say.
- `future_hints`: exactly the leading blocks some later request shares. The best hint there
  is: its hit rate is the ceiling of what hints can give.
- `flip_hints`: hints with a share of the requests' words wrong, for the cost of mistakes.

Each returns one count of blocks per request, aligned with `Trace.requests`, for
`replay(..., hints=...)`; `hints_for` wraps them by name for `build_report` and
`kvtiers replay --hints`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvtiers.replay.trace import Trace

__all__ = ["HINTS", "ReuseHints", "flip_hints", "future_hints", "hints_for", "turn_hints"]

#: The hint sources `kvtiers replay --hints` accepts.
HINTS = ("turns", "future")


@dataclass(frozen=True, slots=True)
class ReuseHints:
    """Named reuse hints for a trace."""

    source: str
    """Where they come from (one of `HINTS`); hinted runs are reported as `<policy>+<source>`."""
    blocks: tuple[int, ...]
    """Per request, the leading blocks expected to be requested again."""


def future_hints(trace: Trace) -> list[int]:
    """Return, per request, the leading blocks that some later request also asks for.

    A block id fixes its whole prefix, so when a later request holds block `i` of this one
    it holds every block before it too: the count is one past the last block used again.
    """
    last_use = [0] * trace.unique_blocks
    for r, ids in enumerate(trace.requests):
        for i in ids:
            last_use[i] = r
    hints = []
    for r, ids in enumerate(trace.requests):
        keep = len(ids)
        while keep and last_use[ids[keep - 1]] <= r:
            keep -= 1
        hints.append(keep)
    return hints


def turn_hints(trace: Trace) -> list[int]:
    """Return, per request, all its blocks if a later request continues it, else 0.

    A request is continued when a later one shares all its blocks but the last (a one-block
    request: that block).
    """
    return [
        len(ids) if shared >= max(1, len(ids) - 1) else 0
        for ids, shared in zip(trace.requests, future_hints(trace), strict=True)
    ]


def flip_hints(trace: Trace, hints: Sequence[int], share: float, seed: int = 0) -> list[int]:
    """Return `hints` with the word on a random `share` of the requests turned around.

    A flipped request that was to be kept (a hint above 0) gets 0; one that was not gets
    all its blocks.

    Raises:
        ValueError: `share` is not between 0 and 1.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be between 0 and 1, got {share}")
    rng = random.Random(seed)
    flipped = list(hints)
    for r in rng.sample(range(trace.num_requests), round(share * trace.num_requests)):
        flipped[r] = 0 if flipped[r] else len(trace.requests[r])
    return flipped


def hints_for(trace: Trace, source: str) -> ReuseHints:
    """Return the hints named `source` (one of `HINTS`).

    Raises:
        ValueError: an unknown source.
    """
    if source == "turns":
        return ReuseHints(source, tuple(turn_hints(trace)))
    if source == "future":
        return ReuseHints(source, tuple(future_hints(trace)))
    raise ValueError(f"unknown hints {source!r}; expected one of {', '.join(HINTS)}")
