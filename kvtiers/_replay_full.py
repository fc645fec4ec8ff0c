"""The replay's full mode: a trace through a real, opened `TieredCache`, real bytes stored.

The index-only mode (`kvtiers.replay`) counts blocks in the library's own index and
policies. This mode builds a `TieredCache` of the same tier cascade, with a small layout,
and for each request, in file order, one at a time, does what an engine does:

1. `lookup_keys`, then `get_chunks` of the hit prefix (timed together). Every block read is
   compared with the bytes it was stored with: a block's payload is a function of its key,
   so a wrong block, or a right block with bytes out of place, is a verification failure.
2. `put_chunks` of every block of the request (timed), with the request's reuse hint
   (`keep_chunks`) when the replay has hints.
3. `flush` (timed), so that write-through copies, and the evictions they cause, are done
   before the next request: the run is deterministic.

Blocks are keyed by the cache itself: a Mooncake id names a block and its whole prefix, so
ids are already chained hashes (`chunk_keys`); a token trace's prompts go through the
cache's own chained hashing (`keys`, with the request's salt).

Tiers that write outside the process get fresh places in a temporary directory, removed
after the run: an lmdb tier a new path, a remote tier a `file://` URL. A full replay never
writes into a configured store; tier kinds it cannot move (a Redis or Mooncake pool, any
plugin) are refused.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from kvtiers.cache import TieredCache
from kvtiers.core.config import CacheConfig, TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import KEY_BYTES, ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierStats
from kvtiers.replay import (
    ReuseHints,
    RunResult,
    TierResult,
    TierSpec,
    Trace,
    TraceError,
    read_prompts,
)
from kvtiers.tiers import _chunk_format as fmt

__all__ = ["DEFAULT_BLOCK_BYTES", "FullRun", "replay_full", "replay_layout", "sandbox_config"]

#: Bytes of one stored block unless the caller picks another size.
DEFAULT_BLOCK_BYTES = 4096
#: Tier kinds a full replay can run without touching a configured store.
SANDBOXED_KINDS = ("dram", "hbm", "lmdb", "remote")
_PROGRESS_EVERY = 64  # requests between two progress callbacks


@dataclass(frozen=True, slots=True)
class FullRun:
    """The outcome of replaying one trace through one real cache."""

    run: RunResult
    """Hits per tier and per request, in the index-only mode's shape."""
    tiers: tuple[TierStats, ...]
    """Each tier's counters at the end (the cache is fresh for every run)."""
    lookup_load_s: array[float]
    """Per request, seconds of `lookup_keys` and `get_chunks` of its hit prefix."""
    store_s: array[float]
    """Per request, seconds of `put_chunks` of all its blocks."""
    flush_s: array[float]
    """Per request, seconds of the `flush` after its store (write-through copies)."""
    verify_failures: int
    """Blocks loaded with other bytes than were stored under their key; 0 unless a bug."""
    short_loads: int
    """Requests whose load delivered fewer leading blocks than their lookup found (a
    corrupt or vanished entry: the rest are misses)."""
    miss_reasons: dict[str, int]
    """Why lookups and loads fell short (`CacheStats.miss_reasons`)."""
    seconds: float
    """Wall time of the whole run, opening and closing the cache included."""


def replay_layout(block_tokens: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> KVLayout:
    """Return the small layout of a full replay: one layer, K and V, one uint8 head.

    Raises:
        ConfigError: `block_bytes` is not a positive multiple of `2 * block_tokens`.
    """
    step = 2 * block_tokens
    if block_bytes < step or block_bytes % step:
        raise ConfigError(
            f"--block-bytes: {block_bytes:,} is not a multiple of {step:,} (K and V of "
            f"{block_tokens:,} tokens, one byte each)"
        )
    return KVLayout(
        model="kvtiers-replay",
        num_layers=1,
        num_kv_heads=1,
        head_size=block_bytes // step,
        dtype="uint8",
        chunk_size=block_tokens,
    )


def sandbox_config(
    tiers: Sequence[TierSpec],
    layout: KVLayout,
    work_dir: Path,
    base: CacheConfig | None = None,
) -> CacheConfig:
    """Return the config of a full replay's cache: `tiers`, with nothing written outside.

    Each tier holds `capacity_blocks` blocks of `layout` (an lmdb or remote tier counts each
    block's header too, so it holds as many as the index-only mode assumes). The tiers of
    `base`, aligned with `tiers`, keep their options, except that an lmdb tier's path and a
    remote tier's URL move under `work_dir` (dropping an lmdb `map_size` and remote
    `storage_options`, which were for the configured store); `base`'s write queue depth
    and read concurrency are kept, its metrics endpoint and events are not.

    Raises:
        ConfigError: a tier kind that a full replay cannot keep off its configured store.
    """
    out: list[TierConfig] = []
    for i, spec in enumerate(tiers):
        if spec.kind not in SANDBOXED_KINDS:
            raise ConfigError(
                f"tiers[{i}].kind: a full replay cannot keep a {spec.kind!r} tier off its "
                f"store; it runs {', '.join(SANDBOXED_KINDS)} tiers"
            )
        options = dict(base.tiers[i].options) if base is not None else {}
        if spec.kind == "lmdb":
            options.pop("map_size", None)
            options["path"] = str(work_dir / f"tier{i}-lmdb")
        elif spec.kind == "remote":
            options.pop("storage_options", None)
            options["url"] = (work_dir / f"tier{i}-remote").as_uri()
        tc = TierConfig(
            kind=spec.kind,
            capacity_bytes=0,
            name=spec.name,
            eviction=spec.policy,
            write_policy=spec.write_policy,
            options=MappingProxyType(options),
            index=i,
        )
        capacity = spec.capacity_blocks * _entry_bytes(tc, layout)
        out.append(dataclasses.replace(tc, capacity_bytes=capacity))
    if base is None:
        return CacheConfig(tuple(out), layout)
    return CacheConfig(
        tuple(out),
        layout,
        write_queue_chunks=base.write_queue_chunks,
        concurrent_reads=base.concurrent_reads,
        copy_threads=base.copy_threads,
    )


def _entry_bytes(tc: TierConfig, layout: KVLayout) -> int:
    """Return the bytes one block takes against the capacity of a tier."""
    tagged = tc.options.get("integrity", "none") != "none"
    if tc.kind == "lmdb":
        return fmt.value_bytes(layout.fingerprint, layout.chunk_bytes, tagged=tagged)
    if tc.kind == "remote":
        return fmt.value_bytes(
            layout.fingerprint, layout.chunk_bytes, num_layers=layout.num_layers, tagged=tagged
        )
    return layout.chunk_bytes


async def replay_full(
    trace: Trace,
    tiers: Sequence[TierSpec],
    layout: KVLayout,
    *,
    base: CacheConfig | None = None,
    progress: Callable[[int], None] | None = None,
    hints: ReuseHints | None = None,
) -> FullRun:
    """Replay `trace` through a fresh `TieredCache` of `tiers`, storing blocks of `layout`.

    Args:
        trace: the requests, replayed in order; `layout.chunk_size` must be its block tokens.
        tiers: the cascade, top first (see `sandbox_config`).
        layout: the layout of the stored blocks (`replay_layout`).
        base: the config the cascade came from, for its tiers' options.
        progress: called with the number of requests replayed since the last call.
        hints: reuse hints, passed with each request's store; the run is then reported
            as policy `<policy>+<source>`.

    Raises:
        ConfigError: the layout's chunk size is not the trace's block size, or a tier kind
            cannot be sandboxed.
        TraceError: a token trace changed since it was read.
    """
    if layout.chunk_size != trace.block_tokens:
        raise ConfigError(
            f"layout.chunk_size: {layout.chunk_size} tokens, but the trace's blocks are "
            f"{trace.block_tokens}"
        )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtiers-replay-") as tmp:
        config = sandbox_config(tiers, layout, Path(tmp), base)
        async with TieredCache(config) as cache:
            state = _Replay(trace, cache, None if hints is None else hints.blocks)
            await state.run(progress)
            stats = cache.stats()
    run = RunResult(
        tiers[0].policy if hints is None else f"{tiers[0].policy}+{hints.source}",
        tuple(
            TierResult(spec, sum(hits), s.puts, s.evictions)
            for spec, hits, s in zip(tiers, state.hits, stats.tiers, strict=True)
        ),
        trace.total_blocks,
        state.hits,
    )
    return FullRun(
        run,
        stats.tiers,
        state.lookup_load_s,
        state.store_s,
        state.flush_s,
        state.verify_failures,
        state.short_loads,
        dict(stats.miss_reasons),
        time.perf_counter() - start,
    )


class _Replay:
    """One full replay's loop and what it measures."""

    def __init__(self, trace: Trace, cache: TieredCache, hints: Sequence[int] | None) -> None:
        self.trace = trace
        self.cache = cache
        self.hints = hints
        self.hits = tuple(array("I", bytes(4 * trace.num_requests)) for _ in cache.tiers)
        self.lookup_load_s: array[float] = array("d")
        self.store_s: array[float] = array("d")
        self.flush_s: array[float] = array("d")
        self.verify_failures = 0
        self.short_loads = 0
        longest = max((len(ids) for ids in trace.requests), default=0)
        self._dst = np.empty((longest, cache.layout.chunk_bytes), dtype=np.uint8)
        self._payloads = _Payloads(cache.layout.chunk_bytes)

    async def run(self, progress: Callable[[int], None] | None) -> None:
        done = 0
        for r, keys in enumerate(_request_keys(self.cache, self.trace)):
            await self._request(r, keys)
            done += 1
            if progress is not None and done == _PROGRESS_EVERY:
                progress(done)
                done = 0
        if progress is not None and done:
            progress(done)

    async def _request(self, r: int, keys: list[ChunkKey]) -> None:
        cache, tiers = self.cache, self.cache.tiers
        payloads = self._payloads.of(keys)
        before = [tier.counters.hits for tier in tiers]
        start = time.perf_counter()
        num_hit = await cache.lookup_keys(keys)
        dsts = self._dst[:num_hit]
        dsts.fill(0)
        found = await cache.get_chunks(keys[:num_hit], list(dsts)) if num_hit else []
        loaded = time.perf_counter()
        keep = None if self.hints is None else self.hints[r]
        await cache.put_chunks(keys, list(payloads), keep_chunks=keep)
        stored = time.perf_counter()
        await cache.flush()
        self.lookup_load_s.append(loaded - start)
        self.store_s.append(stored - loaded)
        self.flush_s.append(time.perf_counter() - stored)
        wrong = np.any(dsts != payloads[:num_hit], axis=1) & np.array(found, dtype=bool)
        self.verify_failures += int(wrong.sum())
        hit = next((i for i, flag in enumerate(found) if not flag), len(found))
        self.short_loads += hit < num_hit
        served = [tier.counters.hits - b for tier, b in zip(tiers, before, strict=True)]
        for t, count in enumerate(_trim(served, hit)):
            self.hits[t][r] = count


class _Payloads:
    """Each block's bytes as a function of its key: the key repeated, XOR a fixed noise.

    The noise makes every offset of a payload distinct, so bytes copied to the wrong place
    within a block fail the comparison too, not only another block's bytes.
    """

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk_bytes = chunk_bytes
        self._reps = -(-chunk_bytes // KEY_BYTES)
        rng = np.random.default_rng(0)
        self._noise = rng.integers(0, 256, chunk_bytes, dtype=np.uint8)

    def of(self, keys: Sequence[ChunkKey]) -> npt.NDArray[np.uint8]:
        """Return one row of payload per key."""
        raw = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), KEY_BYTES)
        tiled = np.tile(raw, (1, self._reps))[:, : self._chunk_bytes]
        out: npt.NDArray[np.uint8] = tiled ^ self._noise
        return out


def _request_keys(cache: TieredCache, trace: Trace) -> Iterator[list[ChunkKey]]:
    """Yield each request's chunk keys, as the cache derives them."""
    if trace.format == "mooncake":
        # NOTE: an id already names its block and whole prefix; the trace keeps its bytes.
        keys = cache.chunk_keys(trace.keys)
        for ids in trace.requests:
            yield [keys[i] for i in ids]
        return
    for r, (prompt, ids) in enumerate(zip(read_prompts(trace), trace.requests, strict=True)):
        tokens, salt = prompt
        chain = cache.keys(tokens, salt=salt)
        if len(chain) != len(ids):
            raise TraceError(f"changed since it was read (request {r + 1})", path=trace.path)
        yield chain


def _trim(served: list[int], hits: int) -> list[int]:
    """Cut per-tier deliveries to the leading `hits`, from the lowest tier up.

    Only a short load delivers blocks past a miss; the blocks after it are not hits.
    """
    out, excess = list(served), sum(served) - hits
    for t in range(len(out) - 1, -1, -1):
        cut = min(excess, out[t])
        out[t] -= cut
        excess -= cut
    return out
