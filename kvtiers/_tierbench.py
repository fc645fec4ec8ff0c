"""Measure each tier of a config on this machine, for the cost model (`kvtiers bench`).

Each tier is measured alone, in a cache of that one tier (the config's layout, the tier's
own options), through the key-level API, so chunks take the path a load takes: one write
of a batch (`put_chunks`), single-chunk reads (their median gives the latency), and reads
of the whole batch in one call (`get_chunks`: every chunk in flight at once, as the tier
reads a load). Chunks come from and go to the GPU when CUDA is present (where a load
delivers KV), else host memory.

Side effects: the chunks are keyed under a salt of this run alone, so they can match no
real chunk, and are deleted afterwards (and checked to be gone). A tier that evicts by
itself (lmdb, remote) is given no more chunks than its free room holds, so writing them
evicts nothing; opening it still does what any process's open does (a remote scan expires
and evicts as configured). A remote tier's access log of the visit is deleted too. Memory
tiers (dram, hbm) get a buffer of the batch's size instead of their capacity.

Chunks just written to a disk tier are read back from the OS page cache, and
`TierBench.reads_from` says so, unless `cold` is asked for: then before each timed read the
files of an lmdb tier, or of a remote tier on a local filesystem, are synced and dropped
from the page cache (an lmdb tier's cache is closed first and reopened after, as a process
that maps the file keeps its pages), and `mincore` checks how much stayed. Other processes
reading those files then read them from the disk too.

The timing itself is `kvtiers._benchtiming`; the cache of one tier, `kvtiers._benchcache`.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

import torch

from kvtiers._benchcache import BenchCache
from kvtiers._benchtiming import Timings, measure
from kvtiers.cache import TieredCache
from kvtiers.core.config import CacheConfig, TierConfig
from kvtiers.core.errors import ConfigError, KVTiersError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.core.stats import TierUsage
from kvtiers.gpu.pinned import cuda_available
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers.base import Tier
from kvtiers.tiers.blocks import BlockTier
from kvtiers.tiers.dram import MemoryTier
from kvtiers.tiers.registry import TierRegistry

__all__ = ["BenchReport", "TierBench", "bench_config", "default_chunks"]

_DEFAULT_BYTES = 256 * 2**20  # a batch of at most this much by default...
_MIN_CHUNKS = 2  # ...but at least this many chunks...
_MAX_DEFAULT_CHUNKS = 1024  # ...and at most this many (one object each on a remote store)
_MAX_RESIDENT = 0.01  # a read counts as cold when no more of its tier's files stayed cached


@dataclass(frozen=True, slots=True)
class TierBench:
    """What the bench found for one tier."""

    name: str
    kind: str
    status: str
    """"measured", "skipped" or "failed"; `reason` says why it was not measured."""
    reason: str = ""
    chunks: int = 0
    """Chunks written, then read in each batch."""
    read_bandwidth: float = 0.0
    """Bytes per second of a batch read."""
    read_latency: float = 0.0
    """Seconds a read costs beyond its bytes: the median single-chunk read less one chunk
    at `read_bandwidth` (never below 0); the cost model's link latency."""
    chunk_read_seconds: float = 0.0
    """Median seconds of one single-chunk read."""
    write_bandwidth: float = 0.0
    """Bytes per second of the batch write."""
    reads_from: str = ""
    """Where reads were served from: "memory", "page cache" (warm: just written),
    "disk (cold)", "partly warm (…)", "network", or "unknown"."""
    cold: bool = False
    """Whether every timed read came from the disk: the tier's files were dropped from the
    page cache before each, and at most 1% of their pages stayed (`--cold`)."""
    resident_fraction: float | None = None
    """With `--cold`, the most of the tier's files found in the page cache after a drop;
    `None` when its files were not dropped or this could not be checked."""
    cleanup: str = ""
    """What became of the chunks the bench wrote."""
    clean: bool = True
    """Whether nothing the bench wrote is left in the tier."""
    notes: tuple[str, ...] = ()

    @property
    def measured(self) -> bool:
        """Whether the figures are set."""
        return self.status == "measured"


@dataclass(frozen=True, slots=True)
class BenchReport:
    """Every tier of a config, top first, as measured on this machine."""

    layout: KVLayout
    device: str
    """Where chunks came from and went to: "host" or a CUDA device such as "cuda:0"."""
    tiers: tuple[TierBench, ...]
    cold: bool = False
    """Whether the bench was asked for cold reads (`--cold`); each tier's `cold` says if so."""


def default_chunks(layout: KVLayout) -> int:
    """Return the chunks of a default batch: up to 256 MiB, between 2 and 1024 chunks."""
    fit = _DEFAULT_BYTES // layout.chunk_bytes
    return max(_MIN_CHUNKS, min(_MAX_DEFAULT_CHUNKS, fit))


async def bench_config(
    config: CacheConfig, *, chunks: int | None = None, cold: bool = False
) -> BenchReport:
    """Measure every tier of `config`, top first, one at a time.

    See the module docstring for what is written where, and removed.

    Args:
        config: the cache config; its `[layout]` sets the chunk size and bytes.
        chunks: chunks per batch (default: `default_chunks`); shared tiers may take fewer.
        cold: drop the disk tiers' files from the page cache before each timed read.

    Raises:
        ConfigError: the config has no layout, or a tier's options are invalid.
    """
    layout = config.layout
    if layout is None:
        raise ConfigError("layout: required to bench: chunk sizes come from the [layout]")
    registry = TierRegistry()
    TieredCache(config, registry=registry)  # validates every tier as a real run does
    device = _device()
    count = chunks or default_chunks(layout)
    results = [
        await _bench_tier(config, tc, count, device, registry, cold=cold) for tc in config.tiers
    ]
    return BenchReport(layout, device, tuple(results), cold)


def _device() -> str:
    """Return where chunks come from and go to: the current CUDA device, else "host"."""
    return f"cuda:{torch.cuda.current_device()}" if cuda_available() else "host"


async def _bench_tier(
    config: CacheConfig,
    tc: TierConfig,
    count: int,
    device: str,
    registry: TierRegistry,
    *,
    cold: bool,
) -> TierBench:
    """Measure one tier in a cache of its own."""
    assert config.layout is not None
    chunk_bytes = config.layout.chunk_bytes
    on_cpu = _option(tc, "device", "cuda").startswith("cpu")  # the hbm tier's test seam
    if tc.kind == "hbm" and not on_cpu and not cuda_available():
        return TierBench(tc.name, tc.kind, "skipped", "no CUDA device is present")
    block = issubclass(registry.resolve(tc.kind, where=tc.where), BlockTier)
    bench = TierBench(tc.name, tc.kind, "measured", reads_from=_reads_from(tc))
    if block:  # the bench's own buffer: the batch's size, not the tier's capacity
        if tc.capacity_bytes // chunk_bytes < count:
            count = tc.capacity_bytes // chunk_bytes
            bench = _note(bench, f"{count} chunks: what its capacity holds")
        tc = dataclasses.replace(tc, capacity_bytes=count * chunk_bytes)
    # NOTE: index 0: a cache's slots are numbered by their place in its own cascade.
    alone = dataclasses.replace(tc, index=0)
    single = dataclasses.replace(config, tiers=(alone,), metrics=None, events=0)
    try:
        async with BenchCache(single, registry, cold=cold) as session:
            return await _bench_open(session, bench, count, device, block=block)
    except KVTiersError as exc:
        return dataclasses.replace(bench, status="failed", reason=f"{type(exc).__name__}: {exc}")
    except NotImplementedError as exc:  # a store without writes or deletes (fsspec's HTTP)
        return dataclasses.replace(bench, status="failed", reason=_unsupported(exc))


async def _bench_open(
    session: BenchCache, bench: TierBench, count: int, device: str, *, block: bool
) -> TierBench:
    """Write, read and remove a batch in the session's cache of the tier `bench` names."""
    cache, tier = session.cache, session.tier
    layout = cache.layout
    if not block:
        fit = _room(tier.usage(), layout)
        if fit < 1:
            return dataclasses.replace(bench, status="skipped", reason=_full(tier.usage()))
        if fit < count:
            bench = _note(bench, f"{fit} chunks: what its free room holds")
            count = fit
    if isinstance(tier, MemoryTier):
        # NOTE: a running cache touched its buffer long ago; the first touch of each page
        # (a fault, the kernel zeroing it) would otherwise be timed as the write.
        tier.buffer.fill(0)
    salt = f"kvtiers-bench-{secrets.token_hex(16)}"
    keys = cache.chunk_keys([f"{salt}/{i}" for i in range(count)], salt=salt)
    note = session.find_files(keys)
    if note:
        bench = _note(bench, note)
    try:
        timed = await measure(session, keys, device)
    finally:
        cleanup, clean = await _clean_up(session.cache, session.tier, keys, block=block)
    bench = dataclasses.replace(bench, chunks=count, cleanup=cleanup, clean=clean)
    evicted = session.evicted
    if evicted:
        bench = _note(bench, f"the tier evicted {evicted} entries while the bench wrote")
    if isinstance(timed, str):
        return dataclasses.replace(bench, status="failed", reason=timed)
    if session.files is not None:
        bench = _coldness(bench, session.most_resident)
    return _figures(bench, timed, count * layout.chunk_bytes, layout.chunk_bytes)


def _figures(bench: TierBench, timed: Timings, num_bytes: int, chunk_bytes: int) -> TierBench:
    read_bandwidth = num_bytes / max(timed.read_seconds, 1e-9)
    return dataclasses.replace(
        bench,
        read_bandwidth=read_bandwidth,
        read_latency=max(0.0, timed.chunk_read_seconds - chunk_bytes / read_bandwidth),
        chunk_read_seconds=timed.chunk_read_seconds,
        write_bandwidth=num_bytes / max(timed.write_seconds, 1e-9),
    )


def _coldness(bench: TierBench, resident: float | None) -> TierBench:
    """Set where a tier's reads came from once its files were dropped before each."""
    if resident is None:
        reads_from = "disk (dropped; residency not checked: no mincore)"
    elif resident <= _MAX_RESIDENT:
        reads_from = "disk (cold)"
    else:
        reads_from = f"partly warm ({resident:.0%} resident: another process maps the file)"
    cold = resident is not None and resident <= _MAX_RESIDENT
    return dataclasses.replace(bench, reads_from=reads_from, cold=cold, resident_fraction=resident)


async def _clean_up(
    cache: TieredCache, tier: Tier, keys: list[ChunkKey], *, block: bool
) -> tuple[str, bool]:
    """Delete the bench's chunks (and a remote tier's access log); say what is left."""
    try:
        await cache.clear()
        if block:
            return "nothing kept: the bench's own buffer, freed at close", True
        # NOTE: a cache reopened by --cold indexes only what it read since; clear() misses
        # the rest, so the bench's keys are deleted by name too.
        await tier.delete(keys)
        left = sum(await tier.contains(keys))
        log_gone = await _discard_access_log(tier)
    except KVTiersError as exc:
        return f"could not remove or check its chunks: {exc}", False
    except NotImplementedError as exc:  # a store without deletes (fsspec's HTTP, say)
        detail = f": {exc}" if str(exc) else ""
        return (
            f"could not remove its chunks: its store cannot delete (NotImplementedError{detail})",
            False,
        )
    if left:
        return f"could not remove {left} of {len(keys)} chunks", False
    if not log_gone:
        return "removed its chunks; could not delete its access log", False
    return "removed every chunk it wrote", True


async def _discard_access_log(tier: Tier) -> bool:
    """Delete a remote tier's access log of the bench; `True` for other tiers."""
    if tier.kind != "remote":
        return True
    from kvtiers.tiers.remote import RemoteTier  # already imported: the tier is one

    return not isinstance(tier, RemoteTier) or await tier.discard_access_log()


def _unsupported(exc: NotImplementedError) -> str:
    """Say that the tier's store lacks an operation the bench needs."""
    detail = f": {exc}" if str(exc) else ""
    return f"its store does not support an operation the bench needs (NotImplementedError{detail})"


def _room(usage: TierUsage, layout: KVLayout) -> int:
    """Return how many chunks fit in a self-evicting tier without evicting anything."""
    # NOTE: the largest stored form (per-layer checksums and a tag), so never too many.
    stored = fmt.value_bytes(
        layout.fingerprint, layout.chunk_bytes, num_layers=layout.num_layers, tagged=True
    )
    return max(0, usage.capacity_bytes - usage.used_bytes) // stored


def _full(usage: TierUsage) -> str:
    return (
        f"no free room (it holds {usage.used_bytes:,} of {usage.capacity_bytes:,} bytes): "
        "writing would evict real chunks"
    )


def _reads_from(tc: TierConfig) -> str:
    """Say where a tier's reads of just-written chunks come from."""
    if tc.kind in ("dram", "hbm"):
        return "memory"
    if tc.kind == "lmdb":
        return "page cache"
    if tc.kind == "remote":
        url = _option(tc, "url", "")
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol in ("file", "local"):
            return "page cache"
        return "memory" if protocol == "memory" else "network"
    return "unknown"


def _option(tc: TierConfig, name: str, default: str) -> str:
    value = tc.options.get(name, default)
    return value if isinstance(value, str) else default


def _note(bench: TierBench, note: str) -> TierBench:
    return dataclasses.replace(bench, notes=(*bench.notes, note))
