"""Factories for the replay tests: trace slices, written traces, a reference simulator."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from kvtiers.eviction import make_policy
from kvtiers.replay import Trace, read_trace

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
CONVERSATION = TRACES / "conversation_trace.jsonl"
SYNTHETIC = TRACES / "synthetic_trace.jsonl"


def trace_head(path: Path, num_requests: int) -> Trace:
    """Return the first `num_requests` requests of a shipped trace."""
    return read_trace(path, limit=num_requests)


def write_lines(path: Path, records: Sequence[Any]) -> Path:
    """Write records as JSON lines (strings are written as they are) and return the path."""
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
        encoding="utf-8",
    )
    return path


def mooncake(hash_ids: list[int], timestamp: int = 0, block: int = 512) -> dict[str, Any]:
    """Return a Mooncake record whose input fills its blocks exactly."""
    return {
        "timestamp": timestamp,
        "input_length": block * len(hash_ids),
        "output_length": 10,
        "hash_ids": hash_ids,
    }


def trace_from_chains(path: Path, chains: Sequence[Sequence[int]]) -> Trace:
    """Write chains of ids as a Mooncake trace and read it back."""
    return read_trace(write_lines(path, [mooncake(list(c)) for c in chains]))


@st.composite
def random_chains(draw: st.DrawFn, max_requests: int = 40, max_fresh: int = 4) -> list[list[int]]:
    """Draw requests as paths of a random trie: each extends a random earlier prefix."""
    prefixes: list[list[int]] = [[]]
    next_id = 0
    chains: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_requests))):
        base = draw(st.sampled_from(prefixes))
        cut = draw(st.integers(0, len(base)))
        fresh = draw(st.integers(0 if cut else 1, max_fresh))
        chain = base[:cut] + list(range(next_id, next_id + fresh))
        next_id += fresh
        chains.append(chain)
        prefixes.append(chain)
    return chains


def reference_hits(trace: Trace, policy_name: str, capacity: int) -> int:
    """Replay `trace` in the plainest way: a set, a policy, branch-wise eviction.

    Every block of a request is offered, so the resident blocks are closed under prefix;
    a candidate goes with its branch, post-order, children oldest first (as resident).
    """
    policy = make_policy(policy_name, capacity)
    children: dict[int, dict[int, None]] = {}  # resident children, oldest first
    hits = 0

    def post_order(block: int) -> Iterator[int]:
        for child in list(children.get(block, ())):
            yield from post_order(child)
        yield block

    for ids in trace.requests:
        for i in ids:
            if i not in children:
                break
            hits += 1
        new = [i for i in ids if i not in children]
        for i in new:  # linked prefix first, as the index creates a missing path
            children[i] = {}
            if trace.parents[i] >= 0:
                children[trace.parents[i]][i] = None
        for i in reversed(ids):
            if i in new:
                policy.insert(i)
            else:
                policy.touch(i)
        while (need := len(children) - capacity) > 0:
            chosen: list[int] = []
            for key in policy.candidates():
                assert isinstance(key, int)
                for block in post_order(key):
                    if block not in chosen and len(chosen) < need:
                        chosen.append(block)
                if len(chosen) == need:
                    break
            for key in chosen:
                del children[key]
                policy.evicted(key)
                if trace.parents[key] >= 0:
                    children[trace.parents[key]].pop(key, None)
    return hits


def reference_lru_hits(trace: Trace, capacity: int) -> int:
    """Replay `trace` through an `OrderedDict` LRU, the textbook way."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in trace.requests:
        for i in ids:
            if i not in cache:
                break
            hits += 1
        for i in reversed(ids):
            cache[i] = None
            cache.move_to_end(i)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits
