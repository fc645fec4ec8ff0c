"""The token ids kvtiers keys a vLLM request's KV by.

A text prompt's KV depends on its token ids alone, so they are the key. A multimodal
prompt's placeholder tokens (one id repeated, the same for every image) get their KV from
the item they stand for (an image, an audio clip): those positions are keyed by ids
derived from vLLM's hash of the item (`MultiModalFeatureSpec.identifier`, a hash of its
content, or the caller's `multi_modal_uuids`). Two images in one place never share a
chunk, and the same image in the same place always does, across engines and restarts.
Every chunk from the item's first placeholder on differs (the keys are chained).

The derived ids lie in `[2**62, 2**63)`, above any vocabulary, so they never equal a
real token's id. Only the keys use them: the KV events keep the prompt's own token ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = ["has_items", "key_tokens", "keyable"]

_BASE = np.uint64(1 << 62)
_MASK = np.uint64((1 << 62) - 1)
_STEP = np.uint64(0x9E3779B97F4A7C15)  # odd: consecutive positions get distinct ids


def has_items(request: Any) -> bool:
    """Return whether `request` carries multimodal items."""
    return bool(getattr(request, "mm_features", None))


def keyable(request: Any) -> bool:
    """Return whether kvtiers can key `request`'s KV.

    Prompt embeddings have no token ids to key by; a multimodal item must name itself
    (an identifier) and its place in the prompt.
    """
    if getattr(request, "prompt_embeds", None) is not None:
        return False
    for item in getattr(request, "mm_features", None) or ():
        place = getattr(item, "mm_position", None)
        if not getattr(item, "identifier", None) or place is None:
            return False
        if not isinstance(place.offset, int) or not isinstance(place.length, int):
            return False
        if place.offset < 0 or place.length < 0:
            return False
    return True


def key_tokens(request: Any, limit: int) -> npt.NDArray[np.int64]:
    """Return the ids that key `request`'s first `limit` tokens (see the module doc)."""
    tokens = np.array(request.all_token_ids[:limit], dtype=np.int64)
    for item in getattr(request, "mm_features", None) or ():
        start = item.mm_position.offset
        end = min(start + item.mm_position.length, len(tokens))
        if start >= end:
            continue
        seed = np.uint64(xxhash.xxh3_64_intdigest(str(item.identifier).encode()))
        steps = np.arange(end - start, dtype=np.uint64) * _STEP
        with np.errstate(over="ignore"):  # arithmetic modulo 2**64, by design
            ids = ((steps + seed) & _MASK) | _BASE
        tokens[start:end] = ids.astype(np.int64)
    return tokens
