"""Eviction policies on the real Mooncake traces: hit rates against LRU and the optimum.

Replays `tests/data/traces/conversation_trace.jsonl` and `synthetic_trace.jsonl` (512-token
blocks, prefix semantics, index-only) at 5% and 10% of each trace's unique blocks through
every shipped policy, and Belady's offline optimum at the same capacities. Each policy's
row reads its block hit rate against LRU's (the baseline); the best policy's target is to
close half of the LRU-to-optimum gap. An informative row shows LRU given a dead-block
oracle (it drops blocks that are never used again): how much of the gap is about knowing
which blocks have a future. Each policy is replayed again with reuse hints
(`kvtiers.replay.hints`, `TieredCache.store`'s `keep_tokens`): `+turns` keeps a prompt
that a later request continues, what an application that knows whether a conversation
goes on can say; the best hinted policy has the same target. Two more rows give LRU the
exact hint (`+future`: the blocks a later request shares) and turn hints wrong for 20% of
the requests. One more row times the whole conversation replay.

Run alone: `python -m benchmarks.bench_policies [--quick]` (`--quick` replays the first
3,000 and 1,500 requests).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

from benchmarks._common import Result, Target, main
from kvtiers.eviction import available_policies
from kvtiers.replay import (
    ReplayReport,
    RunResult,
    Trace,
    build_report,
    read_trace,
    replay,
    single_tier,
)
from kvtiers.replay.hints import flip_hints, future_hints, hints_for, turn_hints

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces"
SHARES = (0.05, 0.10)


def policy_order() -> list[str]:
    """Return LRU first, then the other shipped policies."""
    return sorted(available_policies(), key=lambda name: name != "lru")


def dead_block_oracle_hits(trace: Trace, capacity: int) -> int:
    """Return the hits of LRU that never keeps a block without a future use (not a policy)."""
    uses_left = [0] * trace.unique_blocks
    for ids in trace.requests:
        for i in ids:
            uses_left[i] += 1
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in trace.requests:
        for i in ids:
            if i not in cache:
                break
            hits += 1
        for i in reversed(ids):
            uses_left[i] -= 1
            if uses_left[i]:
                cache[i] = None
                cache.move_to_end(i)
            else:
                cache.pop(i, None)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def run(quick: bool) -> list[Result]:
    """Replay both traces at both capacities through every policy and the optimum."""
    results: list[Result] = []
    for name, quick_requests in (("conversation", 3_000), ("synthetic", 1_500)):
        trace = read_trace(TRACES / f"{name}_trace.jsonl", limit=quick_requests if quick else None)
        capacities = [int(share * trace.unique_blocks) for share in SHARES]
        cascades = [single_tier(c, p) for c in capacities for p in policy_order()]
        start = time.perf_counter()
        report = build_report(trace, cascades, hints=hints_for(trace, "turns"))
        seconds = time.perf_counter() - start
        for share, capacity in zip(SHARES, capacities, strict=True):
            label = f"{name} {share:.0%} ({capacity:,} blocks)"
            results += capacity_rows(report, label, capacity)
            results += hint_rows(report, label, capacity)
        if name == "conversation":
            results.append(
                Result.of_times(
                    f"replay {trace.num_requests:,} requests: {len(report.runs)} runs + optimum",
                    seconds,
                    None,
                    unit="s",
                    target=Target("value", "<", 60.0),
                )
            )
    return results


def capacity_rows(report: ReplayReport, label: str, capacity: int) -> list[Result]:
    """Return each policy's row, the oracle's and the optimum's at one capacity."""
    runs = [r for r in report.runs if r.capacity_blocks == capacity]
    lru = next(r for r in runs if r.policy == "lru")
    best = report.optimum_at(capacity)
    assert best is not None
    half_way = lru.hit_rate + (best.hit_rate - lru.hit_rate) / 2
    best_runs = [
        max((r for r in runs if ("+" in r.policy) == hinted), key=lambda r: r.hits)
        for hinted in (False, True)
    ]
    goal = Target("value", ">=", 100 * half_way)
    rows = []
    for run_ in runs:
        if run_.policy == "lru":
            continue
        gap = report.gap_closed(run_)
        rows.append(
            vs_lru(
                f"{label}: {run_.policy} hit rate",
                run_.hit_rate,
                lru,
                f"optimum {best.hit_rate:.2%}; gap closed {0.0 if gap is None else gap:.1%}",
                goal if any(run_ is b for b in best_runs) else None,
            )
        )
    trace = report.trace
    oracle = dead_block_oracle_hits(trace, capacity) / trace.total_blocks
    rows.append(
        vs_lru(
            f"{label}: LRU + dead-block oracle",
            oracle,
            lru,
            "not a policy: it knows which blocks are never used again",
        )
    )
    rows.append(
        vs_lru(
            f"{label}: optimum (Belady)",
            best.hit_rate,
            lru,
            f"ideal (infinite cache) {report.ideal_hit_rate:.2%}",
        )
    )
    return rows


def hint_rows(report: ReplayReport, label: str, capacity: int) -> list[Result]:
    """Return LRU's rows with exact hints and with a fifth of the turn hints wrong."""
    trace = report.trace
    lru = next(r for r in report.runs if r.capacity_blocks == capacity and r.policy == "lru")
    turns = turn_hints(trace)
    rows = []
    for what, hints in (
        ("LRU+future (exact hints)", future_hints(trace)),
        ("LRU+turns, 20% of hints wrong", flip_hints(trace, turns, 0.2, seed=1)),
    ):
        run_ = replay(trace, single_tier(capacity, "lru"), hints=hints)
        gap = report.gap_closed(run_)
        rows.append(vs_lru(f"{label}: {what}", run_.hit_rate, lru, f"gap closed {gap or 0.0:.1%}"))
    return rows


def vs_lru(
    name: str, rate: float, lru: RunResult, notes: str, target: Target | None = None
) -> Result:
    """Return the row of a hit rate against LRU's, in percent of the blocks requested."""
    base = 100 * lru.hit_rate
    return Result.of_rates(
        f"{name} vs LRU", 100 * rate, base, unit="% blocks", target=target, notes=notes
    )


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
