"""Copy engine gather/scatter vs one plain pinned `copy_`, and overlap.

The layout is Llama-3-8B's (32 layers, 8 KV heads, head size 128, bfloat16) at 256-token
chunks: 32 MiB per chunk, so 4 GiB is 128 chunks. The engine's KV is vLLM's flash layout
with 16-token blocks, and the request's block table is a random permutation, so a chunk's
blocks are scattered as in a long-running engine. Payloads are blocks of one pinned buffer
(what the DRAM tier allocates when CUDA is present).

- `store` (device to host): `CopyEngine.gather` of every chunk, all layers, awaited;
  baseline: one `pinned.copy_(device, non_blocking=True)` of the same bytes, synchronised.
- `load` (host to device): `CopyEngine.scatter`, awaited; baseline: one
  `device.copy_(pinned, non_blocking=True)`.
- `load, layer 0`: time until `wait_layer(0)` returns (what a layer-wise pipeline waits
  before its first layer can run), informative.
- `store overlap`: a chain of bf16 matmuls on a side stream, timed with CUDA events, alone
  and while a store runs; the target is that the store slows it by less than 10%.

Targets: store and load at >= 0.85 of the plain copy. Repetitions are interleaved and
medians reported. Run alone: `python -m benchmarks.bench_gpu_copy [--quick]`.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from benchmarks._common import GIB, MIB, Result, Target, main
from kvtiers import KVLayout
from kvtiers.gpu import CopyEngine, PagedKV, payload_tensor, pinned_allocator

LAYOUT = KVLayout(
    model="llama-3-8b",
    num_layers=32,
    num_kv_heads=8,
    head_size=128,
    dtype="bfloat16",
    chunk_size=256,
)
BLOCK_SIZE = 16
MATMUL_N = 8192


async def _timed(fn: Callable[[], Awaitable[object]]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    await fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


async def _pairs(
    ours: Callable[[], Awaitable[object]], base: Callable[[], Awaitable[object]], repeats: int
) -> tuple[float, float]:
    """Return median seconds of `ours` and `base`, repetitions interleaved."""
    await ours()
    await base()
    a, b = [], []
    for _ in range(repeats):
        a.append(await _timed(ours))
        b.append(await _timed(base))
    return statistics.median(a), statistics.median(b)


@dataclass(frozen=True, slots=True)
class _Setup:
    """The engine's KV, a request's block table, and payloads in one pinned pool."""

    paged: PagedKV
    table: torch.Tensor
    payloads: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return len(self.payloads) * LAYOUT.chunk_bytes


def _setup(total_bytes: int, device: torch.device) -> _Setup:
    num_chunks = max(1, total_bytes // LAYOUT.chunk_bytes)
    per_chunk = LAYOUT.chunk_size // BLOCK_SIZE
    num_blocks = num_chunks * per_chunk + 64
    shape = (2, num_blocks, BLOCK_SIZE, LAYOUT.num_kv_heads, LAYOUT.head_size)
    layers = [
        torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)
    ]
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks, generator=gen)[: num_chunks * per_chunk]
    allocate = pinned_allocator()
    assert allocate is not None
    size = LAYOUT.chunk_bytes
    pool = allocate(num_chunks * size)  # what the DRAM tier allocates with CUDA present
    payloads = [payload_tensor(LAYOUT, pool[i * size : (i + 1) * size]) for i in range(num_chunks)]
    return _Setup(PagedKV.vllm_flash(layers), table, payloads)


def _queue_matmuls(
    count: int, side: torch.cuda.Stream, a: torch.Tensor, out: torch.Tensor
) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Queue `count` matmuls on `side` between two timing events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record()
        for _ in range(count):
            torch.mm(a, a, out=out)
        end.record()
    return start, end


def _elapsed_ms(events: tuple[torch.cuda.Event, torch.cuda.Event]) -> float:
    start, end = events
    end.synchronize()
    return start.elapsed_time(end)


async def _bench(total_bytes: int, repeats: int, device: torch.device) -> list[Result]:
    setup = _setup(total_bytes, device)
    paged, table, payloads = setup.paged, setup.table, setup.payloads
    plain_host = torch.empty(setup.nbytes, dtype=torch.uint8, pin_memory=True)
    plain_dev = torch.empty(setup.nbytes, dtype=torch.uint8, device=device)
    chunks = range(len(payloads))

    async with CopyEngine(LAYOUT, device) as eng:

        async def store() -> None:
            await eng.gather(paged, table, chunks, payloads).wait()

        async def load() -> None:
            await eng.scatter(paged, table, chunks, payloads).wait()

        async def plain_d2h() -> None:
            plain_host.copy_(plain_dev, non_blocking=True)

        async def plain_h2d() -> None:
            plain_dev.copy_(plain_host, non_blocking=True)

        store_s, d2h_s = await _pairs(store, plain_d2h, repeats)
        load_s, h2d_s = await _pairs(load, plain_h2d, repeats)
        first_s = await _first_layer(eng, setup, repeats)
        overlap = await _overlap(eng, setup, store_s, repeats)
        ops = eng.stats.ops
    gb, target = setup.nbytes / 1e9, Target("ratio", ">=", 0.85)
    size = (
        f"{setup.nbytes / GIB:.1f} GiB in {len(payloads)} chunks of {LAYOUT.chunk_bytes // MIB} MiB"
    )
    return [
        Result.of_rates(
            "gpu store (D2H gather)",
            gb / store_s,
            gb / d2h_s,
            unit="GB/s",
            target=target,
            notes=f"{size}; baseline: one pinned copy_ of the same bytes",
        ),
        Result.of_rates(
            "gpu load (H2D scatter)",
            gb / load_s,
            gb / h2d_s,
            unit="GB/s",
            target=target,
            notes=f"{ops} copy kernels and DMA transfers issued in the whole run",
        ),
        Result.of_times(
            "gpu load, layer 0 ready", first_s, load_s, notes="baseline: the whole load"
        ),
        overlap,
    ]


async def _first_layer(eng: CopyEngine, setup: _Setup, repeats: int) -> float:
    """Return the median seconds from issuing a load to its layer 0 having landed."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        handle = eng.scatter(setup.paged, setup.table, range(len(setup.payloads)), setup.payloads)
        await handle.wait_layer(0)
        times.append(time.perf_counter() - start)
        await handle.wait()
    return statistics.median(times)


async def _overlap(eng: CopyEngine, setup: _Setup, store_s: float, repeats: int) -> Result:
    """Time matmuls on a side stream alone and beside a store of every chunk."""
    device = setup.paged.device
    a = torch.randn(MATMUL_N, MATMUL_N, device=device).to(torch.bfloat16)
    out = torch.empty_like(a)
    side = torch.cuda.Stream(device)
    one = _elapsed_ms(_queue_matmuls(3, side, a, out)) / 3
    count = max(3, int(store_s * 1e3 / max(one, 1e-3)))
    alone, together, stores = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        alone.append(_elapsed_ms(_queue_matmuls(count, side, a, out)))
        torch.cuda.synchronize()
        events = _queue_matmuls(count, side, a, out)  # queued first, the store beside them
        start = time.perf_counter()
        handle = eng.gather(setup.paged, setup.table, range(len(setup.payloads)), setup.payloads)
        together.append(_elapsed_ms(events))
        await handle.wait()
        stores.append(time.perf_counter() - start)
    a_ms, t_ms = statistics.median(alone), statistics.median(together)
    return Result.of_times(
        "matmul beside a store",
        t_ms / 1e3,
        a_ms / 1e3,
        target=Target("ratio", ">=", round(1 / 1.1, 3)),
        notes=f"{count} {MATMUL_N}^2 bf16 matmuls on a side stream, slowed by "
        f"{100 * (t_ms / a_ms - 1):.1f}% (target < 10%); the store took "
        f"{1e3 * statistics.median(stores):.0f} ms beside them, {1e3 * store_s:.0f} ms alone",
    )


def run(quick: bool) -> list[Result]:
    """Return the results, or none without a CUDA device."""
    if not torch.cuda.is_available():
        return []
    device = torch.device("cuda", torch.cuda.current_device())
    return asyncio.run(_bench(GIB if quick else 4 * GIB, 3 if quick else 5, device))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        sys.exit(0)
    main(run, __doc__.splitlines()[0])
