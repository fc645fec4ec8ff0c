"""kvtiers' chunk events in vLLM's terms, for vLLM's KV-event stream.

A router that follows vLLM's KV events (`BlockStored`, `BlockRemoved`) knows blocks by
vLLM's block hashes; kvtiers reports `ChunkStored`/`ChunkRemoved` by chunk key. This module
names each chunk event with vLLM's hashes. Decisions:

- Block hashes are vLLM's own (`request.block_hashes`, the hashes vLLM publishes for its GPU
  blocks), not kvtiers' chunk keys: routers already index them, and kvtiers' keys differ per
  TP rank (the layout fingerprint holds the rank). A chunk of `chunk_size` tokens becomes one
  `BlockStored` with its `chunk_size / block_size` block hashes, its token ids, vLLM's block
  size and the hash of the block before it as parent, as vLLM's OffloadingConnector does.
- `medium` is vLLM's name for where the bytes live (`"CPU"`, `"GPU"`, `"STORAGE"`), `locality`
  `"LOCAL"` or `"REMOTE"`, and `ownership` names the kvtiers tier (`"kvtiers:<tier name>"`),
  vLLM's field for the tier of a secondary offloading store.
- A `ChunkStored` carries neither token ids nor parent, so each worker remembers what vLLM
  said of the chunks it saved or loaded (`ChunkOrigins`, bounded, least recently used go
  first). An event of a chunk it does not know (stored by another process or an earlier
  run, or forgotten past the bound) cannot be named and is dropped, counted as
  `kv_events_unnamed`.
- Each TP rank stores its own shard of every chunk and reports its own events; the
  scheduler side passes an event on once every rank reported it (`EventQuorum`).

Nothing here imports vLLM: the connector turns `BlocksStored`/`BlocksRemoved` into vLLM's
structs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from kvtiers.cache import TieredCache
from kvtiers.core.config import load_config
from kvtiers.core.events import ChunkStored, Event
from kvtiers.integrations._runtime import SharedCache
from kvtiers.integrations._vllm_plan import (
    BlockOrigin,
    ConnectorSettings,
    LoadSpec,
    SaveSpec,
    StepPlan,
    tokens_of,
    tokens_to_bytes,
)
from kvtiers.integrations._vllm_prompt import rekeyed

__all__ = [
    "BlockEvent",
    "BlocksRemoved",
    "BlocksStored",
    "ChunkOrigin",
    "ChunkOrigins",
    "EventQuorum",
    "TierMedium",
    "WorkerEvents",
    "block_origin",
    "kv_events_on",
    "tier_medium",
]

logger = logging.getLogger("kvtiers.vllm")

_TOKEN_BYTES = 8  # the plan packs token ids as int64

# vLLM's MEDIUM_CPU / MEDIUM_GPU / MEDIUM_STORAGE and its LOCAL / REMOTE localities, by kind.
_MEDIA: dict[str, tuple[str, str | None]] = {
    "dram": ("CPU", "LOCAL"),
    "hbm": ("GPU", "LOCAL"),
    "lmdb": ("STORAGE", "LOCAL"),
    "remote": ("STORAGE", "REMOTE"),
    "redis": ("CPU", "REMOTE"),
    "mooncake": ("CPU", "REMOTE"),
}


def _vllm_publishes_events(vllm_config: Any) -> bool:
    """Whether vLLM's config turns KV events on (`--kv-events-config`)."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    return bool(events_config is not None and events_config.enable_kv_cache_events)


def kv_events_on(vllm_config: Any, settings: ConnectorSettings) -> bool:
    """Return whether vLLM publishes KV events and kvtiers queues them."""
    if not _vllm_publishes_events(vllm_config):
        return False
    try:
        if load_config(settings.tiers_source()).events > 0:
            return True
    except Exception:
        logger.exception("kvtiers: reading the config failed; KV events are off")
        return False
    logger.warning("kvtiers: vLLM's KV events are on, the kvtiers config's `events` is 0")
    return False


def block_origin(request: Any, num_tokens: int, block_size: int) -> BlockOrigin:
    """Return vLLM's names of the blocks of `request`'s first `num_tokens`."""
    hashes = getattr(request, "block_hashes", None) or ()
    lora = getattr(request, "lora_request", None)
    own = tokens_to_bytes(request.all_token_ids[:num_tokens]) if rekeyed(request) else None
    return BlockOrigin(
        block_hashes=tuple(hashes[: num_tokens // block_size]),
        lora_id=getattr(lora, "adapter_id", None) if lora is not None else None,
        lora_name=getattr(lora, "name", None) if lora is not None else None,
        token_ids=own,
    )


@dataclass(frozen=True, slots=True)
class TierMedium:
    """How vLLM's events name one kvtiers tier."""

    medium: str
    """vLLM's medium: `"CPU"`, `"GPU"` or `"STORAGE"`."""
    locality: str | None
    """`"LOCAL"` or `"REMOTE"` relative to the engine; `None` for an unknown tier kind."""
    ownership: str
    """`"kvtiers:<tier name>"`."""


def tier_medium(kind: str, name: str) -> TierMedium:
    """Return how vLLM's events name tier `name` of `kind` (unknown: storage)."""
    medium, locality = _MEDIA.get(kind, ("STORAGE", None))
    return TierMedium(medium, locality, f"kvtiers:{name}")


@dataclass(frozen=True, slots=True)
class ChunkOrigin:
    """What vLLM said of one chunk: block hashes, tokens, parent block."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    """The hash of the block before the chunk; `None` for a request's first chunk."""
    token_ids: bytes
    """The chunk's token ids, int64 little-endian (8 bytes a token, kept compact)."""
    lora_id: int | None
    lora_name: str | None


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """A chunk became resident in a tier: the fields of vLLM's `BlockStored`."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    where: TierMedium


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """A chunk left a tier: the fields of vLLM's `BlockRemoved`."""

    block_hashes: tuple[bytes, ...]
    where: TierMedium


BlockEvent = BlocksStored | BlocksRemoved


class ChunkOrigins:
    """Remember what vLLM said of each chunk; least recently used go first.

    An entry holds `chunk_size / block_size` hashes (32 bytes each with vLLM's default
    sha256) and 8 bytes a token: about 3.5 KiB for a chunk of 256 tokens in blocks of 16.

    Args:
        max_chunks: chunks remembered at most.
        block_size: vLLM's block size in tokens.
        chunk_size: kvtiers' chunk size, a multiple of `block_size`.
    """

    def __init__(self, max_chunks: int, block_size: int, chunk_size: int) -> None:
        self.max_chunks = max_chunks
        self._per_chunk = chunk_size // block_size
        self._chunk_bytes = chunk_size * _TOKEN_BYTES
        self._entries: OrderedDict[bytes, ChunkOrigin] = OrderedDict()
        self.forgotten = 0
        """Entries dropped for room since the origins were made."""

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, keys: Sequence[bytes], tokens: bytes, origin: BlockOrigin) -> None:
        """Remember the chunks `keys` of `tokens` (int64 bytes), named by `origin`.

        Chunks past the hashes `origin` holds are skipped.
        """
        per, hashes = self._per_chunk, origin.block_hashes
        if origin.token_ids is not None:  # the prompt's own ids, not the keyed ones
            tokens = origin.token_ids
        for i, key in enumerate(keys):
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            blocks = hashes[i * per : (i + 1) * per]
            if len(blocks) < per:
                break
            self._entries[key] = ChunkOrigin(
                block_hashes=blocks,
                parent_block_hash=hashes[i * per - 1] if i else None,
                token_ids=tokens[i * self._chunk_bytes : (i + 1) * self._chunk_bytes],
                lora_id=origin.lora_id,
                lora_name=origin.lora_name,
            )
            if len(self._entries) > self.max_chunks:
                self._entries.popitem(last=False)
                self.forgotten += 1

    def get(self, key: bytes) -> ChunkOrigin | None:
        """Return what is known of chunk `key`, marking it recently used."""
        origin = self._entries.get(key)
        if origin is not None:
            self._entries.move_to_end(key)
        return origin


class WorkerEvents:
    """Drain a worker cache's KV events and name them in vLLM's terms.

    Used from vLLM's worker thread only. The cache's events are drained on its own loop
    (`TieredCache.take_events` must run there) without waiting: each `take` hands over
    what the previous drain returned and starts the next one, so the events of a step
    come out one step later and the forward pass never waits for the cache.

    Args:
        entry: the shared cache and its loop.
        max_chunks: chunks whose origin is remembered (`ChunkOrigins`).
        block_size: vLLM's block size in tokens.
        chunk_size: kvtiers' chunk size in tokens.
    """

    def __init__(
        self, entry: SharedCache, max_chunks: int, block_size: int, chunk_size: int
    ) -> None:
        self._entry = entry
        self._block = block_size
        self.origins = ChunkOrigins(max_chunks, block_size, chunk_size)
        self._media = {tier.name: tier_medium(tier.kind, tier.name) for tier in entry.cache.tiers}
        self._drain: concurrent.futures.Future[list[Event]] | None = None
        self._counts = {"kv_events": 0, "kv_events_unnamed": 0}

    def record(self, plan: StepPlan) -> None:
        """Remember the origins of the chunks the plan's loads and saves name."""
        cache = self._entry.cache
        specs: list[LoadSpec | SaveSpec] = [*plan.loads, *plan.saves]
        for spec in specs:
            if spec.origin is not None:
                keys = cache.keys(tokens_of(spec.tokens), salt=spec.salt)
                self.origins.record(keys, spec.tokens, spec.origin)

    def take(self, wait: float = 0.0) -> list[BlockEvent]:
        """Return the named events of the last drain; start the next one.

        Args:
            wait: seconds to wait for a drain in flight (0: never wait).
        """
        raw: list[Event] = []
        pending = self._drain
        if pending is not None:
            try:
                raw = pending.result(timeout=wait)
                self._drain = None
            except concurrent.futures.TimeoutError:
                pass
            except Exception:
                logger.exception("kvtiers: draining the cache's KV events failed")
                self._drain = None
        if self._drain is None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
                self._drain = self._entry.loop.submit(_drain(self._entry.cache))
        return self.name(raw)

    def name(self, events: Iterable[Event]) -> list[BlockEvent]:
        """Return `events` in vLLM's terms, dropping (counted) unknown chunks'."""
        out: list[BlockEvent] = []
        for event in events:
            origin = self.origins.get(event.key)
            where = self._media.get(event.tier)
            if origin is None or where is None:
                self._counts["kv_events_unnamed"] += 1
                continue
            if isinstance(event, ChunkStored):
                tokens = np.frombuffer(origin.token_ids, dtype="<i8")
                out.append(
                    BlocksStored(
                        block_hashes=origin.block_hashes,
                        parent_block_hash=origin.parent_block_hash,
                        token_ids=tuple(tokens.tolist()),
                        block_size=self._block,
                        lora_id=origin.lora_id,
                        lora_name=origin.lora_name,
                        where=where,
                    )
                )
            else:
                out.append(BlocksRemoved(block_hashes=origin.block_hashes, where=where))
        self._counts["kv_events"] += len(out)
        return out

    def take_counts(self) -> dict[str, int]:
        """Return the non-zero event counters since the last call; reset them."""
        counts = {k: v for k, v in self._counts.items() if v}
        self._counts = dict.fromkeys(self._counts, 0)
        return counts


async def _drain(cache: TieredCache) -> list[Event]:
    return cache.take_events()


_E = TypeVar("_E", bound=Hashable)


class EventQuorum(Generic[_E]):
    """Pass an event on once every worker reported it; hold the rest.

    The workers are the TP ranks of every pipeline stage, each storing its own shard.
    They finish their background stores at different steps, so a worker's event may come
    a few steps after another's; equal events are counted across steps. With one rank,
    events pass straight through.

    Args:
        num_ranks: the workers that report events (TP size x pipeline stages).
        max_pending: events held at most; past it the oldest is dropped and counted.
    """

    def __init__(self, num_ranks: int, max_pending: int) -> None:
        self._ranks = num_ranks
        self._max_pending = max_pending
        self._pending: dict[_E, int] = {}
        self._ready: list[_E] = []
        self.dropped = 0
        """Events dropped before every rank reported them, since the quorum was made."""

    def add(self, events: Iterable[_E]) -> None:
        """Count `events`, one report each from some rank."""
        if self._ranks <= 1:
            self._ready.extend(events)
            return
        for event in events:
            count = self._pending.pop(event, 0) + 1
            if count >= self._ranks:
                self._ready.append(event)
                continue
            if len(self._pending) >= self._max_pending:
                del self._pending[next(iter(self._pending))]
                self.dropped += 1
            self._pending[event] = count

    def take(self) -> list[_E]:
        """Return the events every rank reported since the last call, in order."""
        ready, self._ready = self._ready, []
        return ready

    def take_counts(self) -> dict[str, int]:
        """Return `kv_events_unconfirmed` since the last call, if non-zero."""
        dropped, self.dropped = self.dropped, 0
        return {"kv_events_unconfirmed": dropped} if dropped else {}
