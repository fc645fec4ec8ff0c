"""Layer-wise loads under stress: odd destinations, big chunks, failures, races, cancellation.

Each check holds the promise of `on_layers`: every call's layers are exact for its tokens
(and stay so), calls come once per wave in order, `num_tokens` never grows, the result is
at most the last call's tokens, and no pin outlives the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtiers import TieredCache
from kvtiers._streaming import layer_waves
from kvtiers.core.layout import KVLayout
from tests.conftest import make_kv, same_bytes

pytestmark = pytest.mark.filterwarnings("error")

HANG = 30  # seconds: a guard against hangs, never a timing assertion


def layout_dict(num_layers: int = 8, kind: str = "mha", **extra: Any) -> dict[str, Any]:
    heads, size = (1, 16) if kind == "mla" else (2, 8)
    return {
        "model": "qa-model",
        "num_layers": num_layers,
        "num_kv_heads": heads,
        "head_size": size,
        "dtype": "float16",
        "chunk_size": 16,
        "kind": kind,
        **extra,
    }


def remote(tmp_path: Path, *, memory: bool = False) -> dict[str, Any]:
    if memory:
        url = f"memory://qa-{os.urandom(6).hex()}"
        return {"kind": "remote", "url": url, "capacity": "64MiB", "layer_reads": True}
    return {"kind": "remote", "url": f"file://{tmp_path}/pool", "capacity": "64MiB"}


def chunk_bytes(kv: torch.Tensor, i: int, size: int = 16) -> np.ndarray:
    return kv[:, :, i * size : (i + 1) * size].contiguous().view(torch.uint8).numpy().reshape(-1)


class Watch:
    """An `on_layers` callback that checks each call against the expected KV."""

    def __init__(self, out: torch.Tensor, kv: torch.Tensor, num_layers: int) -> None:
        self.out, self.kv = out, kv
        self.calls: list[tuple[int, int]] = []
        self.faults: list[Any] = []
        self._waves = [w.stop for w in layer_waves(num_layers)]

    def __call__(self, num_layers: int, num_tokens: int) -> None:
        if self.calls and num_tokens > self.calls[-1][1]:
            self.faults.append(("grew", self.calls[-1], (num_layers, num_tokens)))
        self.calls.append((num_layers, num_tokens))
        # every layer reported so far, not only this wave's: final means final
        if not same_bytes(
            self.out[:num_layers, :, :num_tokens], self.kv[:num_layers, :, :num_tokens]
        ):
            self.faults.append(("bytes", num_layers, num_tokens))

    def check(self, got: torch.Tensor | None = None) -> None:
        """Assert the whole story once the load returned `got` (`None`: it did not)."""
        assert not self.faults, self.faults
        if got is None:  # cancelled or refused: a prefix of the waves, in order
            assert [n for n, _ in self.calls] == self._waves[: len(self.calls)]
            return
        assert [n for n, _ in self.calls] == self._waves, self.calls
        assert got.shape[2] <= self.calls[-1][1], (got.shape, self.calls)
        assert same_bytes(got, self.kv[:, :, : got.shape[2]])
        last = self.calls[-1][1]
        assert same_bytes(self.out[:, :, :last], self.kv[:, :, :last])


# -- destinations ----------------------------------------------------------------------


async def test_big_chunks_into_strided_arrays_never_lose_a_wave(tmp_path: Path) -> None:
    # Chunks of 256 KiB and more are checked and copied in the remote tier's threads, so
    # the waves of one chunk land at once; a destination that is neither contiguous nor
    # indexed by layer must not have one wave's write undo another's.
    lay = layout_dict(61, num_kv_heads=4, head_size=64)
    layout = KVLayout(**lay)
    assert layout.chunk_bytes >= 256 * 2**10
    kv = make_kv(layout, 64, seed=1)
    tokens = list(range(64))
    config = {"layout": lay, "tiers": [remote(tmp_path)]}
    async with TieredCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        keys = cache.keys(tokens)
    calls: list[tuple[int, int]] = []
    async with TieredCache.from_config(config) as cache:
        for _ in range(5):
            pools = [np.zeros(2 * layout.chunk_bytes, np.uint8) for _ in keys]
            dsts = [pool[::2] for pool in pools]  # every other byte: strided, 1-D
            calls.clear()
            found = await cache.get_chunks(keys, dsts, on_layers=lambda n, t: calls.append((n, t)))
            assert found == [True] * 4 and calls[-1] == (61, 64)
            for i, dst in enumerate(dsts):
                assert np.array_equal(dst, chunk_bytes(kv, i)), i


def permuted_out(kv: torch.Tensor) -> torch.Tensor:
    """A zeroed tensor shaped like `kv` whose token axis is outermost in memory."""
    order = (2, 0, 1, *range(3, kv.dim()))
    base = torch.zeros([kv.shape[i] for i in order], dtype=kv.dtype)
    return base.permute(1, 2, 0, *range(3, kv.dim()))


@pytest.mark.parametrize(("num_layers", "kind"), [(1, "mha"), (61, "mha"), (80, "mla"), (8, "mla")])
@pytest.mark.parametrize("stack", ["file", "dram+memory", "dram+lmdb+file"])
@pytest.mark.parametrize("permuted", [False, True], ids=["dense", "permuted"])
async def test_every_layout_stack_and_out_loads_exact_waves(
    tmp_path: Path, num_layers: int, kind: str, stack: str, permuted: bool
) -> None:
    lay = layout_dict(num_layers, kind)
    layout = KVLayout(**lay)
    kv = make_kv(layout, 64, seed=num_layers)
    tokens = list(range(3000, 3064))
    bottom = remote(tmp_path, memory="memory" in stack)
    tiers = [bottom]
    if "lmdb" in stack:
        tiers.insert(0, {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"})
    if "dram" in stack:  # room for two chunks: most of the load is not promoted
        tiers.insert(0, {"kind": "dram", "capacity": 2 * layout.chunk_bytes})
    async with TieredCache.from_config({"layout": lay, "tiers": [bottom]}) as cache:
        await cache.store(tokens, kv)
    async with TieredCache.from_config({"layout": lay, "tiers": tiers}) as cache:
        for _ in range(2):  # cold, then with what the first load promoted
            out = permuted_out(kv) if permuted else torch.zeros_like(kv)
            watch = Watch(out, kv, num_layers)
            watch.check(await cache.load(tokens, out=out, on_layers=watch))
            assert watch.calls[-1] == (num_layers, 64)
            await cache.flush()
            assert cache.pin_count() == 0


async def test_get_chunks_with_repeated_keys_and_a_gap(tmp_path: Path) -> None:
    layout = KVLayout(**layout_dict())
    kv = make_kv(layout, 48, seed=2)
    tokens = list(range(48))
    config = {"layout": layout_dict(), "tiers": [remote(tmp_path, memory=True)]}
    async with TieredCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        keys = cache.keys(tokens)
        picks = [0, 0, 1, None, 2, 1]
        sel = [keys[i] if i is not None else b"\x01" * 16 for i in picks]
        dsts = [torch.zeros(layout.chunk_shape(), dtype=torch.float16) for _ in sel]
        calls: list[tuple[int, int]] = []

        def watch(num_layers: int, num_tokens: int) -> None:
            calls.append((num_layers, num_tokens))
            for j in range(num_tokens // 16):
                want = kv[:num_layers, :, picks[j] * 16 : picks[j] * 16 + 16]  # type: ignore[operator]
                assert same_bytes(dsts[j][:num_layers], want)

        found = await cache.get_chunks(sel, dsts, on_layers=watch)
        assert found == [True, True, True, False, True, True]
        assert calls == [(1, 48), (3, 48), (8, 48)]  # the gap holds the waves to the run
        for j, i in enumerate(picks):
            if i is None:
                assert not dsts[j].any()
            else:
                assert same_bytes(dsts[j], kv[:, :, i * 16 : i * 16 + 16])


async def test_integrity_with_layer_reads_on_reads_whole_and_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIERS_QA_KEY", os.urandom(32).hex())
    tier = {
        **remote(tmp_path, memory=True),
        "integrity": "hmac-sha256",
        "integrity_key_env": "KVTIERS_QA_KEY",
    }
    layout = KVLayout(**layout_dict())
    kv = make_kv(layout, 64, seed=3)
    tokens = list(range(64))
    async with TieredCache.from_config({"layout": layout_dict(), "tiers": [tier]}) as cache:
        await cache.store(tokens, kv)
        assert not cache.tiers[0].layer_reads  # a tag covers the whole payload
        watch = Watch(torch.zeros_like(kv), kv, 8)
        watch.check(await cache.load(tokens, out=watch.out, on_layers=watch))
        assert watch.calls == [(1, 64), (3, 64), (8, 64)]


# -- failures between waves ------------------------------------------------------------


def _stored_config(
    tmp_path: Path, memory: bool, dram: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    bottom = remote(tmp_path, memory=memory)
    tiers = ([{"kind": "dram", "capacity": "1MiB"}] if dram else []) + [bottom]
    return {"layout": layout_dict(), "tiers": [bottom]}, {"layout": layout_dict(), "tiers": tiers}


@pytest.mark.parametrize("dram", [False, True], ids=["remote", "dram+remote"])
@pytest.mark.parametrize("how", ["rmtree", "raise"])
async def test_the_store_failing_after_the_first_wave(
    tmp_path: Path, how: str, dram: bool, caplog: pytest.LogCaptureFixture
) -> None:
    layout = KVLayout(**layout_dict())
    kv = make_kv(layout, 96, seed=4)
    tokens = list(range(96))
    plain, config = _stored_config(tmp_path, memory=False, dram=dram)
    async with TieredCache.from_config(plain) as cache:
        await cache.store(tokens, kv)
    async with TieredCache.from_config(config) as cache:
        tier = cache.tiers[-1]
        watch = Watch(torch.zeros_like(kv), kv, 8)

        async def boom(*args: Any, **kwargs: Any) -> Any:
            raise OSError("the store is gone")

        def on_layers(num_layers: int, num_tokens: int) -> None:
            watch(num_layers, num_tokens)
            if num_layers == 1 and how == "rmtree":
                shutil.rmtree(tmp_path / "pool")
            elif num_layers == 1:
                tier._store.cat_ranges = boom  # type: ignore[attr-defined]
                tier._store.cat = boom  # type: ignore[attr-defined]

        got = await cache.load(tokens, out=watch.out, on_layers=on_layers)
        watch.check(got)
        assert watch.calls == [(1, 96), (3, 0), (8, 0)] and got.shape[2] == 0
        assert cache.pin_count() == 0
        if how == "rmtree":  # nothing of the partial load was promoted
            assert (await cache.load(tokens)).shape[2] == 0


@pytest.mark.parametrize("memory", [False, True], ids=["file", "memory"])
@pytest.mark.parametrize("when", [1, 3])
async def test_objects_replaced_between_waves_mix_valid_versions_only(
    tmp_path: Path, memory: bool, when: int
) -> None:
    """By design a load may take early waves from one valid version and later ones from
    another; it must never deliver a layer that is neither."""
    import fsspec

    from kvtiers.tiers._remote_catalog import object_path

    layout = KVLayout(**layout_dict())
    old, new = make_kv(layout, 96, seed=5), make_kv(layout, 96, seed=6)
    tokens = list(range(96))
    plain, _ = _stored_config(tmp_path, memory=memory, dram=False)
    async with TieredCache.from_config(plain) as cache:
        await cache.store(tokens, old)
        tier, keys = cache.tiers[0], cache.keys(tokens)
        fs = fsspec.filesystem("memory" if memory else "file")
        # a first layer-wise load leaves the headers known (later waves skip them)
        await cache.load(tokens, on_layers=lambda n, t: None)
        out = torch.zeros_like(old)
        calls: list[tuple[int, int]] = []

        def on_layers(num_layers: int, num_tokens: int) -> None:
            calls.append((num_layers, num_tokens))
            if num_layers == when:  # another process rewrites every object
                for i, key in enumerate(keys):
                    value = tier._codec.pack(key, chunk_bytes(new, i))  # type: ignore[attr-defined]
                    fs.pipe(object_path(tier.namespace, key), value)  # type: ignore[attr-defined]

        got = await cache.load(tokens, out=out, on_layers=on_layers)
        assert [n for n, _ in calls] == [1, 3, 8] and got.shape[2] <= calls[-1][1]
        for i in range(got.shape[2] // 16):
            for layer in range(8):
                part = (layer, slice(None), slice(i * 16, i * 16 + 16))
                assert same_bytes(out[part], old[part]) or same_bytes(out[part], new[part])
        assert tier.counters.corrupt == 0


# -- races -----------------------------------------------------------------------------


@pytest.mark.parametrize("memory", [False, True], ids=["file", "memory"])
@pytest.mark.parametrize("seed", [0, 1])
async def test_layerwise_loads_cancelled_anywhere_leave_no_pins(
    tmp_path: Path, memory: bool, seed: int
) -> None:
    rng = random.Random(seed)
    layout = KVLayout(**layout_dict())
    kv = make_kv(layout, 96, seed=seed)
    tokens = list(range(96))
    bottom = remote(tmp_path, memory=memory)
    config = {
        "layout": layout_dict(),
        "tiers": [{"kind": "dram", "capacity": 3 * layout.chunk_bytes}, bottom],
    }

    async def run() -> None:
        async with TieredCache.from_config(config) as cache:
            await cache.store(tokens, kv)
            for _ in range(25):
                if rng.random() < 0.3:
                    await cache.clear()
                    await cache.tiers[1].put(
                        cache.keys(tokens), [chunk_bytes(kv, i) for i in range(6)]
                    )
                watches = [Watch(torch.zeros_like(kv), kv, 8) for _ in range(2)]
                tasks = [
                    asyncio.ensure_future(cache.load(tokens, out=w.out, on_layers=w))
                    for w in watches
                ]
                for _ in range(rng.randrange(30)):
                    await asyncio.sleep(0)
                tasks[rng.randrange(2)].cancel()
                for task, w in zip(tasks, watches, strict=True):
                    with contextlib.suppress(asyncio.CancelledError):
                        w.check(await task)
                        continue
                    w.check(None)
                await cache.flush()
                assert cache.pin_count() == 0
            watch = Watch(torch.zeros_like(kv), kv, 8)
            watch.check(await cache.load(tokens, out=watch.out, on_layers=watch))

    await asyncio.wait_for(run(), HANG)


@pytest.mark.parametrize("dram_chunks", [0, 2, 5])
async def test_overlapping_layerwise_loads_with_stores_and_eviction(
    tmp_path: Path, dram_chunks: int
) -> None:
    rng = random.Random(dram_chunks)
    layout = KVLayout(**layout_dict())
    kvs = [make_kv(layout, 96, seed=10 + f) for f in range(3)]
    prompts = [list(range(f * 10_000, f * 10_000 + 96)) for f in range(3)]
    dram = [{"kind": "dram", "capacity": dram_chunks * layout.chunk_bytes}] if dram_chunks else []
    config = {"layout": layout_dict(), "tiers": [*dram, remote(tmp_path)]}

    async def loader() -> None:
        for _ in range(6):
            f, n = rng.randrange(3), rng.randint(1, 6) * 16
            kv = kvs[f][:, :, :n]
            watch = Watch(torch.zeros_like(kv), kv, 8)
            watch.check(await cache.load(prompts[f][:n], out=watch.out, on_layers=watch))

    async def storer() -> None:
        for _ in range(6):
            f = rng.randrange(3)
            await cache.store(prompts[f], kvs[f])
            await asyncio.sleep(0)

    async with TieredCache.from_config(config) as cache:
        for f in range(3):
            await cache.store(prompts[f], kvs[f])
        await asyncio.wait_for(
            asyncio.gather(*(loader() for _ in range(4)), storer(), storer()), HANG
        )
        await cache.flush()
        assert cache.pin_count() == 0


@pytest.mark.parametrize("turns", [1, 3, 8, 20])
async def test_close_racing_layerwise_loads(tmp_path: Path, turns: int) -> None:
    layout = KVLayout(**layout_dict())
    kv = make_kv(layout, 96, seed=7)
    tokens = list(range(96))
    plain, config = _stored_config(tmp_path, memory=False, dram=True)
    async with TieredCache.from_config(plain) as cache:
        await cache.store(tokens, kv)
    cache = TieredCache.from_config(config)
    await cache.open()
    watches = [Watch(torch.zeros_like(kv), kv, 8) for _ in range(3)]
    tasks = [asyncio.ensure_future(cache.load(tokens, out=w.out, on_layers=w)) for w in watches]
    for _ in range(turns):
        await asyncio.sleep(0)
    await asyncio.wait_for(cache.close(), HANG)
    for task, watch in zip(tasks, watches, strict=True):
        watch.check(await task)  # started before the close: it finishes
    assert cache.pin_count() == 0


# -- a real S3 endpoint on loopback ----------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Any:
    from tests.tiers.conftest import _start

    server = _start()
    yield server
    server.stop()


@pytest.mark.slow
async def test_layerwise_loads_from_s3_exact_and_cancelled_anywhere(s3: Any) -> None:
    lay = layout_dict(61)
    layout = KVLayout(**lay)
    kv = make_kv(layout, 96, seed=11)
    tokens = list(range(96))
    tier = {
        "kind": "remote",
        "url": s3.url("layerwise"),
        "capacity": "64MiB",
        "layer_reads": True,
        "storage_options": s3.storage_options(),
    }
    dram = {"kind": "dram", "capacity": 2 * layout.chunk_bytes}
    async with TieredCache.from_config({"layout": lay, "tiers": [tier]}) as cache:
        await cache.store(tokens, kv)
    rng = random.Random(0)
    async with TieredCache.from_config({"layout": lay, "tiers": [dram, tier]}) as cache:
        for _ in range(6):
            watch = Watch(torch.zeros_like(kv), kv, 61)
            task = asyncio.ensure_future(cache.load(tokens, out=watch.out, on_layers=watch))
            for _ in range(rng.randrange(60)):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                watch.check(await task)
                continue
            watch.check(None)
            assert cache.pin_count() == 0
        watch = Watch(torch.zeros_like(kv), kv, 61)
        watch.check(await cache.load(tokens, out=watch.out, on_layers=watch))
        assert watch.calls[-1] == (61, 96)
        await cache.flush()
        assert cache.pin_count() == 0
