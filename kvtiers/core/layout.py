"""The layout of one chunk of KV, and its fingerprint."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import msgpack
import xxhash

from kvtiers.core.checks import MAX_BYTES, check_int, describe
from kvtiers.core.errors import ConfigError

__all__ = ["DTYPE_SIZES", "PAYLOAD_ORDER", "KVLayout"]

#: Bytes per element of each dtype name a layout accepts (torch's names, no torch import).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: The order of a chunk payload's axes, outermost first. One layer's slice is contiguous.
PAYLOAD_ORDER = "layer,kv,token,head,dim"

# NOTE: bump when the fingerprint's input changes; old entries then stop matching (a miss).
_FINGERPRINT_VERSION = 1


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one chunk of KV is laid out, and which model and shard it belongs to.

    The payload of a chunk is layer-major, `[layer][k|v][token][head][dim]` for `"mha"` and
    `[layer][latent][token][dim]` for `"mla"` (one latent vector per token, `num_kv_heads` 1).
    """

    model: str
    """Model name; part of the fingerprint, so two models never share a chunk."""
    num_layers: int
    """Transformer layers whose KV is cached."""
    num_kv_heads: int
    """KV heads held by this shard (1 for `"mla"`)."""
    head_size: int
    """Elements per head (for `"mla"`: the latent width)."""
    dtype: str = "bfloat16"
    """Element type, a torch dtype name such as `"bfloat16"` or `"float8_e4m3fn"`."""
    chunk_size: int = 256
    """Tokens per chunk; only full chunks are keyed and cached."""
    kind: Literal["mha", "mla"] = "mha"
    """`"mha"` keeps K and V per layer, `"mla"` one latent buffer per layer."""
    model_revision: str = ""
    """Weights revision; KV of two revisions never matches."""
    tp_rank: int = 0
    """This shard's tensor-parallel rank."""
    tp_size: int = 1
    """Tensor-parallel world size."""

    def __post_init__(self) -> None:
        _check_str("layout.model", self.model, allow_empty=False)
        _check_str("layout.model_revision", self.model_revision, allow_empty=True)
        for name in ("num_layers", "num_kv_heads", "head_size", "chunk_size", "tp_size"):
            check_int(f"layout.{name}", getattr(self, name), 1)
        check_int("layout.tp_rank", self.tp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise ConfigError(
                f"layout.tp_rank: {self.tp_rank} must be below tp_size {self.tp_size}"
            )
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise ConfigError(
                f"layout.dtype: {describe(self.dtype)} is not one of {', '.join(DTYPE_SIZES)}"
            )
        if not isinstance(self.kind, str) or self.kind not in ("mha", "mla"):
            raise ConfigError(f"layout.kind: {describe(self.kind)} is not 'mha' or 'mla'")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ConfigError("layout.num_kv_heads: must be 1 for kind 'mla'")
        # NOTE: each dimension fits 32 bits, their product may not fit 64 (the fingerprint
        # packs it); no tier holds a chunk past 1 EiB anyway.
        if self.chunk_bytes > MAX_BYTES:
            raise ConfigError(
                f"layout.chunk_size: a chunk of {self.chunk_size} tokens would be "
                f"{self.chunk_bytes:,} bytes ({self.bytes_per_token:,} per token), more than 1 EiB"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "layout") -> KVLayout:
        """Build a layout from plain config values, naming any unknown key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(k if isinstance(k, str) else describe(k) for k in set(data) - known)
        if unknown:
            raise ConfigError(
                f"{where}.{unknown[0]:.60}: unknown key; expected one of {', '.join(sorted(known))}"
            )
        missing = [n for n in ("model", "num_layers", "num_kv_heads", "head_size") if n not in data]
        if missing:
            raise ConfigError(f"{where}.{missing[0]}: required key is missing")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Return the layout as plain values, the inverse of `from_dict`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def num_kv(self) -> int:
        """Planes per layer: 2 (K and V) for `"mha"`, 1 for `"mla"`."""
        return 2 if self.kind == "mha" else 1

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV per token, all layers."""
        return self.num_layers * self.num_kv * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk payload."""
        return self.bytes_per_token * self.chunk_size

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's contiguous slice of a chunk payload."""
        return self.chunk_bytes // self.num_layers

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Return the shape of KV for `num_tokens` tokens, as `load` returns it."""
        if self.kind == "mha":
            return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_size)
        return (self.num_layers, 1, num_tokens, self.head_size)

    def chunk_shape(self) -> tuple[int, ...]:
        """Return the shape of one chunk payload in elements."""
        return self.kv_shape(self.chunk_size)

    @property
    def fingerprint(self) -> bytes:
        """Return 16 bytes that identify the model, shard, layout and payload order."""
        fields_ = (
            _FINGERPRINT_VERSION,
            self.model,
            self.model_revision,
            self.kind,
            self.num_layers,
            self.num_kv_heads,
            self.head_size,
            self.dtype,
            self.chunk_size,
            self.tp_rank,
            self.tp_size,
            self.chunk_bytes,
            PAYLOAD_ORDER,
        )
        return xxhash.xxh3_128_digest(msgpack.packb(fields_, use_bin_type=True))


def _check_str(name: str, value: object, *, allow_empty: bool) -> None:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise ConfigError(f"{name}: expected a non-empty string, got {describe(value)}")
