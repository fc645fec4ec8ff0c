"""The copy engine: bit-identical round trips, one copy each way, typed errors, layer-wise loads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvtiers.core.errors import CacheStateError, InvalidInputError, LayoutMismatch, TierIOError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.gpu import CopyEngine, EngineState, PagedKV, payload_tensor
from kvtiers.gpu._streams import DONE, wait_event

from ._factories import (
    DEVICES,
    KINDS,
    block_table,
    dram_tier,
    is_sentinel,
    make_layout,
    make_paged,
    paged_bytes,
    planes,
    reference_chunk,
    same,
    sentinel_payloads,
)

SIZES = [(16, 16), (64, 32), (128, 64), (256, 16), (512, 64)]  # (chunk_size, block_size)
DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]
CHUNKS = [0, 2, 3]  # chunks of the request to move: not all of them, not all in a row


def _keys(num: int) -> list[ChunkKey]:
    return [ChunkKey(bytes([i + 1]) * 16) for i in range(num)]


def _written_only(paged: PagedKV, written: set[int]) -> bool:
    """Return whether every block outside `written` is still all zeros."""
    others = [b for b in range(paged.num_blocks) if b not in written]
    return all(
        not p.cpu()[others].view(torch.uint8).any()
        for layer in range(paged.num_layers)
        for p in planes(paged, layer)
    )


def _engine(layout: KVLayout, device: str, **kwargs: Any) -> CopyEngine:
    return CopyEngine(layout, device, poll_interval_s=1e-4, **kwargs)


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("chunk_size", "block_size"), SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
async def test_roundtrip_through_dram_blocks_is_bit_identical(
    kind: str, dtype: str, chunk_size: int, block_size: int, device: str
) -> None:
    layout = make_layout(kind, dtype, chunk_size)
    per_chunk = chunk_size // block_size
    num_blocks = 4 * per_chunk + 3
    src = make_paged(kind, layout, num_blocks, block_size, device=device, seed=1)
    table = block_table(num_blocks, 4 * per_chunk, seed=2)
    table2 = block_table(num_blocks + 5, 4 * per_chunk, seed=3)
    written = {int(b) for i in CHUNKS for b in table2[i * per_chunk : (i + 1) * per_chunk]}
    for staged in (False, True):
        dst = make_paged(kind, layout, num_blocks + 5, block_size, device=device, zero=True)
        engine = _engine(layout, device, force_staging=staged, staging_bytes=2 * layout.layer_bytes)
        async with dram_tier(layout, 3, device) as tier, engine as eng:
            async with tier.reserve(_keys(3)) as res:
                dsts = [payload_tensor(layout, view) for view in res.views]
                await eng.gather(src, table, CHUNKS, dsts).wait()
            async with tier.pinned(_keys(3)) as views:
                srcs = [payload_tensor(layout, view) for view in views if view is not None]
                for i, payload in zip(CHUNKS, srcs, strict=True):
                    assert same(payload, reference_chunk(src, layout, table, i))
                await eng.scatter(dst, table2, CHUNKS, srcs).wait()
        for i in CHUNKS:
            assert same(
                reference_chunk(dst, layout, table2, i), reference_chunk(src, layout, table, i)
            )
        assert _written_only(dst, written)


@pytest.mark.parametrize("device", DEVICES)
async def test_gather_of_some_layers_writes_only_those(device: str) -> None:
    layout = make_layout("vllm_flash", num_layers=3)
    src = make_paged("vllm_flash", layout, 12, 16, device=device, seed=4)
    table = block_table(12, 8, seed=5)
    dsts = sentinel_payloads(layout, 2)
    async with _engine(layout, device) as eng:
        handle = eng.gather(src, table, [1, 3], dsts, layers=[1])
        await handle.wait()
        assert handle.layers == (1,)
    for i, dst in zip([1, 3], dsts, strict=True):
        assert is_sentinel(dst[0]) and is_sentinel(dst[2])
        assert same(dst[1], reference_chunk(src, layout, table, i)[1])


# -- zero extra copies ---------------------------------------------------------------------------

_aten = torch.ops.aten


class _CopyCounter(TorchDispatchMode):
    """Count the bytes every copying aten op writes, by op."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = {
            _aten.index_select.out: lambda: kwargs["out"],
            _aten.index.Tensor_out: lambda: kwargs["out"],
            _aten.index_copy_.default: lambda: args[3],
            _aten.index_put_.default: lambda: args[2],
            _aten.copy_.default: lambda: args[0],
        }.get(func)
        if written is not None:
            self.bytes[func.__name__] = self.bytes.get(func.__name__, 0) + written().nbytes
        return func(*args, **kwargs)


async def test_one_copy_per_chunk_each_way() -> None:
    layout = make_layout("vllm_flash", chunk_size=64)
    src = make_paged("vllm_flash", layout, 16, 16, seed=6)
    dst = make_paged("vllm_flash", layout, 16, 16, zero=True)
    table, num = block_table(16, 16, seed=7), 4
    total = num * layout.chunk_bytes
    async with dram_tier(layout, num, "cpu") as tier, _engine(layout, "cpu") as eng:
        async with tier.reserve(_keys(num)) as res:
            dsts = [payload_tensor(layout, view) for view in res.views]
            assert all(np.shares_memory(view, tier.buffer) for view in res.views)
            with _CopyCounter() as out:
                await eng.gather(src, table, range(num), dsts).wait()
        async with tier.pinned(_keys(num)) as views:
            srcs = [payload_tensor(layout, view) for view in views if view is not None]
            with _CopyCounter() as back:
                await eng.scatter(dst, table, range(num), srcs).wait()
        # Straight from the engine's blocks into the tier's blocks and back: each byte once.
        assert sum(out.bytes.values()) == total and sum(back.bytes.values()) == total
        assert (eng.stats.bytes_out, eng.stats.bytes_in, eng.stats.staged_bytes) == (
            total,
            total,
            0,
        )
        assert tier.counters.bytes_read == 0  # no tier-level get: the views were read in place
    assert all(same(a, b) for a, b in zip(paged_bytes(src), paged_bytes(dst), strict=True))


async def test_staged_path_crosses_once_per_byte() -> None:
    # The CUDA path for host payloads, run on CPU: a device-local pack, then one copy per
    # chunk layer (the DMA on CUDA), so the bytes cross to the host exactly once.
    layout = make_layout("sglang_mha", chunk_size=64)
    src = make_paged("sglang_mha", layout, 16, 32, seed=8)
    table, num = block_table(16, 8, seed=9), 4
    dsts = sentinel_payloads(layout, num)
    async with _engine(layout, "cpu", force_staging=True) as eng:
        with _CopyCounter() as counter:
            await eng.gather(src, table, range(num), dsts).wait()
        assert counter.bytes["copy_.default"] == num * layout.chunk_bytes
        assert eng.stats.staged_bytes == eng.stats.bytes_out == num * layout.chunk_bytes
    for i, dst in enumerate(dsts):
        assert same(dst, reference_chunk(src, layout, table, i))


# -- errors: typed, and nothing written ----------------------------------------------------------

Case = Callable[[dict[str, Any], KVLayout], None]


def _set(**values: Any) -> Case:
    return lambda args, layout: args.update(values)


def _paged(kind: str = "vllm_flash", block_size: int = 16, **changes: Any) -> Case:
    """Swap in paged KV built for a layout that differs from the engine's by `changes`."""

    def change(args: dict[str, Any], layout: KVLayout) -> None:
        fields = {"dtype": layout.dtype, "chunk_size": layout.chunk_size}
        fields["num_layers"] = layout.num_layers
        other = make_layout(kind, **{**fields, **changes})
        args["paged"] = make_paged(kind, other, 8, block_size, seed=1)

    return change


ERRORS: dict[str, tuple[type[Exception], str, Case, str]] = {
    # name: (error, message pattern, change to the valid arguments, directions)
    "block id past the end": (InvalidInputError, "out of range", _set(table=[0, 1, 2, 8]), "gs"),
    "negative block id": (InvalidInputError, "out of range", _set(table=[0, -1, 2, 3]), "gs"),
    "table too short": (InvalidInputError, "block_table: 3 blocks", _set(table=[0, 1, 2]), "gs"),
    "float block table": (InvalidInputError, "integers", _set(table=[0.0, 1.0, 2.0, 3.0]), "gs"),
    "negative chunk": (InvalidInputError, "negative", _set(chunk_idxs=[-1, 0]), "gs"),
    "dtype": (LayoutMismatch, "dtype", _paged(dtype="float16"), "gs"),
    "head count": (LayoutMismatch, "num_kv_heads", _paged(num_kv_heads=4), "gs"),
    "head size": (LayoutMismatch, "head_size", _paged(head_size=16), "gs"),
    "layer count": (LayoutMismatch, "num_layers", _paged(num_layers=3), "gs"),
    "mla kv for an mha layout": (LayoutMismatch, "kind", _paged(kind="mla"), "gs"),
    "block size": (LayoutMismatch, "block_size 64", _paged(block_size=64), "gs"),
    "payload dtype": (
        LayoutMismatch,
        "srcs|dsts",
        lambda a, lay: a.update(payloads=[p.view(torch.float16) for p in a["payloads"]]),
        "gs",
    ),
    "payload shape": (
        LayoutMismatch,
        "expected",
        lambda a, lay: a.update(payloads=[p[:1] for p in a["payloads"]]),
        "gs",
    ),
    "payload count": (InvalidInputError, "2 payloads for 3", _set(chunk_idxs=[0, 1, 2]), "gs"),
    "strided payload": (
        InvalidInputError,
        "contiguous",
        lambda a, lay: a.update(
            payloads=[p.transpose(0, 1).contiguous().transpose(0, 1) for p in a["payloads"]]
        ),
        "gs",
    ),
    "layer out of range": (InvalidInputError, "layers", _set(layers=[2]), "gs"),
    "shared block": (InvalidInputError, "share", _set(table=[0, 1, 0, 1]), "s"),
}


@pytest.mark.parametrize("case", ERRORS)
async def test_bad_input_raises_typed_error_and_writes_nothing(case: str) -> None:
    error, pattern, change, directions = ERRORS[case]
    layout = make_layout("vllm_flash")
    args: dict[str, Any] = {
        "paged": make_paged("vllm_flash", layout, 8, 16, seed=1),
        "table": [0, 1, 2, 3],
        "chunk_idxs": [0, 1],
        "payloads": sentinel_payloads(layout, 2),
        "layers": None,
    }
    change(args, layout)
    paged: PagedKV = args["paged"]
    before = paged_bytes(paged)
    async with _engine(layout, "cpu") as eng:
        if "g" in directions:
            with pytest.raises(error, match=pattern):
                eng.gather(
                    paged,
                    args["table"],
                    args["chunk_idxs"],
                    args["payloads"],
                    layers=args["layers"],
                )
            assert all(is_sentinel(p) for p in args["payloads"])
        with pytest.raises(error, match=pattern):
            eng.scatter(
                paged, args["table"], args["chunk_idxs"], args["payloads"], layers=args["layers"]
            )
        assert eng.stats.bytes_in == eng.stats.bytes_out == 0
    assert all(torch.equal(a, b) for a, b in zip(before, paged_bytes(paged), strict=True))


# -- layer-wise loads ----------------------------------------------------------------------------


def _payloads(
    layout: KVLayout, paged: PagedKV, table: torch.Tensor, pin: bool
) -> list[torch.Tensor]:
    payloads = [
        reference_chunk(paged, layout, table, i).view(getattr(torch, layout.dtype)) for i in CHUNKS
    ]
    return [p.pin_memory() if pin else p for p in payloads]


@pytest.mark.parametrize("device", DEVICES)
async def test_layerwise_load_reports_layer_0_before_the_last_arrives(device: str) -> None:
    layout = make_layout("sglang_mha", num_layers=4, chunk_size=64)
    src = make_paged("sglang_mha", layout, 16, 16, device=device, seed=10)
    dst = make_paged("sglang_mha", layout, 20, 16, device=device, zero=True)
    table, table2 = block_table(16, 16, seed=11), block_table(20, 16, seed=12)
    payloads = _payloads(layout, src, table, pin=device == "cuda")
    arrived: list[int] = []

    async def slow_source() -> AsyncIterator[tuple[int, list[torch.Tensor]]]:
        for layer in range(layout.num_layers):
            await asyncio.sleep(0.02)  # a slow tier: one layer at a time
            arrived.append(layer)
            yield layer, [p[layer] for p in payloads]

    async with _engine(layout, device) as eng:
        feed = eng.scatter_layerwise(dst, table2, CHUNKS)
        async with asyncio.TaskGroup() as group:
            group.create_task(feed.feed(slow_source()))
            await feed.handle.wait_layer(0)
            assert feed.handle.layer_done(0)
            assert layout.num_layers - 1 not in arrived  # the last layer is still on its way
            assert not feed.handle.submitted(layout.num_layers - 1)
            await feed.handle.wait()
        assert feed.handle.done() and arrived == list(range(layout.num_layers))
    for i in CHUNKS:
        assert same(reference_chunk(dst, layout, table2, i), reference_chunk(src, layout, table, i))


async def test_layerwise_source_failure_reaches_the_waiters() -> None:
    layout = make_layout("mla", num_layers=3)
    src = make_paged("mla", layout, 16, 16, seed=13)
    dst = make_paged("mla", layout, 16, 16, zero=True)
    table = block_table(16, 8, seed=14)
    payloads = _payloads(layout, src, table, pin=False)

    async def failing_source() -> AsyncIterator[tuple[int, list[torch.Tensor]]]:
        yield 0, [p[0] for p in payloads]
        raise OSError("remote tier went away")

    async with _engine(layout, "cpu") as eng:
        feed = eng.scatter_layerwise(dst, table, CHUNKS)
        await feed.feed(failing_source())  # does not raise: the waiters see the error
        await feed.handle.wait_layer(0)
        with pytest.raises(TierIOError, match="layer 1 was not copied") as info:
            await feed.handle.wait_layer(1)
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(TierIOError):
            await feed.handle.wait()
    assert same(reference_chunk(dst, layout, table, 0)[0], payloads[0][0])


async def test_layer_feed_rejects_repeats_unknown_layers_and_late_layers() -> None:
    layout = make_layout("vllm_flash", num_layers=2)
    dst = make_paged("vllm_flash", layout, 16, 16, zero=True)
    table = block_table(16, 8, seed=15)
    slices = [p[0] for p in sentinel_payloads(layout, len(CHUNKS))]
    async with _engine(layout, "cpu") as eng:
        feed = eng.scatter_layerwise(dst, table, CHUNKS, layers=[1])
        with pytest.raises(InvalidInputError, match="not part"):
            feed.put_layer(0, slices)
        with pytest.raises(LayoutMismatch):
            feed.put_layer(1, [p[:1] for p in slices])
        feed.put_layer(1, slices)
        with pytest.raises(InvalidInputError, match="already"):
            feed.put_layer(1, slices)
        feed.finish()
        with pytest.raises(InvalidInputError, match="finished"):
            feed.put_layer(1, slices)
        await feed.handle.wait()
        with pytest.raises(InvalidInputError):
            await feed.handle.wait_layer(0)
        feed.handle.stream_wait_layer(1)  # CPU: copies are synchronous, nothing to order


async def test_unfinished_feed_is_failed_on_close() -> None:
    layout = make_layout("vllm_flash")
    dst = make_paged("vllm_flash", layout, 16, 16, zero=True)
    async with _engine(layout, "cpu") as eng:
        feed = eng.scatter_layerwise(dst, block_table(16, 8, seed=16), CHUNKS)
    with pytest.raises(TierIOError, match="closed"):
        await feed.handle.wait_layer(0)


# -- events and lifecycle ------------------------------------------------------------------------


class _SlowEvent:
    """An event that fires after a number of queries."""

    def __init__(self, queries: int) -> None:
        self.left = queries

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        raise AssertionError("must not block the loop")


async def test_wait_event_polls_without_blocking_the_loop() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(ticker())
    event = _SlowEvent(20)
    await wait_event(event, max_interval_s=1e-4)
    task.cancel()
    assert event.left < 0 and ticks >= 10
    await wait_event(DONE, max_interval_s=1.0)  # a fired event returns at once


async def test_lifecycle() -> None:
    layout = make_layout("vllm_flash")
    paged = make_paged("vllm_flash", layout, 8, 16)
    engine = _engine(layout, "cpu")
    with pytest.raises(CacheStateError):
        engine.gather(paged, [0, 1], [0], sentinel_payloads(layout, 1))
    async with engine:
        assert engine.state is EngineState.OPEN
        with pytest.raises(CacheStateError):
            await engine.open()
    await engine.aclose()
    assert engine.state is EngineState.CLOSED
    with pytest.raises(CacheStateError):
        engine.scatter(paged, [0, 1], [0], sentinel_payloads(layout, 1))
    with pytest.raises(InvalidInputError):
        CopyEngine(layout, "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
async def test_cuda_engine_without_cuda_raises() -> None:
    with pytest.raises(InvalidInputError, match="needs CUDA"):
        async with CopyEngine(make_layout("vllm_flash"), "cuda:0"):
            pass


# -- CUDA only -----------------------------------------------------------------------------------


@pytest.mark.gpu
async def test_cuda_wait_does_not_block_the_loop_and_sees_current_stream_writes() -> None:
    layout = make_layout("vllm_flash", chunk_size=256, num_layers=4)
    paged = make_paged("vllm_flash", layout, 64, 16, device="cuda", zero=True)
    table = block_table(64, 64, seed=17)
    dsts = [p.pin_memory() for p in sentinel_payloads(layout, 4)]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async with _engine(layout, "cuda") as eng:
        torch.cuda._sleep(100_000_000)  # keep the current stream busy (~50 ms)
        for layer in paged.layers:
            assert isinstance(layer, torch.Tensor)
            layer.fill_(1.5)  # queued after the sleep: the gather must wait for it
        handle = eng.gather(paged, table, range(4), dsts)
        assert not handle.done()
        task = asyncio.ensure_future(ticker())
        await handle.wait()
        task.cancel()
    assert ticks > 0
    assert all(bool((d.float() == 1.5).all()) for d in dsts)


@pytest.mark.gpu
async def test_cuda_stream_wait_layer_orders_compute_after_the_load() -> None:
    layout = make_layout("vllm_flash", chunk_size=256, num_layers=2)
    src = make_paged("vllm_flash", layout, 64, 16, device="cuda", seed=18)
    dst = make_paged("vllm_flash", layout, 64, 16, device="cuda", zero=True)
    table = block_table(64, 64, seed=19)
    payloads = _payloads(layout, src, table, pin=True)
    async with _engine(layout, "cuda") as eng:
        assert eng._h2d is not None
        with eng._h2d.use():
            torch.cuda._sleep(100_000_000)  # the load starts late
        handle = eng.scatter(dst, table, CHUNKS, payloads)
        handle.stream_wait_layer(1)
        layer = dst.layers[1]
        assert isinstance(layer, torch.Tensor)
        snapshot = layer.clone()  # on the current stream, after the load of layer 1
        await handle.wait()
    torch.cuda.synchronize()
    assert same(snapshot, layer)
