"""Chained chunk keys: the identity of a chunk of KV.

`key[i] = xxh3_128(key[i-1] ‖ tokens of chunk i)` and `key[-1] = xxh3_128(fingerprint ‖ salt)`,
over the tokens as little-endian int64. A key therefore names the whole prefix up to its chunk,
the layout (model, revision, dtype, shard, chunk size) and the tenant's salt, and nothing else:
no process seed, no Python `hash()`.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import NewType

import numpy as np
import numpy.typing as npt
import xxhash

from kvtiers.core.errors import TokenError

__all__ = ["KEY_BYTES", "ChunkHasher", "ChunkKey", "as_token_array"]

ChunkKey = NewType("ChunkKey", bytes)
"""16 bytes naming one chunk and, through the chain, its whole prefix."""

KEY_BYTES = 16

_TOKEN_DTYPE = np.dtype("<i8")


def as_token_array(tokens: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """Return `tokens` as a 1-D little-endian int64 array, checking every id.

    Raises:
        TokenError: `tokens` is not 1-D, holds non-integers, or holds negative ids.
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, list | tuple):
        # NOTE: array('q') refuses floats (np.asarray would make a float array to reject),
        # and converts a list of ints at least as fast.
        try:
            arr = np.frombuffer(array.array("q", tokens), dtype=np.int64)
        except (TypeError, OverflowError) as exc:
            raise TokenError(f"tokens: expected integer ids ({exc})") from exc
        _refuse_bools(tokens, arr)
    else:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TokenError(f"tokens: cannot read as integers ({exc})") from exc
    if arr.ndim != 1:
        raise TokenError(f"tokens: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        raise TokenError(f"tokens: expected integer ids, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > 2**63 - 1:
        raise TokenError("tokens: an id does not fit in int64")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise TokenError(f"tokens: ids must be non-negative, found {int(arr.min())}")
    return np.ascontiguousarray(arr, dtype=_TOKEN_DTYPE)


def _refuse_bools(tokens: Sequence[object], arr: npt.NDArray[np.integer]) -> None:
    """Refuse `True`/`False` among `tokens` (`array` takes them as 1 and 0).

    Only the places holding 0 or 1 are looked at, so a long prompt costs one vector compare.
    """
    for i in np.flatnonzero(arr <= 1).tolist():
        if isinstance(tokens[i], bool | np.bool_):
            raise TokenError(f"tokens: expected integer ids, found {tokens[i]!r} at {i}")


class ChunkHasher:
    """Compute the chained keys of a token sequence's full chunks.

    Args:
        fingerprint: the layout's fingerprint (`KVLayout.fingerprint`).
        chunk_size: tokens per chunk.
    """

    __slots__ = ("_chunk_bytes", "_fingerprint", "chunk_size")

    def __init__(self, fingerprint: bytes, chunk_size: int) -> None:
        self._fingerprint = bytes(fingerprint)
        self.chunk_size = chunk_size
        self._chunk_bytes = chunk_size * _TOKEN_DTYPE.itemsize

    def root(self, salt: str | bytes | None = None) -> ChunkKey:
        """Return the chain's seed key for a tenant's `salt` (the parent of chunk 0)."""
        return ChunkKey(xxhash.xxh3_128_digest(self._fingerprint + _salt_bytes(salt)))

    def keys(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        salt: str | bytes | None = None,
        *,
        max_chunks: int | None = None,
    ) -> list[ChunkKey]:
        """Return the keys of the full chunks of `tokens`, prefix first.

        A partial tail chunk has no key. `max_chunks` stops early.
        """
        return self.keys_of_array(as_token_array(tokens), salt, max_chunks=max_chunks)

    def keys_of_array(
        self,
        arr: npt.NDArray[np.int64],
        salt: str | bytes | None = None,
        *,
        max_chunks: int | None = None,
    ) -> list[ChunkKey]:
        """Return the keys of an array that `as_token_array` already returned.

        The same as `keys` without checking the ids again (a caller that checked them once).
        """
        num_chunks = len(arr) // self.chunk_size
        if max_chunks is not None:
            num_chunks = min(num_chunks, max_chunks)
        view = memoryview(arr.data).cast("B")
        step = self._chunk_bytes
        digest = xxhash.xxh3_128_digest
        prev: bytes = self.root(salt)
        out: list[bytes] = []
        append = out.append
        for i in range(num_chunks):
            prev = digest(prev + view[i * step : (i + 1) * step])
            append(prev)
        return out  # type: ignore[return-value]  # NOTE: ChunkKey is bytes at run time

    def keys_of_hashes(
        self, hashes: Sequence[str | bytes], salt: str | bytes | None = None
    ) -> list[ChunkKey]:
        """Return the chunk keys of an engine's own chunk hashes, in the same order.

        For engines that hash their pages themselves (SGLang's page hashes): each hash is
        taken under this layout's fingerprint and `salt`, so hashes of another model, shard
        or tenant never map to the same key. The engine's hashes must already be chained
        (a hash fixes its whole prefix); nothing here chains them again.

        Raises:
            TokenError: a hash is neither `str` nor `bytes`, or is empty.
        """
        root = self.root(salt) + b"\x03"  # NOTE: a tag keeps these apart from token chains
        digest = xxhash.xxh3_128_digest
        out: list[bytes] = []
        for i, h in enumerate(hashes):
            if isinstance(h, str):
                raw = _utf8(h, f"hashes[{i}]")
            elif isinstance(h, bytes | bytearray | memoryview):
                raw = bytes(h)
            else:
                raise TokenError(f"hashes[{i}]: expected str or bytes, got {type(h).__name__}")
            if not raw:
                raise TokenError(f"hashes[{i}]: empty")
            out.append(digest(root + raw))
        return out  # type: ignore[return-value]  # NOTE: ChunkKey is bytes at run time


def _salt_bytes(salt: str | bytes | None) -> bytes:
    # NOTE: a one-byte type tag keeps salt None, "" and b"" apart.
    if salt is None:
        return b"\x00"
    if isinstance(salt, str):
        return b"\x01" + _utf8(salt, "salt")
    if isinstance(salt, bytes | bytearray | memoryview):
        return b"\x02" + bytes(salt)
    raise TokenError(f"salt: expected str, bytes or None, got {type(salt).__name__}")


def _utf8(text: str, where: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise TokenError(f"{where}: not encodable as UTF-8 ({exc.reason})") from exc
