"""The vLLM connector's settings and the per-step plan the scheduler sends to the workers.

Nothing here imports vLLM: the plan travels inside vLLM's connector metadata (pickled to
the worker processes), so it is made of plain values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvtiers.core.checks import is_int
from kvtiers.core.config import CacheConfig
from kvtiers.core.errors import ConfigError
from kvtiers.integrations._side_caches import pool_config

__all__ = [
    "DEFAULT_CONFIG",
    "NULL_BLOCK",
    "BlockOrigin",
    "ConnectorSettings",
    "LoadSpec",
    "SaveSpec",
    "StateSave",
    "GroupBlocks",
    "StepPlan",
    "chunk_size_for",
    "max_chunk_for_window",
    "tokens_of",
    "tokens_to_bytes",
]

Salt = str | bytes | None
GroupBlocks = tuple[tuple[int, ...], ...]
"""Block ids per KV-cache group (vLLM's hybrid KV-cache manager), in token order each.

One group for most models; sliding-window groups hold vLLM's null block (id 0) where
vLLM freed the blocks behind the window."""

NULL_BLOCK = 0
"""vLLM's null block: where a group's block table points at blocks vLLM freed (behind a
sliding window, in an earlier chunk of local attention, a Mamba state no longer kept). It
holds no request's KV and is never attended, so loads skip it."""

#: Tiers used when the extra config names none: one DRAM tier.
DEFAULT_CONFIG: Mapping[str, Any] = {"tiers": [{"kind": "dram", "capacity": "2GiB"}]}

_PREFERRED_CHUNK = 256
_WHERE = "kv_connector_extra_config"


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What `kv_connector_extra_config` may say; every key is optional."""

    config: str | Mapping[str, Any] | None = None
    """The kvtiers config: a TOML/YAML path or an inline dict (tiers; a layout is ignored)."""
    chunk_size: int | None = None
    """Tokens per chunk, a multiple of vLLM's block size; 256 (or near it) by default."""
    model_name: str | None = None
    """Name in the layout fingerprint; vLLM's `model` (path or id) by default."""
    store_generated: bool = False
    """Also store full chunks of generated tokens when a request finishes."""
    lookup_wait_ms: float = 20.0
    """How long the scheduler waits for a lookup before answering 'ask again later'.

    Not at all for the lookups of a request waiting for announced KV (hand-off)."""
    lookup_deadline_s: float = 5.0
    """How long a lookup may take in all before it counts as a miss."""
    load_timeout_s: float = 30.0
    """How long a worker waits for a load before reporting its blocks as failed."""
    close_timeout_s: float = 60.0
    """How long shutdown waits for saves in flight and write queues; and a reset
    (`reset_cache`) for loads and saves in flight and for the workers to clear."""
    max_pending_saves: int = 64
    """Saves in flight per worker; beyond it a save is skipped (counted), never waited on."""
    staging_keep_mib: int = 256
    """Host memory a worker on the CPU keeps between steps to stage later loads and saves."""
    socket_dir: str | None = None
    """Folder of the lookup channel's Unix sockets; the system's temp folder by default."""
    on_load_error: Literal["recompute", "fail"] = "recompute"
    """What vLLM does when a load fails: recompute (kvtiers' default) or fail the request."""
    event_chunks: int = 8192
    """With KV events on: chunks whose vLLM block hashes and tokens a worker remembers."""
    handoff_wait_s: float = 5.0
    """How long a request waits for KV a producer announced (prefill/decode hand-off)."""
    handoff_poll_ms: float = 10.0
    """While a request waits for announced KV: the pause between two of its lookups."""
    mamba_config: str | Mapping[str, Any] | None = None
    """The kvtiers config of a state-space model's states (a path or a table); the KV
    config's tiers, each LMDB path suffixed `-mamba`, by default."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Validate `kv_connector_extra_config`.

        Raises:
            ConfigError: an unknown key or a bad value; the message names the key.
        """
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known, key=str)
        if unknown:
            raise ConfigError(
                f"{_WHERE}.{unknown[0]}: unknown key; expected one of {', '.join(sorted(known))}"
            )
        settings = cls(**extra)
        settings._check()
        return settings

    def _check(self) -> None:
        """Raise `ConfigError` naming the first key found with a bad value."""
        self._check_caching()
        self._check_waits()
        self._check_limits()

    def _check_caching(self) -> None:
        """Check the configs, the chunk size, the model name and `store_generated`."""
        for name in ("config", "mamba_config"):
            if not isinstance(getattr(self, name), str | Mapping | None):
                raise ConfigError(f"{_WHERE}.{name}: expected a file path or a table")
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool)
            or not isinstance(self.chunk_size, int)
            or self.chunk_size < 1
        ):
            raise ConfigError(f"{_WHERE}.chunk_size: expected a positive integer")
        if self.model_name is not None and (
            not isinstance(self.model_name, str) or not self.model_name
        ):
            raise ConfigError(f"{_WHERE}.model_name: expected a non-empty string")
        if not isinstance(self.store_generated, bool):
            raise ConfigError(f"{_WHERE}.store_generated: expected true or false")

    def _check_waits(self) -> None:
        """Check the waits and timeouts: each a non-negative finite number."""
        for name in (
            "lookup_wait_ms",
            "lookup_deadline_s",
            "load_timeout_s",
            "close_timeout_s",
            "handoff_wait_s",
            "handoff_poll_ms",
        ):
            value = getattr(self, name)
            # NOTE: an infinite wait overflows the futures' and locks' timeouts.
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{_WHERE}.{name}: expected a non-negative number")
            if not 0 <= value < math.inf:
                raise ConfigError(
                    f"{_WHERE}.{name}: expected a non-negative finite number, got {value}"
                )

    def _check_limits(self) -> None:
        """Check the sizes, the socket folder and what a failed load does."""
        for name in ("max_pending_saves", "event_chunks"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"{_WHERE}.{name}: expected a positive integer")
        if not is_int(self.staging_keep_mib) or self.staging_keep_mib < 0:
            raise ConfigError(f"{_WHERE}.staging_keep_mib: expected a non-negative integer")
        if self.socket_dir is not None and not isinstance(self.socket_dir, str):
            raise ConfigError(f"{_WHERE}.socket_dir: expected a folder path")
        if self.on_load_error not in ("recompute", "fail"):
            raise ConfigError(f"{_WHERE}.on_load_error: expected 'recompute' or 'fail'")

    def tiers_source(self) -> str | Mapping[str, Any]:
        """Return the kvtiers config to build the cache from."""
        return DEFAULT_CONFIG if self.config is None else self.config

    def states_config(self) -> CacheConfig:
        """Return the config of a state-space model's states' cache (`mamba_config`).

        Raises:
            ConfigError: the config cannot be read, or shares an LMDB path with the KV's.
        """
        source, own = self.tiers_source(), self.mamba_config
        return pool_config(source, own, "mamba", where=f"{_WHERE}.mamba_config")


def chunk_size_for(
    block_size: int,
    requested: int | None,
    window: int | None = None,
    attention_chunk: int | None = None,
    state_space: bool = False,
) -> int:
    """Return the chunk size: `requested`, or 256 when `block_size` divides it.

    Otherwise the multiple of `block_size` nearest to 256 (at least one block). Under
    vLLM's hybrid KV-cache manager every block of a chunk must still be allocated in the
    step that completes the chunk (and saves it): with sliding-window layers (`window`: the
    smallest window) a chunk is at most `max_chunk_for_window` tokens; with chunked local
    attention (`attention_chunk`: the tokens of one local-attention chunk, or the greatest
    common divisor of several) a chunk divides it, so that no chunk straddles the boundary
    behind which vLLM frees the blocks. The default is then the largest multiple of
    `block_size` that fits, at most the choice above. A state-space model (`state_space`)
    keeps its recurrent state at block boundaries only, and a prompt can resume only
    where a state is kept, so its chunk is one block.

    Raises:
        ConfigError: `requested` is not a multiple of `block_size`, exceeds the window's
            limit or does not divide the attention chunk; or no multiple of `block_size`
            divides the attention chunk.
    """
    limit = None if window is None else max_chunk_for_window(block_size, window)
    if state_space:
        if requested not in (None, block_size):
            raise ConfigError(
                f"{_WHERE}.chunk_size: {requested} is not vLLM's block size {block_size}, "
                "which a state-space model's chunks must be (its state is kept per block); "
                "leave chunk_size out"
            )
        return block_size
    if requested is not None:
        return _checked_request(block_size, requested, limit, window, attention_chunk)
    return _default_chunk(block_size, limit, attention_chunk)


def _checked_request(
    block_size: int,
    requested: int,
    limit: int | None,
    window: int | None,
    attention_chunk: int | None,
) -> int:
    """Return `requested` if it fits `block_size`, the window's `limit` and `attention_chunk`."""
    if requested % block_size:
        raise ConfigError(
            f"{_WHERE}.chunk_size: {requested} is not a multiple of vLLM's block size {block_size}"
        )
    if limit is not None and requested > limit:
        raise ConfigError(
            f"{_WHERE}.chunk_size: {requested} exceeds {limit}, the most a model with a "
            f"{window}-token sliding window allows under vLLM's hybrid KV-cache manager "
            "(or pass --disable-hybrid-kv-cache-manager)"
        )
    if attention_chunk is not None and attention_chunk % requested:
        raise ConfigError(
            f"{_WHERE}.chunk_size: {requested} does not divide {attention_chunk}, the "
            "model's chunks of local attention, as vLLM's hybrid KV-cache manager needs "
            "(or pass --disable-hybrid-kv-cache-manager)"
        )
    return requested


def _default_chunk(block_size: int, limit: int | None, attention_chunk: int | None) -> int:
    """Return the default chunk: near 256 tokens, at most `limit`, dividing `attention_chunk`."""
    if _PREFERRED_CHUNK % block_size == 0:
        chosen = _PREFERRED_CHUNK
    else:
        chosen = block_size * max(1, round(_PREFERRED_CHUNK / block_size))
    chosen = chosen if limit is None else min(chosen, limit)
    if attention_chunk is None:
        return chosen
    fits = [c for c in range(block_size, chosen + 1, block_size) if attention_chunk % c == 0]
    if not fits:
        raise ConfigError(
            f"vLLM's block size {block_size} does not divide {attention_chunk}, the model's "
            "chunks of local attention; pass --disable-hybrid-kv-cache-manager"
        )
    return fits[-1]


def max_chunk_for_window(block_size: int, window: int) -> int:
    """Return the largest chunk whose blocks all live in the step that completes it.

    vLLM frees a sliding-window block once every token of it is at least `window` tokens
    behind the tokens computed so far; a chunk completed in a step began at most
    `chunk - 1` tokens before that step's first token, so none of its blocks is freed if
    `chunk <= window + block_size - 1`. At least one block.
    """
    return max(block_size, (window + block_size - 1) // block_size * block_size)


def tokens_to_bytes(tokens: Any) -> bytes:
    """Return token ids as int64 little-endian bytes (compact to pickle)."""
    return np.asarray(tokens, dtype="<i8").tobytes()


def tokens_of(raw: bytes) -> npt.NDArray[np.int64]:
    """Return the token ids packed by `tokens_to_bytes`."""
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


@dataclass(frozen=True, slots=True)
class BlockOrigin:
    """vLLM's names of a request's blocks (sent when KV events are on)."""

    block_hashes: tuple[bytes, ...]
    """vLLM's hash of each full block from the request's first token on, in order."""
    lora_id: int | None = None
    lora_name: str | None = None
    token_ids: bytes | None = None
    """The prompt's own token ids (int64 bytes) where they are not the keyed ones (a
    multimodal prompt's placeholders, see `_vllm_prompt`); `None`: the spec's tokens."""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load the KV of tokens `[start, end)` of a request into its blocks."""

    req_id: str
    tokens: bytes
    """The cached prefix's token ids (int64 bytes), whole chunks, at least `end` tokens."""
    salt: Salt
    block_ids: GroupBlocks
    """The blocks of tokens `[start, end)`, per KV-cache group."""
    start: int
    """First token to load; a multiple of the block size."""
    end: int
    """One past the last token to load; a multiple of the block size."""
    origin: BlockOrigin | None = None
    """vLLM's names of the blocks of `tokens` (KV events on), else `None`."""
    keep_tokens: int | None = None
    """The request's reuse hint (`TieredCache.store`), if it gave one."""
    state_blocks: tuple[int, ...] = ()
    """A state-space model's state blocks at token `end`, one per Mamba group (in group
    order), into which the state kept there is loaded; empty for other models."""


@dataclass(frozen=True, slots=True)
class StateSave:
    """Store a state-space model's recurrent state at the end of `tokens` (its Mamba
    groups' blocks there hold it after this step's forward pass)."""

    req_id: str
    tokens: bytes
    """Token ids (int64 bytes) up to the state, a whole number of chunks."""
    salt: Salt
    blocks: tuple[int, ...]
    """The state's block in each Mamba group, in group order."""
    cold: bool = False
    """Past the request's reuse hint (`keep_tokens`): stored cold, evicted first."""


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the full chunks of `tokens` from token `start` on; their KV is in `block_ids`."""

    req_id: str
    tokens: bytes
    """Token ids (int64 bytes), a whole number of chunks (the chunks before `start` key
    the saved ones)."""
    salt: Salt
    block_ids: GroupBlocks
    """The blocks of tokens `[start, len(tokens))`, per KV-cache group."""
    start: int = 0
    """First token to store; a multiple of the chunk size."""
    finished: bool = False
    """The request has finished and its blocks wait for this save (reported via get_finished)."""
    origin: BlockOrigin | None = None
    """vLLM's names of the blocks of `tokens` (KV events on), else `None`."""
    keep_tokens: int | None = None
    """The request's reuse hint (`TieredCache.store`), if it gave one."""


@dataclass(slots=True)
class StepPlan:
    """What the workers load and save in one engine step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    state_saves: list[StateSave] = field(default_factory=list)
    idle: bool = False
    """The step computes no token (its requests wait, e.g. for asynchronous loads)."""
    waiting: bool = False
    """A request was told to ask again later (a lookup runs, or announced KV is due)."""
    released: list[str] = field(default_factory=list)
    """Finished requests whose planned final save a reset dropped: vLLM holds their blocks
    until the workers report them finished, so they are reported at once."""

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.state_saves or self.released)
