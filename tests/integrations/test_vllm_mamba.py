"""A state-space model's states on the worker: out of vLLM's pages, into kvtiers, and back.

Real caches (DRAM tiers); the Mamba pages are tensors of the shape vLLM registers them with
(`(num_blocks, 1, 1, page bytes)`, int8), so no vLLM is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvtiers import ConfigError, TieredCache
from kvtiers.integrations._runtime import CacheRegistry, SharedCache
from kvtiers.integrations._vllm_mamba import MambaPages, StateStore, state_layout
from kvtiers.integrations._vllm_plan import (
    NULL_BLOCK,
    ConnectorSettings,
    LoadSpec,
    StateSave,
    tokens_to_bytes,
)
from tests.conftest import make_config, small_layout

LAYOUT = small_layout()
CHUNK = LAYOUT.chunk_size
TOKENS = np.arange(1000, 1000 + 4 * CHUNK, dtype=np.int64)
NAMES = ("model.layers.0.mixer", "model.layers.3.mixer")


def mamba_layers() -> dict[str, torch.Tensor]:
    """Two Mamba layers of different page sizes, given out of model order."""
    return {
        NAMES[1]: torch.zeros(8, 1, 1, 80, dtype=torch.int8),
        NAMES[0]: torch.zeros(8, 1, 1, 48, dtype=torch.int8),
    }


def pages_of(layers: dict[str, torch.Tensor]) -> MambaPages:
    return MambaPages(layers, {NAMES[0]: 0, NAMES[1]: 2}, (0, 2))


def fill(layers: dict[str, torch.Tensor], blocks: tuple[int, int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, block in zip(NAMES, blocks, strict=True):
        page = layers[name][block]
        page.copy_(torch.randint(-128, 127, page.shape, generator=gen, dtype=torch.int8))


def test_a_blocks_states_are_every_mamba_layers_page_in_model_order():
    layers = mamba_layers()
    pages = pages_of(layers)
    assert pages.state_bytes == 48 + 80
    fill(layers, (5, 6), seed=1)
    states = pages.gather((5, 6))  # group 0's block 5, group 2's block 6
    first, second = (layers[n].view(8, -1).view(torch.uint8).numpy() for n in NAMES)
    assert np.array_equal(states, np.concatenate([first[5], second[6]]))
    before = {n: t.clone() for n, t in layers.items()}
    pages.scatter((1, 2), states)
    assert torch.equal(layers[NAMES[0]][1], layers[NAMES[0]][5])
    assert torch.equal(layers[NAMES[1]][2], layers[NAMES[1]][6])
    for name in NAMES:  # nothing else written
        changed = (layers[name] != before[name]).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [1 if name == NAMES[0] else 2]


def test_pages_of_wider_elements_move_as_their_bytes():
    layers = {
        NAMES[0]: torch.zeros(4, 3, 5, dtype=torch.bfloat16),
        NAMES[1]: torch.zeros(4, 7, dtype=torch.float32),
    }
    layers[NAMES[0]][2] = torch.randn(3, 5).to(torch.bfloat16)
    layers[NAMES[1]][3] = torch.randn(7)
    pages = pages_of(layers)
    assert pages.state_bytes == 3 * 5 * 2 + 7 * 4
    pages.scatter((0, 0), pages.gather((2, 3)))
    assert torch.equal(layers[NAMES[0]][0], layers[NAMES[0]][2])
    assert torch.equal(layers[NAMES[1]][0], layers[NAMES[1]][3])


@pytest.fixture
def store() -> Iterator[tuple[StateStore, SharedCache, dict[str, torch.Tensor]]]:
    registry = CacheRegistry()
    kv = registry.acquire("kv", lambda: TieredCache.from_config(make_config(), layout=LAYOUT))
    layers = mamba_layers()
    pages = pages_of(layers)
    own = state_layout(LAYOUT, pages.state_bytes, 0, 1)
    states = registry.acquire("states", lambda: TieredCache.from_config(make_config(), layout=own))
    counted: list[str] = []
    yield StateStore(kv, states, pages, counted.append), kv, layers
    registry.close_all()


def on(entry: SharedCache, coro: Any) -> Any:
    return entry.loop.run(coro, 30)


def test_a_state_has_the_layout_of_opaque_bytes_per_rank():
    own = state_layout(LAYOUT, 128, 1, 2)
    assert own.model == "test-model#mamba" and own.chunk_bytes == 128
    assert (own.tp_rank, own.tp_size) == (1, 2)
    assert own.fingerprint != state_layout(LAYOUT, 128, 0, 2).fingerprint


def test_a_prefix_is_offered_up_to_the_last_chunk_whose_end_has_a_state(store):
    states, kv, layers = store
    kv_tensor = torch.randn(LAYOUT.kv_shape(len(TOKENS))).to(torch.float16)
    on(kv, kv.cache.store(TOKENS, kv_tensor))
    assert on(kv, states.locate(TOKENS, None)).num_tokens == 0  # KV alone: no state
    fill(layers, (4, 4), seed=2)
    for end in (CHUNK, 2 * CHUNK):
        states.save_all([StateSave("r", tokens_to_bytes(TOKENS[:end]), None, (4, 4))])
    assert states.flush(30)
    found = on(kv, states.locate(TOKENS, None))
    assert found.num_tokens == 2 * CHUNK and len(found.tiers) == 2
    assert found.keys == tuple(kv.cache.keys(TOKENS)[:2])  # the KV's keys of the prefix
    assert on(kv, states.locate(TOKENS, "tenant")).num_tokens == 0  # another salt's keys
    assert on(kv, states.clear()) > 0
    assert on(kv, states.locate(TOKENS, None)).num_tokens == 0


def test_a_loaded_state_is_written_after_the_kv_and_a_missing_one_fails_the_load(store):
    states, kv, layers = store
    fill(layers, (3, 5), seed=3)
    saved = states.pages.gather((3, 5))
    states.save_all([StateSave("r", tokens_to_bytes(TOKENS[: 2 * CHUNK]), None, (3, 5))])
    assert states.flush(30)
    spec = LoadSpec("r", tokens_to_bytes(TOKENS), None, (), 0, 2 * CHUNK, state_blocks=(6, 7))

    async def kv_load(tokens: int = 2 * CHUNK) -> int:
        return tokens

    assert on(kv, states.load(kv_load(), spec, TOKENS)) == 2 * CHUNK
    states.write(spec)
    assert np.array_equal(states.pages.gather((6, 7)), saved)
    with pytest.raises(LookupError):  # nothing fetched for it any more
        states.write(spec)
    missing = LoadSpec("m", tokens_to_bytes(TOKENS), None, (), 0, 3 * CHUNK, state_blocks=(6, 7))
    with pytest.raises(LookupError, match="not cached"):
        on(kv, states.load(kv_load(3 * CHUNK), missing, TOKENS))
    null = LoadSpec("n", spec.tokens, None, (), 0, 2 * CHUNK, state_blocks=(NULL_BLOCK,))
    on(kv, states.load(kv_load(), null, TOKENS))
    with pytest.raises(ValueError, match="no block"):
        states.write(null)


def test_a_short_kv_load_fetches_no_state(store):
    states, kv, _ = store
    spec = LoadSpec("r", tokens_to_bytes(TOKENS), None, (), 0, 2 * CHUNK, state_blocks=(1, 1))

    async def short() -> int:
        return CHUNK

    assert on(kv, states.load(short(), spec, TOKENS)) == CHUNK
    with pytest.raises(LookupError):
        states.write(spec)


def test_saves_are_counted(store):
    states, _, layers = store
    counted: list[str] = []
    states.count = counted.append
    states.save_all([StateSave("r", tokens_to_bytes(TOKENS[:CHUNK]), None, (1, 1))])
    assert states.flush(30)
    assert counted == ["state_saves"]


def test_the_states_cache_has_its_own_config_or_the_kvs_tiers_beside_them(tmp_path):
    """`mamba_config` sizes the states' cache; without it the states take the KV config's
    tiers, each LMDB path suffixed `-mamba` (an LMDB environment opens once per process)."""
    lmdb = {"kind": "lmdb", "path": str(tmp_path / "kv"), "capacity": "1GiB"}
    kv = {"tiers": [{"kind": "dram", "capacity": "64MiB"}, lmdb]}
    beside = ConnectorSettings.from_extra({"config": kv}).states_config()
    assert [t.kind for t in beside.tiers] == ["dram", "lmdb"]
    assert beside.tiers[0].capacity_bytes == 64 << 20
    assert beside.tiers[1].options["path"] == str(tmp_path / "kv-mamba")
    path = tmp_path / "mamba.toml"
    path.write_text('[[tiers]]\nkind = "dram"\ncapacity = "8MiB"\n')
    own = ConnectorSettings.from_extra({"config": kv, "mamba_config": str(path)}).states_config()
    assert [(t.kind, t.capacity_bytes) for t in own.tiers] == [("dram", 8 << 20)]
    clash = ConnectorSettings.from_extra({"config": kv, "mamba_config": {"tiers": [lmdb]}})
    with pytest.raises(ConfigError, match="extra_config.mamba_config: lmdb path .* KV cache's"):
        clash.states_config()
    bad = ConnectorSettings.from_extra({"config": kv, "mamba_config": {"tiers": [{"kind": "x"}]}})
    with pytest.raises(ConfigError, match="tiers"):
        TieredCache.check_tiers(bad.states_config())
    with pytest.raises(ConfigError, match="mamba_config: expected a file path or a table"):
        ConnectorSettings.from_extra({"mamba_config": 3})


def test_a_cold_state_is_stored_to_be_evicted_first(store):
    states, kv, _ = store
    warm, cold = TOKENS[: 2 * CHUNK], TOKENS[: 3 * CHUNK]
    states.save_all([StateSave("r", tokens_to_bytes(warm), None, (1, 1))])
    states.save_all([StateSave("r", tokens_to_bytes(cold), None, (2, 2), cold=True)])
    assert states.flush(30)
    policy = states.entry.cache._mover._slots[0].policy
    cold_key = states.entry.cache.chunk_keys([kv.cache.keys(cold)[-1]])[0]
    assert list(policy.cold_candidates()) == [cold_key] and len(policy) == 2
