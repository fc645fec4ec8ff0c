"""The worker side of the vLLM connector against a real cache and CPU-layout KV tensors."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvtiers import TieredCache
from kvtiers.integrations import _vllm_loads as loads_module
from kvtiers.integrations._runtime import CacheRegistry
from kvtiers.integrations._vllm_kv import PagedLayout
from kvtiers.integrations._vllm_plan import (
    ConnectorSettings,
    LoadSpec,
    SaveSpec,
    StepPlan,
    tokens_to_bytes,
)
from kvtiers.integrations._vllm_worker import WorkerSide, layer_order
from tests.conftest import make_config, small_layout

BS, NB = 8, 12
LAYOUT = small_layout()  # 2 layers, 2 heads, head size 8, float16, chunks of 16 tokens
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers)]
TOKENS = list(range(500, 548))  # three chunks


def paged_layers(seed: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (NB, LAYOUT.num_kv_heads, BS, 2 * LAYOUT.head_size)
    return {
        name: (torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)).half()
        for name in NAMES
    }


@pytest.fixture
def registry():
    return CacheRegistry()


def worker(registry, layers, *, groups=None, async_loads=False, **settings) -> WorkerSide:
    entry = registry.acquire("k", lambda: TieredCache.from_config(make_config()))
    paged = PagedLayout("cpu", NB, BS, LAYOUT.num_kv_heads, LAYOUT.head_size)
    return WorkerSide(
        ConnectorSettings(**settings), entry, layers, paged, LAYOUT, groups, async_loads
    )


def blocks_of(layers, ids):
    return [layers[n][ids] for n in NAMES]


@pytest.mark.parametrize("pipelined", [False, True], ids=["per-layer", "queued"])
def test_saved_blocks_load_back_into_other_blocks(registry, pipelined):
    # "queued" runs the CUDA path's logic on the CPU (its stream and events are no-ops)
    src_layers = paged_layers(seed=1)
    saving = worker(registry, src_layers)
    save_ids = (3, 7, 1, 9, 0, 4)  # 48 tokens in six blocks, out of order
    plan = StepPlan(saves=[SaveSpec("r1", tokens_to_bytes(TOKENS), None, (save_ids,))])
    saving.begin_saves(plan)
    for name in NAMES:  # the forward pass leaves each attention layer
        saving.save_layer(name, src_layers[name])
    saving.finish_step()
    assert saving.flush(10)
    assert saving.take_counts()["saved_tokens"] == 48

    dst_layers = paged_layers(seed=None)
    loading = WorkerSide(saving._settings, saving._entry, dst_layers, saving._kv.paged, LAYOUT)
    loading._pipelined = pipelined
    load_ids = (5, 2, 11, 6)  # tokens 16..48 of the request (skip the first chunk)
    spec = LoadSpec("r2", tokens_to_bytes(TOKENS), None, (load_ids,), start=16, end=48)
    loading.start_load(StepPlan(loads=[spec]))
    for name in NAMES:
        loading.wait_for_layer(name)
    loading.finish_step()
    assert loading.take_failed_blocks() == set()
    for got, want in zip(
        blocks_of(dst_layers, list(load_ids)), blocks_of(src_layers, [1, 9, 0, 4]), strict=True
    ):
        assert torch.equal(got, want)
    counts = loading.take_counts()
    assert counts["loaded_tokens"] == 32
    assert counts["hits_dram"] == 2  # the chunk vLLM computed itself is not read again

    mid = LoadSpec("r3", tokens_to_bytes(TOKENS), None, ((10, 8, 3),), start=24, end=48)
    loading.start_load(StepPlan(loads=[mid]))  # from the middle of the second chunk
    for name in NAMES:
        loading.wait_for_layer(name)
    loading.finish_step()
    assert loading.take_failed_blocks() == set()
    for got, want in zip(
        blocks_of(dst_layers, [10, 8, 3]), blocks_of(src_layers, [9, 0, 4]), strict=True
    ):
        assert torch.equal(got, want)
    counts = loading.take_counts()
    assert counts["loaded_tokens"] == 24 and counts["hits_dram"] == 2
    registry.release(saving._entry)


def test_the_staging_of_a_step_serves_the_next_steps(registry):
    layers = paged_layers(seed=3)
    w = worker(registry, layers)
    saves = [SaveSpec("r1", tokens_to_bytes(TOKENS), None, ((0, 1, 2, 3, 4, 5),))]
    w.begin_saves(StepPlan(saves=saves))
    staged = w._saves._saves[0].staging.data_ptr()
    for name in NAMES:
        w.save_layer(name, layers[name])
    w.finish_step()
    assert w.flush(10)
    assert w._staging.idle_bytes > 0  # back once the cache holds the chunks
    spec = LoadSpec("r2", tokens_to_bytes(TOKENS), None, ((6, 7, 8, 9, 10, 11),), 0, 48)
    w.start_load(StepPlan(loads=[spec]))
    assert w._loads[0].staging.data_ptr() == staged
    for name in NAMES:
        w.wait_for_layer(name)
    w.finish_step()
    assert w.take_failed_blocks() == set()
    for got, want in zip(
        blocks_of(layers, [6, 7, 8, 9, 10, 11]), blocks_of(layers, [0, 1, 2, 3, 4, 5]), strict=True
    ):
        assert torch.equal(got, want)
    assert w._staging.idle_bytes > 0
    registry.release(w._entry)


def save_step(w: WorkerSide, layers, tokens) -> None:
    """Run one step that saves `tokens` from the first blocks of `layers`."""
    ids = (tuple(range(len(tokens) // BS)),)
    w.begin_saves(StepPlan(saves=[SaveSpec("r", tokens_to_bytes(tokens), None, ids)]))
    for name in NAMES:
        w.save_layer(name, layers[name])
    w.finish_step()


def test_clearing_waits_for_saves_in_flight_so_none_lands_after_it(registry, monkeypatch):
    layers = paged_layers(seed=4)
    w = worker(registry, layers)
    cache, loop = w._entry.cache, w._entry.loop
    other = list(range(900, 932))
    save_step(w, layers, other)
    assert w.flush(10)  # two chunks stored
    store = cache.store

    async def slow_store(*args, **kwargs):
        await asyncio.sleep(0.3)
        return await store(*args, **kwargs)

    monkeypatch.setattr(cache, "store", slow_store)
    save_step(w, layers, TOKENS)  # stored in the background, slowly
    assert w._saves.pending()
    assert loop.run(w.clear_cache(10), 30) == 5  # both saves' chunks, in DRAM
    assert not w._saves.pending()
    assert loop.run(cache.lookup(TOKENS), 10) == 0
    assert loop.run(cache.lookup(other), 10) == 0
    registry.release(w._entry)


def test_blocks_beyond_the_cached_prefix_are_reported_failed(registry):
    layers = paged_layers(seed=2)
    w = worker(registry, layers)
    plan = StepPlan(saves=[SaveSpec("r1", tokens_to_bytes(TOKENS[:16]), None, ((0, 1),))])
    w.begin_saves(plan)
    w.finish_step()  # an empty step: the layers are gathered here
    assert w.flush(10)
    spec = LoadSpec("r2", tokens_to_bytes(TOKENS), None, ((4, 5, 6, 7, 8, 9),), start=0, end=48)
    w.start_load(StepPlan(loads=[spec]))
    for name in NAMES:
        w.wait_for_layer(name)
    w.finish_step()
    assert w.take_failed_blocks() == {6, 7, 8, 9}  # only the first chunk was cached
    assert torch.equal(layers[NAMES[0]][4], layers[NAMES[0]][0])
    registry.release(w._entry)


def test_layers_the_forward_pass_skipped_are_reported_failed(registry):
    layers = paged_layers(seed=3)
    w = worker(registry, layers)
    w.begin_saves(StepPlan(saves=[SaveSpec("r1", tokens_to_bytes(TOKENS[:16]), None, ((0, 1),))]))
    w.finish_step()
    w.flush(10)
    w.start_load(
        StepPlan(loads=[LoadSpec("r2", tokens_to_bytes(TOKENS[:16]), None, ((2, 3),), 0, 16)])
    )
    w.wait_for_layer(NAMES[0])  # the second layer's hook never comes
    w.finish_step()
    assert w.take_failed_blocks() == {2, 3}
    registry.release(w._entry)


def test_a_closed_cache_fails_loads_and_skips_saves_without_raising(registry):
    layers = paged_layers(seed=4)
    w = worker(registry, layers, load_timeout_s=5)
    registry.release(w._entry)  # the cache and its loop are gone
    w.start_load(
        StepPlan(loads=[LoadSpec("r", tokens_to_bytes(TOKENS[:16]), None, ((2, 3),), 0, 16)])
    )
    w.begin_saves(
        StepPlan(
            saves=[SaveSpec("s", tokens_to_bytes(TOKENS[:16]), None, ((0, 1),), finished=True)]
        )
    )
    for name in NAMES:
        w.wait_for_layer(name)
        w.save_layer(name, layers[name])
    w.finish_step()
    assert w.take_failed_blocks() == {2, 3}
    assert w.take_finished() == {"s"}  # vLLM may free the blocks all the same
    assert w.take_counts()["save_errors"] == 1


def test_layer_order_follows_the_layer_index():
    assert layer_order(["model.layers.10.attn", "model.layers.2.attn"]) == [
        "model.layers.2.attn",
        "model.layers.10.attn",
    ]
    assert layer_order(["b", "a"]) == ["b", "a"]


@pytest.mark.gpu
def test_cuda_loads_queue_layers_as_they_arrive_and_compute_waits_on_the_device(registry):
    """Flash layout on a CUDA device: copies on the copy stream, one event per layer."""
    device = torch.device("cuda")
    shape = (2, NB, BS, LAYOUT.num_kv_heads, LAYOUT.head_size)
    gen = torch.Generator().manual_seed(5)
    src = {n: torch.randn(shape, generator=gen).half().to(device) for n in NAMES}
    dst = {n: torch.zeros(shape, dtype=torch.float16, device=device) for n in NAMES}
    entry = registry.acquire("k", lambda: TieredCache.from_config(make_config()))
    paged = PagedLayout("flash", NB, BS, LAYOUT.num_kv_heads, LAYOUT.head_size)
    saving = WorkerSide(ConnectorSettings(), entry, src, paged, LAYOUT)
    saving.begin_saves(
        StepPlan(saves=[SaveSpec("r1", tokens_to_bytes(TOKENS), None, ((3, 7, 1, 9, 0, 4),))])
    )
    for name in NAMES:
        saving.save_layer(name, src[name])
    saving.finish_step()
    assert saving.flush(10)
    loading = WorkerSide(ConnectorSettings(), entry, dst, paged, LAYOUT)
    assert loading._pipelined
    spec = LoadSpec("r2", tokens_to_bytes(TOKENS), None, ((5, 2, 11, 6),), start=16, end=48)
    loading.start_load(StepPlan(loads=[spec]))
    assert loading._loads[0].staging.is_pinned()  # so the copies do not block the host
    loading.wait_for_layer(NAMES[0])
    assert 0 in loading._layer_events  # with every layer whose wave has arrived
    for name in NAMES[1:]:
        loading.wait_for_layer(name)
    after = {n: dst[n] * 1 for n in NAMES}  # queued behind the events on the compute stream
    loading.finish_step()
    torch.cuda.synchronize()
    assert loading.take_failed_blocks() == set()
    for n in NAMES:
        assert torch.equal(after[n][:, [5, 2, 11, 6]], src[n][:, [1, 9, 0, 4]])
    registry.release(entry)


# -- layer-wise loads from a tier that reads some layers ------------------------------------

DEEP = small_layout(num_layers=8)  # waves of 1, 2 and 5 layers
DEEP_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(DEEP.num_layers)]


def deep_layers(seed: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (NB, DEEP.num_kv_heads, BS, 2 * DEEP.head_size)
    return {
        n: (torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)).half()
        for n in DEEP_NAMES
    }


def deep_worker(registry, tmp_path, layers, key) -> WorkerSide:
    config = {
        "layout": DEEP.to_dict(),
        "tiers": [{"kind": "remote", "url": f"file://{tmp_path}/pool", "capacity": "4MiB"}],
    }
    entry = registry.acquire(key, lambda: TieredCache.from_config(config))
    paged = PagedLayout("cpu", NB, BS, DEEP.num_kv_heads, DEEP.head_size)
    return WorkerSide(ConnectorSettings(load_timeout_s=20), entry, layers, paged, DEEP)


def save_deep(registry, tmp_path, src) -> list[bytes]:
    saving = deep_worker(registry, tmp_path, src, "save")
    plan = StepPlan(saves=[SaveSpec("r1", tokens_to_bytes(TOKENS), None, ((3, 7, 1, 9, 0, 4),))])
    saving.begin_saves(plan)
    saving.finish_step()
    assert saving.flush(10)
    keys = saving._entry.cache.keys(TOKENS)
    registry.release(saving._entry)
    return keys


def test_early_layers_are_written_before_later_waves_arrive(registry, tmp_path, monkeypatch):
    """The remote tier's reads of waves after the first are held back until released.

    The tier is real (`file://`); only its latency is made controllable, so that what
    `wait_for_layer` waits for is observable.
    """
    import asyncio

    from kvtiers.tiers.remote import RemoteTier

    src = deep_layers(seed=7)
    save_deep(registry, tmp_path, src)
    gate = {"open": None}
    real = RemoteTier.get_layers

    async def held(self, keys, layers, dsts, *, tally=True):
        if 0 not in layers:
            if gate["open"] is None:
                gate["open"] = asyncio.Event()
            await gate["open"].wait()
        return await real(self, keys, layers, dsts, tally=tally)

    monkeypatch.setattr(RemoteTier, "get_layers", held)
    dst = deep_layers(seed=None)
    loading = deep_worker(registry, tmp_path, dst, "load")
    spec = LoadSpec("r2", tokens_to_bytes(TOKENS), None, ((5, 2, 11, 6, 8, 10),), start=0, end=48)
    loading.start_load(StepPlan(loads=[spec]))
    loading.wait_for_layer(DEEP_NAMES[0])  # returns with later waves still held
    assert not loading._loads[0].future.done()
    assert torch.equal(
        dst[DEEP_NAMES[0]][[5, 2, 11, 6, 8, 10]], src[DEEP_NAMES[0]][[3, 7, 1, 9, 0, 4]]
    )
    assert not dst[DEEP_NAMES[1]].any()
    loop = loading._entry.loop
    loop.run(_open(gate), 5)
    for name in DEEP_NAMES[1:]:
        loading.wait_for_layer(name)
    loading.finish_step()
    assert loading.take_failed_blocks() == set()
    for n in DEEP_NAMES:
        assert torch.equal(dst[n][[5, 2, 11, 6, 8, 10]], src[n][[3, 7, 1, 9, 0, 4]])
    counts = loading.take_counts()
    assert counts["loaded_tokens"] == 48 and counts["hits_remote"] == 3  # one per chunk
    registry.release(loading._entry)


async def _open(gate) -> None:
    gate["open"].set()


def test_a_corrupt_later_layer_fails_only_its_chunk_and_after(registry, tmp_path):
    src = deep_layers(seed=8)
    keys = save_deep(registry, tmp_path, src)
    path = next((tmp_path / "pool").rglob(keys[1].hex()))
    raw = bytearray(path.read_bytes())
    raw[len(raw) - DEEP.chunk_bytes + 4 * DEEP.layer_bytes + 3] ^= 0x5A  # layer 4, the last wave
    path.write_bytes(bytes(raw))
    dst = deep_layers(seed=None)
    loading = deep_worker(registry, tmp_path, dst, "load")
    ids = (5, 2, 11, 6, 8, 10)
    loading.start_load(
        StepPlan(loads=[LoadSpec("r2", tokens_to_bytes(TOKENS), None, (ids,), 0, 48)])
    )
    for name in DEEP_NAMES:
        loading.wait_for_layer(name)
    loading.finish_step()
    assert loading.take_failed_blocks() == {11, 6, 8, 10}  # chunks 1 and 2: recomputed
    for n in DEEP_NAMES:
        assert torch.equal(dst[n][[5, 2]], src[n][[3, 7]])  # chunk 0, every layer
    assert loading.take_counts()["loaded_tokens"] == 16
    registry.release(loading._entry)


def _hold_later_waves(monkeypatch) -> None:
    """Make the remote tier's reads of every wave after the first wait forever."""
    import asyncio

    from kvtiers.tiers.remote import RemoteTier

    real = RemoteTier.get_layers

    async def held(self, keys, layers, dsts, *, tally=True):
        if 0 not in layers:
            await asyncio.Event().wait()
        return await real(self, keys, layers, dsts, tally=tally)

    monkeypatch.setattr(RemoteTier, "get_layers", held)


def held_worker(registry, tmp_path, layers, timeout_s: float) -> WorkerSide:
    config = {
        "layout": DEEP.to_dict(),
        "tiers": [
            {"kind": "dram", "capacity": 16 * DEEP.chunk_bytes},
            {"kind": "remote", "url": f"file://{tmp_path}/pool", "capacity": "4MiB"},
        ],
    }
    entry = registry.acquire("held", lambda: TieredCache.from_config(config))
    paged = PagedLayout("cpu", NB, BS, DEEP.num_kv_heads, DEEP.head_size)
    return WorkerSide(ConnectorSettings(load_timeout_s=timeout_s), entry, layers, paged, DEEP)


async def _pins(cache) -> int:
    return cache.pin_count()


def test_a_load_past_its_deadline_mid_waves_fails_every_block_and_frees_the_cache(
    registry, tmp_path, monkeypatch
):
    import time

    src = deep_layers(seed=9)
    save_deep(registry, tmp_path, src)
    _hold_later_waves(monkeypatch)
    dst = deep_layers(seed=None)
    loading = held_worker(registry, tmp_path, dst, timeout_s=0.3)
    ids = (5, 2, 11, 6, 8, 10)
    loading.start_load(
        StepPlan(loads=[LoadSpec("r2", tokens_to_bytes(TOKENS), None, (ids,), 0, 48)])
    )
    started = time.monotonic()
    for name in DEEP_NAMES:
        loading.wait_for_layer(name)
    loading.finish_step()
    assert time.monotonic() - started < 5  # one deadline for the step, not one per layer
    assert loading.take_failed_blocks() == set(ids)
    counts = loading.take_counts()
    assert counts["load_errors"] == 1 and counts.get("loaded_tokens", 0) == 0
    assert loading._staging.idle_bytes == 0  # a given-up load's staging may still be written
    entry = loading._entry
    deadline = time.monotonic() + 5
    while entry.loop.run(_pins(entry.cache), 5) and time.monotonic() < deadline:
        time.sleep(0.01)  # the given-up load is cancelled on the loop
    assert entry.loop.run(_pins(entry.cache), 5) == 0
    registry.release(entry)  # closes: nothing of the load is left running


def test_the_loop_dying_mid_waves_fails_the_load_without_waiting_out_the_deadline(
    registry, tmp_path, monkeypatch
):
    import time

    src = deep_layers(seed=10)
    save_deep(registry, tmp_path, src)
    _hold_later_waves(monkeypatch)
    dst = deep_layers(seed=None)
    loading = held_worker(registry, tmp_path, dst, timeout_s=30)
    ids = (5, 2, 11, 6, 8, 10)
    loading.start_load(
        StepPlan(loads=[LoadSpec("r2", tokens_to_bytes(TOKENS), None, (ids,), 0, 48)])
    )
    loading.wait_for_layer(DEEP_NAMES[0])  # the first wave arrived
    assert torch.equal(dst[DEEP_NAMES[0]][list(ids)], src[DEEP_NAMES[0]][[3, 7, 1, 9, 0, 4]])
    started = time.monotonic()
    loading._entry.loop.stop()  # the loop is gone with the later waves in flight
    for name in DEEP_NAMES[1:]:
        loading.wait_for_layer(name)
    loading.finish_step()
    assert time.monotonic() - started < 10
    assert loading.take_failed_blocks() == set(ids)
    assert not dst[DEEP_NAMES[1]].any()
    registry.release(loading._entry)


def settle(w: WorkerSide) -> tuple[set[str], set[str]]:
    """Wait for the worker's asynchronous loads to end; return what `take_loads` reports."""
    deadline = time.monotonic() + 10
    received: set[str] = set()
    failed: set[str] = set()
    while w._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
        got, bad = w.take_loads()
        received |= got
        failed |= bad
    return received, failed


def test_hybrid_layers_move_through_their_group_blocks_and_loads_are_asynchronous(
    registry, monkeypatch
):
    """Under vLLM's hybrid KV-cache manager each layer has its KV-cache group's blocks:
    saves gather each layer from its group's blocks, chunk by chunk as steps complete
    them; an asynchronous load writes every layer at once, skips the null blocks behind a
    window, and reports the request received (or failed)."""
    groups = {NAMES[0]: 0, NAMES[1]: 1}
    src = paged_layers(seed=7)
    saving = worker(registry, src, groups=groups)
    first = SaveSpec("r1", tokens_to_bytes(TOKENS[:16]), None, ((0, 1), (6, 7)))
    rest = SaveSpec("r1", tokens_to_bytes(TOKENS), None, ((2, 3, 4, 5), (8, 9, 10, 11)), start=16)
    for spec in (first, rest):  # two steps of a chunked prefill
        saving.begin_saves(StepPlan(saves=[spec]))
        for name in NAMES:
            saving.save_layer(name, src[name])
        saving.finish_step()
    assert saving.flush(10)
    assert saving.take_counts()["saved_tokens"] == 48

    dst = paged_layers(seed=None)
    loading = worker(registry, dst, groups=groups, async_loads=True)
    behind = (0, 0, 2, 3, 4, 5)  # the window's group: its first chunk's blocks were freed
    spec = LoadSpec("r2", tokens_to_bytes(TOKENS), None, ((6, 7, 8, 9, 10, 11), behind), 0, 48)
    loading.start_load(StepPlan(loads=[spec]))
    for name in NAMES:
        loading.wait_for_layer(name)  # not in the forward pass: nothing waits here
    loading.finish_step()
    assert settle(loading) == ({"r2"}, set())
    assert torch.equal(dst[NAMES[0]][6:12], src[NAMES[0]][0:6])
    assert torch.equal(dst[NAMES[1]][2:6], src[NAMES[1]][8:12])
    assert not dst[NAMES[1]][0].any()  # the null block is never written
    assert loading.take_failed_blocks() == set()
    assert loading.take_counts()["loaded_tokens"] == 48

    # An idle step (nothing computed) waits a little for a load to end, instead of
    # reporting nothing and stepping again at once; here the wait is made long.
    monkeypatch.setattr(loads_module, "IDLE_WAIT_S", 30.0)
    loading.start_load(StepPlan(loads=[spec]))
    loading.idle_wait(waiting=False)
    assert loading.take_loads() == ({"r2"}, set())
    monkeypatch.setattr(loads_module, "IDLE_WAIT_S", 0.0)
    loading.idle_wait(waiting=True)  # nothing in flight: a pause (of 0 s here)

    other = [t + 1000 for t in TOKENS]  # never stored: the load comes up short
    missing = LoadSpec("r3", tokens_to_bytes(other), None, ((6, 7, 8, 9, 10, 11), behind), 0, 48)
    loading.start_load(StepPlan(loads=[missing]))
    assert settle(loading) == ({"r3"}, {"r3"})
    assert loading.take_failed_blocks() == set()  # vLLM takes failed requests, not blocks
    registry.release(saving._entry)
    registry.release(loading._entry)


def test_saves_carry_the_requests_reuse_hint_into_the_cache(registry):
    """The chunks past `keep_tokens` are stored cold, whether a save starts at the first
    chunk (`store`) or at a later one (`put_chunks` under its parent)."""
    layers = paged_layers(seed=3)
    w = worker(registry, layers)
    first = SaveSpec("r", tokens_to_bytes(TOKENS[:16]), None, ((0, 1),), keep_tokens=20)
    rest = SaveSpec("r", tokens_to_bytes(TOKENS), None, ((2, 3, 4, 5),), start=16, keep_tokens=20)
    other = list(range(900, 948))
    plain = SaveSpec("o", tokens_to_bytes(other), None, ((6, 7, 8, 9, 10, 11),), keep_tokens=0)
    for plan in (StepPlan(saves=[first]), StepPlan(saves=[rest, plain])):
        w.begin_saves(plan)
        for name in NAMES:
            w.save_layer(name, layers[name])
        w.finish_step()
        assert w.flush(10)
    cache = w._entry.cache
    policy = cache._mover._slots[0].policy
    cold = set(list(policy.candidates())[: policy.num_cold])
    assert [key in cold for key in cache.keys(TOKENS)] == [False, True, True]
    assert [key in cold for key in cache.keys(other)] == [True] * 3
    registry.release(w._entry)
