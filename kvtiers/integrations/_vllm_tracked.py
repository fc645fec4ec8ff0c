"""What the vLLM connector's scheduler side knows about one live request.

vLLM objects are used duck-typed (`request.request_id`, `all_token_ids`, ...), so this
module imports no vLLM.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtiers.core.index import LookupResult
from kvtiers.integrations._vllm_prompt import key_tokens, rekeyed

__all__ = ["Salt", "Tracked", "salt_of"]

Salt = str | bytes | None


def salt_of(request: Any) -> Salt:
    """Return the kvtiers salt of a request: its cache salt and LoRA adapter, if any.

    KV computed under another adapter or tenant salt must never match.
    """
    parts: list[str] = []
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt:
        parts.append(f"salt={cache_salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', lora)}")
    return "\x1f".join(parts) or None


@dataclass(slots=True, eq=False)
class Tracked:
    """What the scheduler side knows about one live request."""

    request: Any
    salt: Salt
    eligible: bool
    """False for requests kvtiers cannot key (`_vllm_prompt.keyable`: misshapen embeddings,
    multimodal items not named by their content)."""
    prompt_keys: npt.NDArray[np.int64] | None = None
    """The ids that key the prompt (`_vllm_prompt.key_tokens`), made once."""
    answer: int | None = None
    """Cached prefix length from the last finished lookup, until it is used."""
    future: concurrent.futures.Future[LookupResult] | None = None
    tiers: tuple[str, ...] = ()
    """Per chunk, the tier the last finished lookup found it in (`LookupResult.tiers`)."""
    loaded: tuple[int, int] | None = None
    """The token span `[start, end)` of the accepted load, until its tiers are asked for."""
    asked_at: float = 0.0
    asked_computed: int = 0
    """`num_computed_tokens` of the last `get_num_new_matched_tokens` call."""
    cached: int = 0
    """Tokens of the request known to be in kvtiers (found by a lookup, or saved)."""
    awaited: int = 0
    """Prompt tokens a producer announced and no lookup has found yet (0: none awaited)."""
    waiting_since: float | None = None
    """When a lookup first found less than a producer announced."""
    next_lookup_at: float = 0.0
    """While waiting for announced KV: no new lookup before this time."""
    load_failed: bool = False
    """An asynchronous load of this request failed: it loads nothing more (vLLM recomputes
    the whole request, and a lookup could find the same chunks again)."""
    stale: bool = False
    """Tracked when the cache was reset (`SchedulerSide.reset`): it saves nothing more."""
    state_at: int = 0
    """A state-space model's tokens at whose end kvtiers holds the request's state (loaded
    there, or saved), 0 if none."""
    keep: int | None = None
    """The request's reuse hint (`keep_tokens` in its `kv_transfer_params`), if any."""

    def keyed(self, limit: int) -> npt.NDArray[np.int64]:
        """Return the ids that key the request's first `limit` tokens.

        The prompt's are made once (hashing embeddings costs milliseconds for long
        prompts); generated tokens past the prompt are keyed by their own ids.
        """
        request = self.request
        if not rekeyed(request):
            return np.asarray(request.all_token_ids[:limit], dtype=np.int64)
        if self.prompt_keys is None:
            self.prompt_keys = key_tokens(request, request.num_prompt_tokens)
        if limit <= len(self.prompt_keys):
            return self.prompt_keys[:limit]
        rest = np.asarray(request.all_token_ids[len(self.prompt_keys) : limit], dtype=np.int64)
        return np.concatenate([self.prompt_keys, rest])

    def forget_lookups(self) -> None:
        """Drop what lookups found and what is known cached (the cache was reset)."""
        if self.future is not None:
            self.future.cancel()
        self.future, self.answer, self.tiers = None, None, ()
        self.loaded, self.cached, self.awaited, self.state_at = None, 0, 0, 0
