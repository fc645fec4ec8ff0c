"""Prompts with images through the vLLM connector, at their edges.

Requests are stand-ins with the fields of vLLM's `Request` (`all_token_ids`, `mm_features`
of `MultiModalFeatureSpec`s: `modality`, `identifier`, `mm_position` with `offset`,
`length` and `is_embed`). The same checks on vLLM's own classes, and on the identifiers a
real engine gives its items, run in `vllm_prompt_real.py` (the `slow` tests at the end).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtiers import LookupResult, TieredCache
from kvtiers.core.events import ChunkRemoved, ChunkStored
from kvtiers.core.keys import ChunkHasher
from kvtiers.integrations._runtime import CacheRegistry
from kvtiers.integrations._vllm_events import BlocksRemoved, BlocksStored, WorkerEvents
from kvtiers.integrations._vllm_handoff import announce
from kvtiers.integrations._vllm_plan import (
    StepPlan,
    tokens_of,
    tokens_to_bytes,
)
from kvtiers.integrations._vllm_prompt import key_tokens, keyable
from tests.conftest import make_config, make_kv, small_layout
from tests.integrations.test_vllm_scheduler import side as scheduler_side

LAYOUT = small_layout()
BLOCK, CHUNK = 8, LAYOUT.chunk_size  # chunks of 16 tokens: two blocks each
PLACEHOLDER = {"image": 7, "audio": 8}
ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def item(
    identifier: Any,
    offset: Any,
    length: Any,
    modality: str = "image",
    is_embed: Any = None,
) -> SimpleNamespace:
    place = SimpleNamespace(offset=offset, length=length, is_embed=is_embed)
    return SimpleNamespace(identifier=identifier, mm_position=place, modality=modality)


def request(
    *items: SimpleNamespace,
    num_tokens: int = 96,
    req_id: str = "r1",
    tokens: list[int] | None = None,
    **fields: Any,
) -> SimpleNamespace:
    """A prompt of `num_tokens` text ids with each item's placeholders written in."""
    if tokens is None:
        tokens = list(range(100, 100 + num_tokens))
        for it in items:
            place = it.mm_position
            start, end = int(place.offset), int(place.offset) + int(place.length)
            tokens[start:end] = [PLACEHOLDER[it.modality]] * len(tokens[start:end])
    # vLLM's block hashes hold the block's token ids and the items in it
    hashes, parent = [], b""
    for b in range(len(tokens) // BLOCK):
        lo, hi = b * BLOCK, (b + 1) * BLOCK
        extra = [
            str(it.identifier)
            for it in items
            if it.mm_position.offset < hi and it.mm_position.offset + it.mm_position.length > lo
        ]
        block = parent + tokens_to_bytes(tokens[lo:hi]) + repr(extra).encode()
        parent = hashlib.sha256(block).digest()
        hashes.append(parent)
    base = {
        "request_id": req_id,
        "all_token_ids": tokens,
        "num_tokens": len(tokens),
        "num_prompt_tokens": len(tokens),
        "num_computed_tokens": 0,
        "cache_salt": None,
        "lora_request": None,
        "mm_features": list(items),
        "prompt_embeds": None,
        "kv_transfer_params": None,
        "block_hashes": hashes,
    }
    return SimpleNamespace(**{**base, **fields})


def chunk_keys(tokens: Any, salt: str | None = None) -> list[bytes]:
    return [bytes(k) for k in ChunkHasher(b"layout", CHUNK).keys(np.asarray(tokens), salt)]


def first_difference(a: list[bytes], b: list[bytes]) -> int:
    """The index of the first chunk whose keys differ (len when none does)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


class Lookup:
    """A lookup that answers `hit`, recording what it was asked."""

    def __init__(self, hit: int = 0) -> None:
        self.hit, self.asked = hit, []

    def __call__(self, tokens, salt):
        self.asked.append((tokens.tolist(), salt))
        future: concurrent.futures.Future[LookupResult] = concurrent.futures.Future()
        future.set_result(LookupResult(self.hit, ("dram",) * (self.hit // CHUNK)))
        return future


def side(lookup, **kwargs):
    return scheduler_side(lookup, block=BLOCK, chunk=CHUNK, **kwargs)


# -- how items are keyed ---------------------------------------------------------------


def test_items_vllm_names_by_a_per_request_counter_are_never_keyed():
    """With vLLM's processor cache and prefix cache both off, vLLM skips hashing and names
    each item `renderer<rank>-mm-<request n>-<modality>-<i>`: the n-th request of every
    engine process has the same names whatever its images, so they must not be keys."""
    assert not keyable(request(item("renderer0-mm-1-image-0", 16, 24)))
    assert not keyable(request(item("renderer3-mm-42-audio-1", 16, 24, "audio")))
    # with LoRA on the vision tower vLLM prefixes the adapter's name
    assert not keyable(request(item("adapter:renderer0-mm-7-image-0", 16, 24)))
    # the same request in a fresh engine, with another image: the same name
    lookup = Lookup()
    s = side(lookup)
    r = request(item("renderer0-mm-1-image-0", 16, 24))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert lookup.asked == []
    assert s.build_plan({"r1": 96}, lambda _: (list(range(12)),)).saves == []
    # content hashes and the caller's uuids are keys
    assert keyable(request(item("7935fe25c184727abb6aa19f91c304b6d1", 16, 24)))
    assert keyable(request(item("user-image-17", 16, 24)))


def test_one_identifier_for_an_image_and_an_audio_clip_is_keyed_apart():
    """vLLM keeps a caller's `multi_modal_uuids` as the identifier, whatever the modality:
    `"1"` may name an image in one request and an audio clip in another."""
    image, audio = request(item("1", 16, 24, "image")), request(item("1", 16, 24, "audio"))
    same_ids = list(image.all_token_ids)  # even were their placeholder ids the same
    audio_same = request(item("1", 16, 24, "audio"), tokens=same_ids)
    keys = chunk_keys(key_tokens(image, 96))
    for other in (audio, audio_same):
        other_keys = chunk_keys(key_tokens(other, 96))
        assert other_keys[0] == keys[0]  # the text before the item
        assert first_difference(keys, other_keys) == 1


def test_one_identifier_with_another_placeholder_count_is_keyed_apart():
    """The same image processed at another resolution (another engine's processor
    settings, or the same uuid) has other placeholders, and other KV from the first."""
    small, large = request(item("cat", 16, 24)), request(item("cat", 16, 40))
    assert (
        first_difference(chunk_keys(key_tokens(small, 96)), chunk_keys(key_tokens(large, 96))) == 1
    )


def test_placeholder_positions_holding_other_token_ids_are_keyed_apart():
    """An item's range may hold text tokens too (where `is_embed` is False): vLLM's prefix
    cache tells two prompts apart by those, so kvtiers must as well."""
    a = request(item("cat", 16, 24))
    tokens = list(a.all_token_ids)
    tokens[36] = 5  # a break token inside the image's range
    b = request(item("cat", 16, 24), tokens=tokens)
    assert first_difference(chunk_keys(key_tokens(a, 96)), chunk_keys(key_tokens(b, 96))) == 2


def test_the_same_image_at_the_same_place_is_keyed_alike_whatever_the_request():
    """Hits need the keys to depend on the prompt, its images and their places only: not
    on the request id, an `is_embed` mask, or the order of the items in the list."""
    cat, dog = item("cat", 8, 16), item("dog", 40, 16)
    keys = chunk_keys(key_tokens(request(cat, dog), 96))
    mask = [True] * 12 + [False] * 4
    masked = item("cat", 8, 16, is_embed=mask)
    assert chunk_keys(key_tokens(request(dog, cat, req_id="other"), 96)) == keys
    assert chunk_keys(key_tokens(request(masked, dog), 96)) == keys


def test_several_items_are_each_keyed_by_their_own_identifier():
    cat, dog = item("cat", 8, 16), item("dog", 40, 16)
    both = key_tokens(request(cat, dog), 96)
    swapped = key_tokens(request(item("dog", 8, 16), item("cat", 40, 16)), 96)
    assert (both[8:24] >= 2**62).all() and (both[40:56] >= 2**62).all()
    assert both[24:40].tolist() == list(range(124, 140))  # the text between them
    assert set(both[8:24].tolist()).isdisjoint(both[40:56].tolist())
    # the same two images the other way round: other keys from the first image on
    assert first_difference(chunk_keys(both), chunk_keys(swapped)) == 0
    # the second image alone differs: the keys differ from its chunk on, not before
    cat_cow = key_tokens(request(cat, item("cow", 40, 16)), 96)
    assert first_difference(chunk_keys(both), chunk_keys(cat_cow)) == 2


def test_the_same_image_twice_in_one_prompt_is_keyed_by_its_place_too():
    twice = request(item("cat", 8, 16), item("cat", 40, 16))
    ids = key_tokens(twice, 96)
    assert ids[8:24].tolist() == ids[40:56].tolist()  # the item's ids: by position in it
    once = request(item("cat", 8, 16), item("dog", 40, 16))
    assert first_difference(chunk_keys(ids), chunk_keys(key_tokens(once, 96))) == 2
    assert keyable(twice)


def test_ranges_past_the_prompt_or_the_limit_and_empty_ones_are_cut_or_skipped():
    r = request(
        item("cat", 0, 0),  # empty
        item("dog", 80, 40),  # runs past the prompt
        item("cow", 200, 8),  # starts past it
        num_tokens=96,
    )
    ids = key_tokens(r, 96)
    assert len(ids) == 96
    assert ids[:80].tolist() == r.all_token_ids[:80]
    assert (ids[80:] >= 2**62).all()
    assert key_tokens(r, 64).tolist() == r.all_token_ids[:64]  # the limit stops before it
    assert key_tokens(r, 0).tolist() == []
    assert np.array_equal(key_tokens(r, 88), ids[:88])  # a limit inside an item: its head


def test_overlapping_items_key_every_position_they_cover_and_nothing_else():
    r = request(item("cat", 8, 24), item("dog", 16, 24))
    ids = key_tokens(r, 96)
    assert (ids[8:40] >= 2**62).all()
    assert ids[:8].tolist() == r.all_token_ids[:8]
    assert ids[40:].tolist() == r.all_token_ids[40:96]
    assert np.array_equal(ids, key_tokens(request(item("cat", 8, 24), item("dog", 16, 24)), 96))


@pytest.mark.parametrize(
    "place",
    [
        (np.int64(16), 24),  # vLLM builds its ranges from plain ints (checked for real)
        (16.0, 24),
        (None, 24),
        (16, None),
        ("16", 24),
        (16, -1),
    ],
    ids=["numpy-int", "float", "no-offset", "no-length", "str", "negative-length"],
)
def test_items_with_a_malformed_place_are_refused(place):
    offset, length = place
    r = request(item("cat", 16, 24))
    r.mm_features = [item("cat", offset, length)]
    assert not keyable(r)


@pytest.mark.parametrize("identifier", [None, "", 0, b""])
def test_items_without_an_identifier_are_refused(identifier):
    assert not keyable(request(item(identifier, 16, 24)))


def test_derived_ids_are_above_any_vocabulary_and_fit_int64():
    r = request(*(item(f"img{i}", 8 + 48 * i, 40) for i in range(40)), num_tokens=2000)
    ids = key_tokens(r, 2000)
    placeholders = np.concatenate([ids[8 + 48 * i : 48 + 48 * i] for i in range(40)])
    assert placeholders.min() >= 2**62 and placeholders.max() < 2**63
    assert len(set(placeholders.tolist())) == len(placeholders)  # no two alike
    assert tokens_of(tokens_to_bytes(ids)).tolist() == ids.tolist()  # the plan's packing


_DETERMINISM = """
import json, sys
from types import SimpleNamespace
from kvtiers.integrations._vllm_prompt import key_tokens
def item(i, o, n, m):
    return SimpleNamespace(identifier=i, modality=m,
        mm_position=SimpleNamespace(offset=o, length=n, is_embed=None))
tokens = list(range(100, 1100))
r = SimpleNamespace(all_token_ids=tokens,
    mm_features=[item("cat", 10, 300, "image"), item("éclair ✓", 400, 50, "audio")])
print(json.dumps(key_tokens(r, 1000).tolist()))
"""


def test_keys_are_the_same_in_every_process():
    runs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _DETERMINISM],
            capture_output=True,
            text=True,
            check=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )
        runs.append(json.loads(out.stdout))
    assert runs[0] == runs[1]
    assert any(t >= 2**62 for t in runs[0])


# -- the scheduler side ----------------------------------------------------------------


def test_lora_cache_salt_and_images_together_key_apart_and_alike():
    lora = SimpleNamespace(lora_name="sql", adapter_id=3, name="sql")
    lookup = Lookup()
    s = side(lookup)
    a = request(item("cat", 16, 24), req_id="a", cache_salt="tenant", lora_request=lora)
    b = request(item("cat", 16, 24), req_id="b", cache_salt="other", lora_request=lora)
    c = request(item("dog", 16, 24), req_id="c", cache_salt="tenant", lora_request=lora)
    for r in (a, b, c):
        s.get_num_new_matched_tokens(r, 0)
    (ta, sa), (tb, sb), (tc, sc) = lookup.asked
    assert ta == tb and sa != sb  # one image, two tenants: the salt keeps them apart
    assert sa == sc and ta[:16] == tc[:16] and ta[16:40] != tc[16:40]
    assert sa == "salt=tenant\x1flora=sql"
    assert chunk_keys(ta, sa)[1:] != chunk_keys(tb, sb)[1:]


def test_generated_tokens_after_a_prompt_with_images_are_saved_keyed_and_named():
    lookup = Lookup()
    s = side(lookup, kv_events=True, store_generated=True)
    r = request(item("cat", 16, 24), num_tokens=40)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, (), 0)
    prompt_plan = s.build_plan({"r1": 40}, lambda _: (list(range(5)),))
    (prompt_save,) = prompt_plan.saves
    assert len(tokens_of(prompt_save.tokens)) == 32
    # decode 30 tokens: 70 in all, four whole chunks
    r.all_token_ids = r.all_token_ids + list(range(5000, 5030))
    r.num_tokens = r.num_computed_tokens = 70
    r.block_hashes = request(item("cat", 16, 24), tokens=r.all_token_ids).block_hashes
    assert s.request_finished(r, (list(range(9)),)) == (True, None)
    (save,) = s.build_plan({}, lambda _: None).saves
    keyed = tokens_of(save.tokens).tolist()
    assert len(keyed) == 64 and save.finished
    assert keyed[:32] == tokens_of(prompt_save.tokens).tolist()  # the prompt: as saved
    assert keyed[40:] == list(range(5000, 5024))  # generated ids: as they are
    assert save.origin is not None and save.origin.token_ids is not None
    assert tokens_of(save.origin.token_ids).tolist() == r.all_token_ids[:64]
    assert len(save.origin.block_hashes) == 8


# -- KV events: the prompt's own ids for every chunk, saved or loaded -------------------


@pytest.fixture
def registry():
    return CacheRegistry()


def test_events_of_saved_and_loaded_chunks_carry_the_prompt_own_token_ids(registry):
    config = {**make_config(dram_chunks=64), "events": 1000}
    entry = registry.acquire("k", lambda: TieredCache.from_config(config))
    worker = WorkerEvents(entry, max_chunks=64, block_size=BLOCK, chunk_size=CHUNK)
    cache = entry.cache

    def lookup(tokens, salt):
        return entry.loop.submit(cache.locate(tokens, salt=salt))

    s = side(lookup, kv_events=True, lookup_wait_ms=10_000)
    # a first request with an image is computed and saved
    first = request(item("cat", 4, 24), req_id="first", cache_salt="t")
    assert s.get_num_new_matched_tokens(first, 0) == (0, False)
    s.update_state_after_alloc(first, (), 0)
    plan = s.build_plan({"first": 96}, lambda _: (list(range(12)),))
    (save,) = plan.saves
    worker.record(plan)
    entry.loop.run(cache.store(tokens_of(save.tokens), make_kv(LAYOUT, 96), salt=save.salt), 30)
    # a second one, the same image and a longer text, loads the first one's chunks
    second = request(item("cat", 4, 24), req_id="second", cache_salt="t", num_tokens=96 + CHUNK)
    second.all_token_ids[:96] = first.all_token_ids
    second.block_hashes[:12] = first.block_hashes
    assert s.get_num_new_matched_tokens(second, 0) == (96, False)
    s.update_state_after_alloc(second, (list(range(14)),), 96)
    second.num_computed_tokens = 96
    plan = s.build_plan({"second": CHUNK}, lambda _: (list(range(14)),))
    (load,) = plan.loads
    load_ids = tokens_of(load.tokens)
    assert load_ids.tolist() == tokens_of(save.tokens).tolist()
    worker.record(plan)
    worker.take()
    stored = [e for e in worker.take(wait=30) if isinstance(e, BlocksStored)]
    assert [e.token_ids for e in stored] == [
        tuple(first.all_token_ids[i * CHUNK : (i + 1) * CHUNK]) for i in range(6)
    ]
    assert all(t < 2**62 for e in stored for t in e.token_ids)
    # a worker that saw only the load (another rank, or after a restart) names its chunks
    # with the prompt's own ids too
    other = WorkerEvents(entry, max_chunks=64, block_size=BLOCK, chunk_size=CHUNK)
    other.record(StepPlan(loads=plan.loads))
    loaded = other.name(
        [ChunkStored("dram", k, CHUNK) for k in cache.keys(load_ids, salt=load.salt)]
    )
    assert [e.token_ids for e in loaded] == [e.token_ids for e in stored]
    # the second request's chunks were remembered from its load and its save
    keys = cache.keys(tokens_of(plan.saves[0].tokens), salt=plan.saves[0].salt)
    assert len(keys) == 7
    named = worker.name([ChunkRemoved("dram", k, CHUNK) for k in keys])
    assert named == [
        BlocksRemoved(tuple(second.block_hashes[2 * i : 2 * i + 2]), stored[0].where)
        for i in range(7)
    ]
    registry.release(entry)


# -- the prefill/decode hand-off -------------------------------------------------------


def test_a_consumer_loads_a_producer_prompt_with_its_image_and_not_another_image(registry):
    entry = registry.acquire("k", lambda: TieredCache.from_config(make_config(dram_chunks=64)))
    cache = entry.cache

    def lookup(tokens, salt):
        return entry.loop.submit(cache.locate(tokens, salt=salt))

    producer = side(lookup, kv_role="kv_producer", lookup_wait_ms=10_000)
    cat = request(item("cat", 4, 24), req_id="p")
    assert producer.get_num_new_matched_tokens(cat, 0) == (0, False)
    producer.update_state_after_alloc(cat, (), 0)
    (save,) = producer.build_plan({"p": 96}, lambda _: (list(range(12)),)).saves
    entry.loop.run(cache.store(tokens_of(save.tokens), make_kv(LAYOUT, 96)), 30)
    cat.num_computed_tokens = 96
    delay, params = producer.request_finished(cat, (list(range(12)),))
    assert (delay, params) == (False, announce(96))

    consumer = side(lookup, kv_role="kv_consumer", lookup_wait_ms=10_000, handoff_wait_s=0)
    same = request(item("cat", 4, 24), req_id="c1", kv_transfer_params=params)
    assert consumer.get_num_new_matched_tokens(same, 0) == (95, False)
    # another image in the same place: the same token ids, none of the producer's KV
    dog = request(item("dog", 4, 24), req_id="c2", kv_transfer_params=params)
    assert dog.all_token_ids == same.all_token_ids
    assert consumer.get_num_new_matched_tokens(dog, 0) == (0, False)
    assert consumer.build_plan({"c1": 1, "c2": 96}, lambda _: (list(range(12)),)).saves == []
    registry.release(entry)


def test_a_producer_announces_nothing_for_items_it_cannot_key():
    producer = side(Lookup(), kv_role="kv_producer")
    r = request(item("renderer0-mm-1-image-0", 4, 24), req_id="p")
    producer.get_num_new_matched_tokens(r, 0)
    r.num_computed_tokens = 96
    assert producer.build_plan({"p": 96}, lambda _: (list(range(12)),)).saves == []
    assert producer.request_finished(r, (list(range(12)),)) == (False, None)


# -- vLLM's own classes (vllm_prompt_real.py, run with vLLM's python) ------------------


def run_real(vllm_python: Path, *args: str) -> dict[str, Any]:
    from tests.integrations.conftest import scenario_env

    out = subprocess.run(
        [str(vllm_python), str(HERE / "vllm_prompt_real.py"), *args],
        capture_output=True,
        text=True,
        env=scenario_env(),
        cwd=HERE,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_vllm_requests_with_items_are_keyed_looked_up_saved_and_named(vllm_python):
    """vLLM's `Request`, `MultiModalFeatureSpec` and `PlaceholderRange` (with an
    `is_embed` mask, LoRA and a cache salt) through `keyable`, `key_tokens` and the
    scheduler side, with vLLM's own block hashes."""
    result = run_real(vllm_python, "requests")
    assert result == {
        "keyable": True,
        "numpy_offset_keyable": False,
        "placeholders_derived": True,
        "text_as_is": True,
        "mask_keyed_alike": True,
        "matched": [64, False],
        "load_tokens": 64,
        "save_tokens": 96,
        "save_keyed": True,
        "origin_own_ids": True,
        "origin_hashes": 6,
        "salt": "salt=tenant\x1flora=sql",
    }


@pytest.mark.slow
def test_vllm_names_items_per_request_with_both_its_caches_off(vllm_python, tiny_blip2):
    """A tiny BLIP-2 engine with `mm_processor_cache_gb=0` and prefix caching off names
    the same image twice by two per-request names, which kvtiers refuses to key; with its
    processor cache on (the default) the name is the image's hash, and kvtiers keys it."""
    off = run_real(vllm_python, "identifiers", str(tiny_blip2), "--cache-gb", "0")
    assert off["identifiers"][0] != off["identifiers"][1]  # one image, two names
    assert all(i.startswith("renderer0-mm-") for i in off["identifiers"])
    assert off["keyable"] == [False, False]
    assert off["items_hashed"] is False  # so the connector keys no item in this engine
    assert off["offsets_are_int"]
    on = run_real(vllm_python, "identifiers", str(tiny_blip2), "--cache-gb", "4")
    assert on["identifiers"][0] == on["identifiers"][1]
    assert on["keyable"] == [True, True]
    assert on["items_hashed"] is True
