"""The token ids kvtiers keys a vLLM request's KV by.

A text prompt's KV depends on its token ids alone, so they are the key. A multimodal
prompt's placeholder tokens (one id repeated, the same for every image) get their KV from
the item they stand for (an image, an audio clip): those positions are keyed by ids
derived from vLLM's hash of the item (`MultiModalFeatureSpec.identifier`, a hash of its
content, or the caller's `multi_modal_uuids`), its modality, its number of placeholders
and the placeholders' own ids (as vLLM's prefix cache, which hashes the token ids and the
identifier). Two images in one place never share a chunk, and the same image in the same
place always does, across engines and restarts. Every chunk from the item's first
placeholder on differs (the keys are chained).

With both its processor cache and its prefix cache off, vLLM skips hashing and names an
item after its request's number (`renderer<rank>-mm-<n>-<modality>-<i>`, hashed again with
the request's `mm_processor_kwargs` if it has any): the n-th request of every engine
process has the same names, whatever its images. In that configuration no item is keyed
(`items_hashed`), and names of that form are refused in any case.

A prompt given as embeddings (`prompt_embeds`, no token ids: vLLM holds zeros in their
place) is keyed the same way, by ids derived from the embeddings themselves: each group of
`EMBED_ROWS` rows is hashed (with the tensor's dtype and width), and its positions get ids
from that hash. Another embedding anywhere in a group changes every key from that group on.
A prompt mixing token ids and embeddings (`prompt_is_token_ids`: `True` where the model
reads the token's id, `False` where it reads the row of `prompt_embeds`) keeps its token
ids where the mask is `True`, and its other positions get ids derived as above from the
group's embedding rows (those under a `True` taken as zeros: the model never reads them)
and the group's mask.

The derived ids lie in `[2**62, 2**63)`, above any vocabulary, so they never equal a
real token's id. Only the keys use them: the KV events keep the prompt's own token ids.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = ["EMBED_ROWS", "has_items", "items_hashed", "key_tokens", "keyable", "rekeyed"]

EMBED_ROWS = 16
"""Rows of a prompt's embeddings hashed together (one hash call per group)."""

_BASE = np.uint64(1 << 62)
_MASK = np.uint64((1 << 62) - 1)
_STEP = np.uint64(0x9E3779B97F4A7C15)  # odd: consecutive positions get distinct ids
_MIX = np.uint64(0xBF58476D1CE4E5B9)  # odd: distinct token ids stay distinct
# vLLM's name for an item it did not hash (`BaseRenderer._process_mm_uuids`), after a LoRA
# adapter's name when the adapter covers the vision tower.
_PER_REQUEST = re.compile(r"(?:^|:)renderer\d+-mm-\d+-")


def items_hashed(vllm_config: Any) -> bool:
    """Return whether the engine of `vllm_config` names multimodal items by their content.

    vLLM skips hashing an item (and names it per request) when its multimodal processor
    cache (`mm_processor_cache_gb = 0`) and its prefix cache are both off.
    """
    multimodal = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    if multimodal is None:
        return True
    cache = getattr(vllm_config, "cache_config", None)
    no_processor_cache = getattr(multimodal, "mm_processor_cache_gb", None) == 0
    return not (no_processor_cache and not getattr(cache, "enable_prefix_caching", False))


def has_items(request: Any) -> bool:
    """Return whether `request` carries multimodal items."""
    return bool(getattr(request, "mm_features", None))


def rekeyed(request: Any) -> bool:
    """Return whether `request` is keyed by other ids than its own (items, embeddings)."""
    return has_items(request) or getattr(request, "prompt_embeds", None) is not None


def keyable(request: Any) -> bool:
    """Return whether kvtiers can key `request`'s KV.

    Prompt embeddings must be the whole prompt, one row per token; a multimodal item must
    name itself (an identifier vLLM hashed from it, or the caller's uuid, not a per-request
    name) and its place in the prompt.
    """
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        shape = tuple(getattr(embeds, "shape", ()))
        if len(shape) != 2 or shape[0] != getattr(request, "num_prompt_tokens", None):
            return False
        mask = getattr(request, "prompt_is_token_ids", None)
        if mask is not None and (
            not isinstance(mask, list | tuple)
            or len(mask) != shape[0]
            or not all(isinstance(m, bool) for m in mask)
        ):
            return False
    for item in getattr(request, "mm_features", None) or ():
        place = getattr(item, "mm_position", None)
        identifier = getattr(item, "identifier", None)
        if not identifier or place is None:
            return False
        if isinstance(identifier, str) and _PER_REQUEST.search(identifier):
            return False
        if not isinstance(place.offset, int) or not isinstance(place.length, int):
            return False
        if place.offset < 0 or place.length < 0:
            return False
    return True


def key_tokens(request: Any, limit: int) -> npt.NDArray[np.int64]:
    """Return the ids that key `request`'s first `limit` tokens (see the module doc)."""
    tokens = np.array(request.all_token_ids[:limit], dtype=np.int64)
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        rows = min(len(tokens), int(embeds.shape[0]))
        mask = getattr(request, "prompt_is_token_ids", None)
        if mask is None:
            tokens[:rows] = _embedding_ids(embeds, rows)
        else:
            is_token = np.array(mask, dtype=bool)
            derived = _embedding_ids(embeds, rows, is_token)
            tokens[:rows] = np.where(is_token[:rows], tokens[:rows], derived)
    for item in getattr(request, "mm_features", None) or ():
        start = item.mm_position.offset
        end = min(start + item.mm_position.length, len(tokens))
        if start >= end:
            continue
        # NOTE: vLLM keeps a caller's uuid as the identifier whatever the modality, and
        # engines with other processor settings give one image other placeholders.
        name = f"{getattr(item, 'modality', '')}\x1f{item.mm_position.length}\x1f{item.identifier}"
        seed = np.uint64(xxhash.xxh3_64_intdigest(name.encode()))
        steps = np.arange(end - start, dtype=np.uint64) * _STEP
        own = tokens[start:end].astype(np.uint64)
        with np.errstate(over="ignore"):  # arithmetic modulo 2**64, by design
            ids = (((steps + seed) ^ (own * _MIX)) & _MASK) | _BASE
        tokens[start:end] = ids.astype(np.int64)
    return tokens


def _embedding_ids(
    embeds: Any, rows: int, is_token: npt.NDArray[np.bool_] | None = None
) -> npt.NDArray[np.int64]:
    """Return the ids of the first `rows` rows of `embeds` (a 2-D tensor, see the module doc).

    `is_token` (a mixed prompt's mask, one entry per row) marks the rows the model does not
    read: they are hashed as zeros, each group's hash covers its part of the mask, and a
    group of token rows only is not hashed (its own ids key it).
    """
    import torch

    data = embeds.detach().to("cpu").contiguous()
    seed = xxhash.xxh3_64_intdigest(f"embeds\x1f{data.dtype}\x1f{data.shape[1]}".encode())
    raw = data.view(torch.uint8).numpy()  # one row of bytes per token
    groups = -(-rows // EMBED_ROWS)  # whole groups: a row's id never depends on `rows`

    def digest(g: int) -> int:
        rows_of_g = raw[g * EMBED_ROWS : (g + 1) * EMBED_ROWS]
        if is_token is None:
            return xxhash.xxh3_64_intdigest(rows_of_g, seed=seed)
        mask = is_token[g * EMBED_ROWS : (g + 1) * EMBED_ROWS]
        if mask.all():
            return 0  # unused: every row of the group is keyed by its token id
        if mask.any():
            rows_of_g = rows_of_g.copy()
            rows_of_g[mask] = 0
        hasher = xxhash.xxh3_64(rows_of_g, seed=seed)
        hasher.update(np.packbits(mask).tobytes())
        return hasher.intdigest()

    digests = np.fromiter((digest(g) for g in range(groups)), dtype=np.uint64, count=groups)
    steps = np.arange(EMBED_ROWS, dtype=np.uint64) * _STEP
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64, by design
        ids = ((digests[:, None] + steps[None, :]) & _MASK) | _BASE
    return ids.reshape(-1)[:rows].astype(np.int64)
