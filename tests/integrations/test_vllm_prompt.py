"""The ids kvtiers keys a vLLM request by: text as it is, multimodal items by their hash.

Requests are stand-ins with the fields vLLM's `Request` has (`all_token_ids`,
`mm_features` of `MultiModalFeatureSpec`s with an `identifier` and a `mm_position`);
the real engine runs a multimodal model in `test_vllm_engine.py`.
"""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import numpy as np
import torch

from kvtiers import LookupResult
from kvtiers.core.keys import ChunkHasher
from kvtiers.integrations._vllm_events import ChunkOrigins, block_origin
from kvtiers.integrations._vllm_plan import ConnectorSettings, tokens_of, tokens_to_bytes
from kvtiers.integrations._vllm_prompt import has_items, items_hashed, key_tokens, keyable
from kvtiers.integrations._vllm_scheduler import SchedulerSide
from tests.integrations.test_vllm_scheduler import request as text_request

BLOCK, CHUNK = 16, 64
IMAGE_TOKEN = 7


def item(identifier: str | None, offset: int, length: int) -> SimpleNamespace:
    place = SimpleNamespace(offset=offset, length=length)
    return SimpleNamespace(identifier=identifier, mm_position=place, modality="image")


def request(*items: SimpleNamespace, num_tokens: int = 300, req_id: str = "r1") -> SimpleNamespace:
    hashes = [bytes([i]) * 32 for i in range(num_tokens // BLOCK)]
    r = text_request(req_id, num_tokens, mm_features=list(items), block_hashes=hashes)
    for it in items:  # the placeholders: one id repeated, whatever the image
        start, end = it.mm_position.offset, it.mm_position.offset + it.mm_position.length
        r.all_token_ids[start:end] = [IMAGE_TOKEN] * (end - start)
    return r


def chunk_keys(tokens: np.ndarray) -> list[bytes]:
    return [bytes(k) for k in ChunkHasher(b"layout", CHUNK).keys(tokens)]


def test_a_text_prompt_is_keyed_by_its_own_tokens():
    r = request()
    assert key_tokens(r, 256).tolist() == r.all_token_ids[:256]
    assert not has_items(r) and keyable(r)


def test_placeholders_are_keyed_by_the_item_so_two_images_never_share_a_chunk():
    cat, dog = request(item("cat", 70, 40)), request(item("dog", 70, 40))
    assert cat.all_token_ids == dog.all_token_ids  # the token ids alone cannot tell them apart
    cat_ids, dog_ids = key_tokens(cat, 256), key_tokens(dog, 256)
    assert cat_ids[:70].tolist() == cat.all_token_ids[:70]  # text before it: as it is
    assert cat_ids[110:].tolist() == cat.all_token_ids[110:256]  # and after it
    placeholders = cat_ids[70:110]
    assert (placeholders >= 2**62).all() and len(set(placeholders.tolist())) == 40
    assert not np.array_equal(placeholders, dog_ids[70:110])
    cat_keys, dog_keys = chunk_keys(cat_ids), chunk_keys(dog_ids)
    assert cat_keys[0] == dog_keys[0]  # the chunk before the image is shared
    assert all(c != d for c, d in zip(cat_keys[1:], dog_keys[1:], strict=True))
    # the same image in the same place: the same keys, in any process
    assert chunk_keys(key_tokens(request(item("cat", 70, 40)), 256)) == cat_keys
    # the same image elsewhere: other keys from where the prompts differ
    assert chunk_keys(key_tokens(request(item("cat", 72, 40)), 256))[1:] != cat_keys[1:]


def test_an_item_cut_by_the_limit_is_keyed_up_to_it_and_items_past_it_are_ignored():
    r = request(item("cat", 230, 40), item("dog", 280, 10))
    ids = key_tokens(r, 256)
    assert len(ids) == 256
    assert np.array_equal(ids[230:], key_tokens(r, 300)[230:256])
    assert (ids[230:] >= 2**62).all() and ids[:230].tolist() == r.all_token_ids[:230]


def test_requests_that_cannot_be_keyed_are_refused():
    assert keyable(request(item("cat", 0, 16)))
    assert not keyable(request(item(None, 0, 16)))  # an item that does not name itself
    assert not keyable(request(item("", 0, 16)))
    assert not keyable(request(item("cat", -1, 16)))
    assert not keyable(SimpleNamespace(mm_features=["image"], prompt_embeds=None))
    assert not keyable(SimpleNamespace(mm_features=[], prompt_embeds=object()))


class Lookup:
    def __init__(self, hit: int) -> None:
        self.hit, self.asked = hit, []

    def __call__(self, tokens, salt):
        self.asked.append(tokens.tolist())
        future: concurrent.futures.Future[LookupResult] = concurrent.futures.Future()
        future.set_result(LookupResult(self.hit, ("dram",) * (self.hit // CHUNK)))
        return future


def test_the_scheduler_looks_up_loads_and_saves_a_multimodal_prompt_by_its_keyed_ids():
    lookup = Lookup(hit=128)
    settings = ConnectorSettings(lookup_wait_ms=0)
    s = SchedulerSide(settings, BLOCK, CHUNK, lambda: lookup, kv_events=True)
    r = request(item("cat", 70, 40), num_tokens=300)
    keyed = key_tokens(r, 256).tolist()
    assert s.get_num_new_matched_tokens(r, 0) == (128, False)
    assert lookup.asked == [keyed]
    s.update_state_after_alloc(r, (list(range(19)),), 128)
    r.num_computed_tokens = 128
    plan = s.build_plan({"r1": 172}, lambda _: (list(range(19)),))
    (load,) = plan.loads
    (save,) = plan.saves
    assert tokens_of(load.tokens).tolist() == keyed[:128]
    assert tokens_of(save.tokens).tolist() == keyed
    # vLLM's events name the chunks with the prompt's own token ids
    assert save.origin is not None
    assert save.origin.token_ids == tokens_to_bytes(r.all_token_ids[:256])


def test_events_carry_the_prompt_own_token_ids_not_the_keyed_ones():
    r = request(item("cat", 0, 40), num_tokens=128)
    origin = block_origin(r, 128, BLOCK)
    origins = ChunkOrigins(max_chunks=4, block_size=BLOCK, chunk_size=CHUNK)
    origins.record([b"k0", b"k1"], tokens_to_bytes(key_tokens(r, 128)), origin)
    first = origins.get(b"k0")
    assert first is not None
    assert tokens_of(first.token_ids).tolist() == r.all_token_ids[:CHUNK]
    assert block_origin(request(), 128, BLOCK).token_ids is None  # text: the spec's tokens


def config(*, processor_cache_gb: float | None, prefix_caching: bool) -> SimpleNamespace:
    multimodal = (
        None
        if processor_cache_gb is None
        else SimpleNamespace(mm_processor_cache_gb=processor_cache_gb)
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(multimodal_config=multimodal),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )


def test_an_engine_that_names_items_per_request_keys_no_item():
    """vLLM skips hashing items with its processor cache and its prefix cache both off
    (then even a hashed-looking name can be per request): no request with items is keyed
    there, and text requests still are."""
    assert not items_hashed(config(processor_cache_gb=0, prefix_caching=False))
    assert items_hashed(config(processor_cache_gb=0, prefix_caching=True))
    assert items_hashed(config(processor_cache_gb=4, prefix_caching=False))
    assert items_hashed(config(processor_cache_gb=None, prefix_caching=False))  # text model
    lookup = Lookup(hit=128)
    settings = ConnectorSettings(lookup_wait_ms=0)
    s = SchedulerSide(settings, BLOCK, CHUNK, lambda: lookup, multimodal=False)
    hashed_looking = item("9f" * 32, 70, 40)
    assert s.get_num_new_matched_tokens(request(hashed_looking), 0) == (0, False)
    assert lookup.asked == []
    assert s.get_num_new_matched_tokens(request(req_id="text"), 0) == (128, False)


def embeds_request(embeds: torch.Tensor, req_id: str = "e1") -> SimpleNamespace:
    """A request given as embeddings: vLLM holds zeros in place of its token ids."""
    n = embeds.shape[0]
    return text_request(req_id, n, all_token_ids=[0] * n, prompt_embeds=embeds)


def test_a_prompt_of_embeddings_is_keyed_by_the_embeddings():
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(200, 32, generator=gen).to(torch.bfloat16)
    ids = key_tokens(embeds_request(embeds), 192)
    assert (ids >= 2**62).all() and len(set(ids.tolist())) == 192
    assert np.array_equal(ids, key_tokens(embeds_request(embeds.clone()), 192))  # same: same
    assert np.array_equal(ids[:100], key_tokens(embeds_request(embeds), 100))  # any limit
    changed = embeds.clone()
    changed[70, 3] += 1  # one value of row 70 (the group of rows 64-79)
    other = key_tokens(embeds_request(changed), 192)
    assert np.array_equal(other[:64], ids[:64]) and not np.array_equal(other[64:80], ids[64:80])
    assert np.array_equal(other[80:], ids[80:])  # ids are per group; the keys chain
    keys, other_keys = chunk_keys(ids), chunk_keys(other)
    assert keys[0] == other_keys[0] and keys[1] != other_keys[1] and keys[2] != other_keys[2]
    # the same values in another dtype are other inputs
    assert not np.array_equal(key_tokens(embeds_request(embeds.float()), 192), ids)


def mixed_request(
    ids: list[int], embeds: torch.Tensor, mask: list[bool], req_id: str = "m1"
) -> SimpleNamespace:
    """A prompt mixing token ids and embeddings: vLLM holds zeros where the mask is False."""
    own = [t if is_token else 0 for t, is_token in zip(ids, mask, strict=True)]
    request = text_request(req_id, len(ids), all_token_ids=own, prompt_embeds=embeds)
    request.prompt_is_token_ids = mask
    return request


def test_a_prompt_mixing_ids_and_embeddings_is_keyed_by_both():
    gen = torch.Generator().manual_seed(2)
    ids = list(range(10, 202))
    embeds = torch.randn(192, 16, generator=gen)
    mask = [True] * 70 + [False] * 50 + [True] * 72  # embeddings at rows 70-119
    keyed = key_tokens(mixed_request(ids, embeds, mask), 192)
    # token ids where the model reads them, derived ids elsewhere
    assert keyed[:70].tolist() == ids[:70] and keyed[120:].tolist() == ids[120:]
    assert (keyed[70:120] >= 2**62).all()
    # a text prompt of the same ids shares the chunk before the embeddings, nothing after
    text_keys = chunk_keys(np.array(ids, dtype=np.int64))
    mixed_keys = chunk_keys(keyed)
    assert mixed_keys[0] == text_keys[0] and mixed_keys[1] != text_keys[1]
    # the rows the model does not read are not part of the key
    noisy = embeds.clone()
    noisy[:70] = torch.randn(70, 16, generator=gen)
    noisy[120:] = 7.0
    assert np.array_equal(key_tokens(mixed_request(ids, noisy, mask), 192), keyed)
    # the rows it reads are
    changed = embeds.clone()
    changed[115, 0] += 1  # the group of rows 112-127
    other = key_tokens(mixed_request(ids, changed, mask), 192)
    assert np.array_equal(other[:112], keyed[:112])
    assert not np.array_equal(other[112:120], keyed[112:120])
    # another mask over the same values is another prompt, even where the ids agree
    moved = [True] * 71 + [False] * 49 + [True] * 72
    other = key_tokens(mixed_request(ids, embeds, moved), 192)
    assert other[70] == ids[70] and not np.array_equal(other[71:80], keyed[71:80])
    # all ids (a mask of True only): the text prompt's keys
    all_ids = key_tokens(mixed_request(ids, embeds, [True] * 192), 192)
    assert all_ids.tolist() == ids


def test_prompts_with_misshapen_embeddings_or_masks_are_not_keyed():
    embeds = torch.zeros(64, 8)
    assert keyable(embeds_request(embeds))
    mixed = embeds_request(embeds)
    mixed.prompt_is_token_ids = [True] * 32 + [False] * 32
    assert keyable(mixed)
    for mask in ([True] * 63, [True] * 65, [1] * 64, "T" * 64, None):
        bad = embeds_request(embeds)
        bad.prompt_is_token_ids = mask
        assert keyable(bad) == (mask is None)
    assert not keyable(text_request("x", 64, prompt_embeds=torch.zeros(63, 8)))
    assert not keyable(text_request("x", 64, prompt_embeds=torch.zeros(64)))


def test_the_scheduler_keys_an_embeddings_prompt_once_and_events_keep_its_own_ids():
    lookup = Lookup(hit=128)
    settings = ConnectorSettings(lookup_wait_ms=0)
    s = SchedulerSide(settings, BLOCK, CHUNK, lambda: lookup, kv_events=True)
    embeds = torch.randn(300, 16, generator=torch.Generator().manual_seed(1))
    r = embeds_request(embeds, "e1")
    r.block_hashes = [bytes([i]) * 32 for i in range(300 // BLOCK)]
    keyed = key_tokens(r, 256).tolist()
    assert s.get_num_new_matched_tokens(r, 0) == (128, False)
    assert lookup.asked == [keyed]
    s.update_state_after_alloc(r, (list(range(19)),), 128)
    r.num_computed_tokens = 128
    plan = s.build_plan({"e1": 172}, lambda _: (list(range(19)),))
    assert tokens_of(plan.loads[0].tokens).tolist() == keyed[:128]
    (save,) = plan.saves
    assert tokens_of(save.tokens).tolist() == keyed
    assert save.origin is not None and save.origin.token_ids == tokens_to_bytes([0] * 256)
