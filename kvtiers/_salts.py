"""Which salts stored prompts that begin with a given chunk: the "salt_mismatch" miss reason.

A salt (a tenant, a LoRA adapter) seeds every key of a prompt's chain, so a prompt cached
under one salt and asked for under another misses at its first chunk with nothing else to
tell it from a prompt never seen. `SaltWitness` remembers, for the first chunks of recent
stores, the chain roots (layout fingerprint and salt) they were stored under, so `lookup`
can say which it was. It is local to the cache: a prompt another process stored under
another salt in a shared tier still counts as "never_stored".
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = ["SaltWitness"]

_ROOTS_PER_CHUNK = 4  # salts remembered per first chunk, the latest kept
DEFAULT_LIMIT = 8192  # first chunks remembered, about 1.5 MiB


class SaltWitness:
    """Remember the chain roots that recent stores used, by their first chunk of tokens.

    Args:
        chunk_size: tokens per chunk.
        limit: first chunks remembered; the oldest is forgotten first.
    """

    def __init__(self, chunk_size: int, limit: int = DEFAULT_LIMIT) -> None:
        self._chunk_size = chunk_size
        self._limit = limit
        # NOTE: a dict as a bounded insertion-ordered map: the oldest first chunk goes first.
        self._roots: dict[int, tuple[bytes, ...]] = {}

    def _first(self, tokens: npt.NDArray[np.int64]) -> int | None:
        if len(tokens) < self._chunk_size:
            return None
        return xxhash.xxh3_64_intdigest(tokens[: self._chunk_size].tobytes())

    def stored(self, tokens: npt.NDArray[np.int64], root: bytes) -> None:
        """Record that `tokens` were stored under the chain root `root`."""
        first = self._first(tokens)
        if first is None:
            return
        roots = self._roots.pop(first, ())
        if root not in roots:
            roots = (*roots[1 - _ROOTS_PER_CHUNK :], root)
        self._roots[first] = roots
        if len(self._roots) > self._limit:
            del self._roots[next(iter(self._roots))]

    def other_root(self, tokens: npt.NDArray[np.int64], root: bytes) -> bool:
        """Return whether `tokens`' first chunk was stored under roots other than `root` only."""
        first = self._first(tokens)
        roots = self._roots.get(first, ()) if first is not None else ()
        return bool(roots) and root not in roots
