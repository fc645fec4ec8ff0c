"""The HBM tier: the conformance suite, device views, config checks, device-to-device loads."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.gpu import CopyEngine, HBMTier, payload_tensor
from kvtiers.testing.tiers import SMALL_LAYOUT, TierTests

from ._factories import DEVICES, block_table, make_layout, make_paged, reference_chunk, same


class TestHBMTier(TierTests):
    """The tier contract on the CPU test seam (`device = "cpu"`)."""

    tier_cls = HBMTier

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> HBMTier:
        return HBMTier(TierConfig("hbm", capacity_bytes, options={"device": "cpu"}), layout)


@pytest.mark.gpu
class TestHBMTierCUDA(TierTests):
    """The tier contract in GPU memory."""

    tier_cls = HBMTier

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> HBMTier:
        return HBMTier(TierConfig("hbm", capacity_bytes, options={"device": "cuda:0"}), layout)


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def _payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SMALL_LAYOUT.chunk_bytes, dtype=np.uint8)


def _tier(num_chunks: int = 4, device: str = "cpu") -> HBMTier:
    config = TierConfig("hbm", num_chunks * SMALL_LAYOUT.chunk_bytes, options={"device": device})
    return HBMTier(config, SMALL_LAYOUT)


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"path": "/x"}, r"tiers\[0\]\.path: unknown option"),
        ({"device": 0}, r"tiers\[0\]\.device: expected a device name"),
        ({"device": "nonsense"}, r"tiers\[0\]\.device: 'nonsense' is not a device name"),
        ({"device": "cuda:x"}, r"tiers\[0\]\.device: 'cuda:x' is not a device name"),
        ({"device": "meta"}, r"tiers\[0\]\.device: 'meta' is not a CUDA device"),
    ],
)
def test_config_errors_name_the_field(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HBMTier.from_config(TierConfig("hbm", 1 << 20, options=options), SMALL_LAYOUT)


def test_capacity_below_one_chunk() -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: .*too small"):
        HBMTier(TierConfig("hbm", 100, options={"device": "cpu"}), SMALL_LAYOUT)


def test_device_defaults_to_the_first_gpu() -> None:
    tier = HBMTier.from_config(TierConfig("hbm", 1 << 20), SMALL_LAYOUT, allocate=None)
    assert tier.device == torch.device("cuda", 0) and tier.kind == "hbm"
    assert tier.num_chunks == (1 << 20) // SMALL_LAYOUT.chunk_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
async def test_opening_without_cuda_says_cuda_is_needed() -> None:
    tier = HBMTier(TierConfig("hbm", 1 << 20, options={"device": "cuda:0"}), SMALL_LAYOUT)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.device: the hbm tier needs CUDA"):
        await tier.open()


# -- device views ----------------------------------------------------------------------------------


async def test_pinned_views_are_zero_copy_and_delete_waits_for_unpin() -> None:
    async with _tier(2) as tier:
        await tier.put([_key(1)], [_payload(1)])
        async with tier.pinned([_key(1), _key(2)]) as views:
            assert views[1] is None
            view = views[0]
            assert view is not None and view.device == tier.device
            start = tier.buffer.data_ptr()
            assert start <= view.data_ptr() < start + tier.buffer.numel()
            assert tier.is_pinned(_key(1)) and tier.total_pins == 1
            await tier.delete([_key(1)])  # deferred: the block stays intact while pinned
            await tier.put([_key(3)], [_payload(3)])
            assert np.array_equal(view.cpu().numpy(), _payload(1))
        assert tier.total_pins == 0 and tier.num_free_chunks == 1


@pytest.mark.parametrize("device", DEVICES)
async def test_copy_views_moves_blocks_to_and_from_host_memory_in_one_batch(device: str) -> None:
    async with _tier(4, device) as tier:
        async with tier.reserve([_key(1), _key(2)]) as res:
            srcs = [torch.from_numpy(_payload(1)), torch.from_numpy(_payload(2))]
            await tier.copy_views(list(zip(res.views, srcs, strict=True)))
        outs = [torch.zeros(SMALL_LAYOUT.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
        async with tier.pinned([_key(2), _key(1)]) as views:
            await tier.copy_views([(outs[0], views[0]), (outs[1], views[1])])
        assert np.array_equal(outs[0].numpy(), _payload(2))
        assert np.array_equal(outs[1].numpy(), _payload(1))
        await tier.copy_views([])
        with pytest.raises(TierIOError, match="copy failed"):
            await tier.copy_views([(outs[0][:8], tier.block_view(0))])
        assert tier.total_pins == 0


async def test_reserve_commits_kept_blocks_and_frees_the_rest() -> None:
    async with _tier(4) as tier:
        keys = [_key(i) for i in range(6)]
        async with tier.reserve(keys) as res:
            assert len(res.views) == 4  # only four blocks exist
            for i, view in enumerate(res.views):
                view.copy_(torch.from_numpy(_payload(i)))
            res.keep[1] = False
        assert await tier.contains(keys) == [True, False, True, True, False, False]
        assert tier.num_free_chunks == 1
        dst = np.empty(SMALL_LAYOUT.chunk_bytes, np.uint8)
        assert await tier.get([keys[2]], [dst]) == [True]
        assert np.array_equal(dst, _payload(2))
        with pytest.raises(RuntimeError):
            async with tier.reserve([_key(9)]) as res:
                raise RuntimeError("copy failed")
        assert await tier.contains([_key(9)]) == [False]
        assert tier.num_free_chunks == 1


class _GatedStream:
    """A stand-in for a CUDA stream whose copies finish when the test opens a gate."""

    is_cuda = True

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.synchronized = threading.Event()

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        yield

    def wait_current(self) -> None:
        return None

    def synchronize(self) -> None:
        assert threading.current_thread() is not threading.main_thread()  # never the loop's
        self.synchronized.set()
        self.gate.wait(10)


async def _eventually(condition: Callable[[], bool]) -> bool:
    for _ in range(1000):
        if condition():
            return True
        await asyncio.sleep(0.005)
    return False


async def test_cancelled_put_frees_its_blocks_only_after_the_writes_land() -> None:
    async with _tier(4) as tier:
        stream = _GatedStream()
        tier._stream = stream  # type: ignore[assignment]
        keys = [_key(1), _key(2)]
        task = asyncio.ensure_future(tier.put(keys, [_payload(1), _payload(2)]))
        assert await _eventually(stream.synchronized.is_set)  # copies issued, still landing
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # the cancellation waits for the writes
        assert tier.num_free_chunks == 2  # the writes may still land: not reusable yet
        stream.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await tier.contains(keys) == [False, False]
        assert tier.usage().num_entries == 0 and tier.num_free_chunks == 4


async def test_cancelled_get_keeps_blocks_pinned_until_the_reads_land() -> None:
    async with _tier(4) as tier:
        await tier.put([_key(1)], [_payload(1)])
        stream = _GatedStream()
        tier._stream = stream  # type: ignore[assignment]
        dst = np.zeros(SMALL_LAYOUT.chunk_bytes, np.uint8)
        task = asyncio.ensure_future(tier.get([_key(1)], [dst]))
        assert await _eventually(stream.synchronized.is_set)
        task.cancel()
        await tier.delete([_key(1)])
        await asyncio.sleep(0.05)
        assert not task.done()
        assert tier.total_pins == 1 and tier.num_free_chunks == 3  # read in flight
        stream.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tier.total_pins == 0 and tier.num_free_chunks == 4
        assert np.array_equal(dst, _payload(1))


async def test_get_and_put_take_buffers_torch_cannot_wrap() -> None:
    async with _tier(4) as tier:
        payload = _payload(5)
        backwards = payload[::-1].copy()[::-1]  # the same bytes, with a negative stride
        assert await tier.put([_key(5), _key(5)], [backwards, payload]) == [True, True]
        out = np.zeros(SMALL_LAYOUT.chunk_bytes * 2, np.uint8)[::-1][::2]
        assert await tier.get([_key(5), _key(6)], [out, out.copy()]) == [True, False]
        assert np.array_equal(out, payload)
        assert tier.usage().num_entries == 1


# -- device-to-device loads through the copy engine ------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["vllm_flash", "sglang_mha", "mla"])
async def test_paged_kv_to_hbm_blocks_and_back(kind: str, device: str) -> None:
    layout = make_layout(kind, chunk_size=64, num_layers=3)
    src = make_paged(kind, layout, 16, 16, device=device, seed=20)
    dst = make_paged(kind, layout, 16, 16, device=device, zero=True)
    table, table2 = block_table(16, 12, seed=21), block_table(16, 12, seed=22)
    keys = [_key(i) for i in range(3)]
    hbm_device = "cuda:0" if device == "cuda" else "cpu"
    config = TierConfig("hbm", 3 * layout.chunk_bytes, options={"device": hbm_device})
    async with HBMTier(config, layout) as tier, CopyEngine(layout, device) as eng:
        async with tier.reserve(keys) as res:
            dsts = [payload_tensor(layout, view) for view in res.views]
            await eng.gather(src, table, range(3), dsts).wait()
        async with tier.pinned(keys) as views:
            srcs = [payload_tensor(layout, view) for view in views if view is not None]
            await eng.scatter(dst, table2, range(3), srcs).wait()
        assert eng.stats.staged_bytes == 0  # device to device: straight between blocks
        host = np.empty(layout.chunk_bytes, np.uint8)
        assert await tier.get(keys[1:2], [host]) == [True]
    assert same(torch.from_numpy(host), reference_chunk(src, layout, table, 1).flatten())
    for i in range(3):
        assert same(reference_chunk(dst, layout, table2, i), reference_chunk(src, layout, table, i))
