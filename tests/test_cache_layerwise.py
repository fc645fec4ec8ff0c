"""Layer-wise loads (`load(on_layers=...)`, `get_chunks(on_layers=...)`) on real tiers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtiers import TieredCache
from kvtiers._streaming import layer_waves
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from tests.conftest import SMALL_LAYOUT, make_kv, same_bytes

pytestmark = pytest.mark.filterwarnings("error")

LAYOUT = {**SMALL_LAYOUT, "num_layers": 8}  # waves of 1, 2 and 5 layers
TOKENS = list(range(7000, 7096))  # 6 chunks of 16


def layout() -> KVLayout:
    return KVLayout(**LAYOUT)


def remote(tmp_path: Path, **options: Any) -> dict[str, Any]:
    return {"kind": "remote", "url": f"file://{tmp_path}/pool", "capacity": "4MiB", **options}


def lmdb(tmp_path: Path) -> dict[str, Any]:
    return {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "4MiB"}


def dram(num_chunks: int = 32) -> dict[str, Any]:
    return {"kind": "dram", "capacity": num_chunks * layout().chunk_bytes}


def cfg(*tiers: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"layout": dict(LAYOUT), "tiers": list(tiers), **extra}


class Calls:
    """Records `on_layers` calls and what `out` held at each."""

    def __init__(self, out: torch.Tensor, kv: torch.Tensor) -> None:
        self.out, self.kv = out, kv
        self.calls: list[tuple[int, int]] = []
        self.exact: list[bool] = []

    def __call__(self, num_layers: int, num_tokens: int) -> None:
        self.calls.append((num_layers, num_tokens))
        lo = self.calls[-2][0] if len(self.calls) > 1 else 0
        got = self.out[lo:num_layers, :, :num_tokens]
        self.exact.append(same_bytes(got, self.kv[lo:num_layers, :, :num_tokens]))


def test_waves_double_and_cover_every_layer() -> None:
    assert layer_waves(1) == (range(1),)
    assert layer_waves(8) == (range(1), range(1, 3), range(3, 8))
    assert [len(w) for w in layer_waves(32)] == [1, 2, 4, 8, 17]
    for n in range(1, 200):
        waves = layer_waves(n)
        assert [i for w in waves for i in w] == list(range(n))
        assert len(waves) <= n.bit_length()
        # 1, 2, 4, ... layers; the last wave takes what is left, less than twice its size
        sizes = [len(w) for w in waves]
        assert sizes[:-1] == [2**i for i in range(len(sizes) - 1)]
        assert sizes[-1] < 2 * 2 ** (len(sizes) - 1)


@pytest.mark.parametrize("fresh_dram", [True, False])
async def test_a_layerwise_load_from_a_remote_reports_every_wave_with_exact_bytes(
    tmp_path: Path, fresh_dram: bool
) -> None:
    kv = make_kv(layout(), 96)
    config = cfg(dram(), remote(tmp_path))
    async with TieredCache.from_config(config) as cache:
        await cache.store(TOKENS, kv)
        await cache.flush()
    async with TieredCache.from_config(config if fresh_dram else cfg(remote(tmp_path))) as cache:
        out = torch.zeros_like(kv)
        calls = Calls(out, kv)
        got = await cache.load(TOKENS, out=out, on_layers=calls)
        assert same_bytes(got, kv)
        assert calls.calls == [(1, 96), (3, 96), (8, 96)]
        assert all(calls.exact)
        # one hit per chunk, not one per wave; bytes counted per layer read
        stats = cache.stats().tiers[-1]
        assert stats.hits == 6
        assert stats.bytes_read == 6 * layout().chunk_bytes
        # the second load comes from DRAM (promoted whole) when there is one
        again = Calls(torch.zeros_like(kv), kv)
        assert same_bytes(await cache.load(TOKENS, out=again.out, on_layers=again), kv)
        assert again.calls == calls.calls and all(again.exact)


async def test_a_layerwise_load_equals_a_plain_load_on_every_tier_mix(tmp_path: Path) -> None:
    kv = make_kv(layout(), 96, seed=3)
    mixes = [
        [dram()],
        [dram(), lmdb(tmp_path)],
        [lmdb(tmp_path)],
        [dram(2), lmdb(tmp_path), remote(tmp_path)],
    ]
    for tiers in mixes:
        async with TieredCache.from_config(cfg(*tiers)) as cache:
            await cache.store(TOKENS, kv)
            await cache.flush()
            calls = Calls(torch.zeros_like(kv), kv)
            got = await cache.load(TOKENS, out=calls.out, on_layers=calls)
            assert same_bytes(got, kv), tiers
            assert [n for n, _ in calls.calls] == [1, 3, 8]
            assert all(t == 96 for _, t in calls.calls) and all(calls.exact)


async def test_a_corrupt_later_layer_shortens_later_waves_only(tmp_path: Path) -> None:
    kv = make_kv(layout(), 96, seed=5)
    config = cfg(remote(tmp_path))
    async with TieredCache.from_config(config) as cache:
        await cache.store(TOKENS, kv)
        keys = cache.keys(TOKENS)
    # flip a byte of layer 5 of chunk 3 (wave 2 covers layers 3-7)
    path = next(p for p in (tmp_path / "pool").rglob(keys[3].hex()))
    raw = bytearray(path.read_bytes())
    header = len(raw) - layout().chunk_bytes
    raw[header + 5 * layout().layer_bytes + 7] ^= 0xFF
    path.write_bytes(bytes(raw))
    async with TieredCache.from_config(config) as cache:
        out = torch.zeros_like(kv)
        calls = Calls(out, kv)
        got = await cache.load(TOKENS, out=out, on_layers=calls)
        # The waves are read at once, so the corrupt object may be gone (deleted when wave
        # 2 found it) before waves 0 and 1 read it: those then end at it too.
        assert [n for n, _ in calls.calls] == [1, 3, 8]
        assert all(t in (96, 48) for _, t in calls.calls[:2])
        assert calls.calls[2] == (8, 48)
        assert all(calls.exact)
        assert got.shape[2] == 48 and same_bytes(got, kv[:, :, :48])
        assert cache.stats().tiers[0].corrupt == 1
        assert not path.exists()  # a bad object is deleted, as by `get`


async def test_a_miss_in_the_middle_reports_the_run_before_it(tmp_path: Path) -> None:
    kv = make_kv(layout(), 96, seed=6)
    config = cfg(remote(tmp_path))
    async with TieredCache.from_config(config) as cache:
        await cache.store(TOKENS, kv)
        keys = cache.keys(TOKENS)
        await cache.tiers[0].delete([keys[4]])
    async with TieredCache.from_config(config) as cache:
        calls = Calls(torch.zeros_like(kv), kv)
        got = await cache.load(TOKENS, out=calls.out, on_layers=calls)
        assert got.shape[2] == 64
        assert calls.calls == [(1, 64), (3, 64), (8, 64)] and all(calls.exact)


async def test_nothing_cached_reports_zero_tokens(tmp_path: Path) -> None:
    async with TieredCache.from_config(cfg(dram(), remote(tmp_path))) as cache:
        calls: list[tuple[int, int]] = []
        got = await cache.load(TOKENS, on_layers=lambda n, t: calls.append((n, t)))
        assert got.shape[2] == 0
        assert calls == [(1, 0), (3, 0), (8, 0)]


async def test_a_raising_callback_is_logged_and_the_load_completes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = make_kv(layout(), 96)
    calls: list[int] = []

    def bad(num_layers: int, num_tokens: int) -> None:
        calls.append(num_layers)
        raise RuntimeError("engine bug")

    async with TieredCache.from_config(cfg(dram(), remote(tmp_path))) as cache:
        await cache.store(TOKENS, kv)
        await cache.flush()
    async with TieredCache.from_config(cfg(dram(), remote(tmp_path))) as cache:
        assert same_bytes(await cache.load(TOKENS, on_layers=bad), kv)
        assert calls == [1]
        assert "on_layers raised" in caplog.text
        assert cache.pin_count() == 0


async def test_get_chunks_layerwise_into_strided_views(tmp_path: Path) -> None:
    kv = make_kv(layout(), 96, seed=9)
    async with TieredCache.from_config(cfg(dram(), remote(tmp_path))) as cache:
        await cache.store(TOKENS, kv)
        await cache.flush()
        keys = cache.keys(TOKENS)
    async with TieredCache.from_config(cfg(dram(), remote(tmp_path))) as cache:
        out = torch.zeros_like(kv)
        dsts = [out.narrow(2, i * 16, 16) for i in range(2, 6)]  # strided views
        calls = Calls(out, kv)
        # tokens count from keys[2], so compare against that part
        calls.kv, calls.out = kv[:, :, 32:], out[:, :, 32:]
        found = await cache.get_chunks(keys[2:], dsts, parent=keys[1], on_layers=calls)
        assert found == [True] * 4
        assert calls.calls == [(1, 64), (3, 64), (8, 64)] and all(calls.exact)
        assert same_bytes(out[:, :, 32:], kv[:, :, 32:])
        assert not out[:, :, :32].any()


async def test_integrity_on_reads_whole_chunks_in_the_first_wave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = make_kv(layout(), 96, seed=2)
    monkeypatch.setenv("KVTIERS_TEST_LAYERWISE_KEY", os.urandom(32).hex())
    options = {"integrity": "hmac-sha256", "integrity_key_env": "KVTIERS_TEST_LAYERWISE_KEY"}
    config = cfg(remote(tmp_path, **options))
    async with TieredCache.from_config(config) as cache:
        await cache.store(TOKENS, kv)
    async with TieredCache.from_config(config) as cache:
        assert not cache.tiers[0].layer_reads
        calls = Calls(torch.zeros_like(kv), kv)
        got = await cache.load(TOKENS, out=calls.out, on_layers=calls)
        assert same_bytes(got, kv)
        # every layer arrives at once, so all waves are final together
        assert calls.calls == [(1, 96), (3, 96), (8, 96)] and all(calls.exact)


async def test_the_base_get_layers_copies_only_the_layers_asked(tmp_path: Path) -> None:
    kv = make_kv(layout(), 96, seed=4)
    async with TieredCache.from_config(cfg(lmdb(tmp_path))) as cache:
        await cache.store(TOKENS, kv)
        tier, keys = cache.tiers[0], cache.keys(TOKENS)
        bufs = [np.zeros(layout().chunk_bytes, np.uint8) for _ in range(2)]
        assert await tier.get_layers([keys[0], b"\0" * 16], [2, 3], bufs) == [True, False]
        step = layout().layer_bytes
        want = kv[:, :, :16].contiguous().view(torch.uint8).numpy().reshape(-1)
        assert np.array_equal(bufs[0][2 * step : 4 * step], want[2 * step : 4 * step])
        assert not bufs[0][: 2 * step].any() and not bufs[0][4 * step :].any()
        assert not bufs[1].any()


async def test_layer_reads_off_reads_whole_objects(tmp_path: Path) -> None:
    kv = make_kv(layout(), 96, seed=8)
    config = cfg(remote(tmp_path, layer_reads=False))
    async with TieredCache.from_config(config) as cache:
        await cache.store(TOKENS, kv)
    async with TieredCache.from_config(config) as cache:
        assert not cache.tiers[0].layer_reads
        calls = Calls(torch.zeros_like(kv), kv)
        assert same_bytes(await cache.load(TOKENS, out=calls.out, on_layers=calls), kv)
        assert calls.calls == [(1, 96), (3, 96), (8, 96)] and all(calls.exact)


async def test_layer_reads_default_on_for_local_files_only(tmp_path: Path) -> None:
    url = f"memory://layerwise-{os.urandom(4).hex()}"
    async with TieredCache.from_config(cfg(remote(tmp_path))) as local:
        assert local.tiers[0].layer_reads
    async with TieredCache.from_config(cfg({**remote(tmp_path), "url": url})) as other:
        assert not other.tiers[0].layer_reads
    on = {**remote(tmp_path), "url": url, "layer_reads": True}
    async with TieredCache.from_config(cfg(on)) as other:
        assert other.tiers[0].layer_reads


@pytest.mark.parametrize("value", [1, "yes", None])
def test_layer_reads_must_be_a_bool(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.layer_reads: expected true or false"):
        TieredCache.from_config(cfg(remote(tmp_path, layer_reads=value)))


def test_explain_says_whether_layer_reads_are_on(tmp_path: Path, capsys) -> None:
    from kvtiers.cli import main

    config = tmp_path / "tiers.toml"
    pool = f"file://{tmp_path}/pool"
    config.write_text(
        "[layout]\nmodel = 'm'\nnum_layers = 8\nnum_kv_heads = 2\nhead_size = 8\n"
        "dtype = 'float16'\nchunk_size = 16\n"
        f"[[tiers]]\nkind = 'remote'\nurl = '{pool}'\ncapacity = '4MiB'\n"
        "[[tiers]]\nkind = 'remote'\nname = 'other'\nurl = 'memory://explain'\n"
        "capacity = '4MiB'\n"
    )
    assert main(["explain", str(config)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "layer reads" in line]
    assert lines == [
        "  layer reads on: layer-wise loads read waves of layers (the default here; see "
        "layer_reads)",
        "  layer reads off (the default here; see layer_reads)",
    ]


async def test_waves_into_an_out_with_a_strided_last_axis_are_exact(tmp_path: Path) -> None:
    # Such an `out` has no host-bytes view: each wave's chunks are copied as tensors, in
    # one batch per wave.
    kv = make_kv(layout(), 96)
    config = cfg(remote(tmp_path))
    async with TieredCache.from_config(config) as cache:
        await cache.store(TOKENS, kv)
        await cache.flush()
        out = torch.zeros_like(kv).transpose(3, 4).contiguous().transpose(3, 4)
        calls = Calls(out, kv)
        assert same_bytes(await cache.load(TOKENS, out=out, on_layers=calls), kv)
        assert calls.calls == [(1, 96), (3, 96), (8, 96)] and all(calls.exact)
