"""Some layers of the redis tier's values, read as byte ranges (GETRANGE) and verified.

A value's payload is layer-major and its header holds a checksum per layer
(`StoredValues(layer_checksums=True)`), so a layer-wise load reads, per value and wave, the
header with the first layers in one range, or, once the header is known, the wave's
layers alone (`LayerPlan`). Each layer is checked against its own checksum before a byte
reaches a destination; a value whose ranges do not verify is read whole and judged as
`get` judges it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.tiers._chunk_format import Header, Verdict
from kvtiers.tiers._layers import Pieces, layer_pieces, write_layers
from kvtiers.tiers._remote_layers import LayerPlan
from kvtiers.tiers.base import Buffer

__all__ = ["LayerRanges", "Ranged"]

_HEADERS_KEPT = 4096  # verified headers kept for later waves (one per chunk of a load)

Ranged = tuple[Header | None, list[bytes]]
"""One value's ranged read: the header it was planned with (`None`: none), what was read."""


class LayerRanges:
    """Plan, and verify, ranged reads of some layers of values of one layout.

    Args:
        layout: the values' layout.
        header_len: bytes of a value's length prefix and header.
        fingerprint: the layout fingerprint values must carry.
    """

    def __init__(self, layout: KVLayout, header_len: int, fingerprint: bytes) -> None:
        self._layout = layout
        self._header_len = header_len
        self._fingerprint = fingerprint
        self._headers: dict[ChunkKey, Header] = {}

    def plan(self, layers: Sequence[int]) -> LayerPlan:
        """Return the reads of `layers` (see `LayerPlan.make` for what it raises)."""
        return LayerPlan.make(layers, self._layout, self._header_len)

    def ranges(self, key: ChunkKey, plan: LayerPlan) -> list[tuple[int, int]]:
        """Return the `[start, end)` byte ranges to read of `key`'s value."""
        return _ranges_of(plan, self._headers.get(key))

    def verify(
        self, key: ChunkKey, plan: LayerPlan, known: Header | None, parts: Sequence[bytes]
    ) -> Pieces | None:
        """Return the layers `parts` hold, each verified; `None` if any check fails.

        `known` is the header the ranges were planned with (`None`: they start with the
        header), not the one kept now: another call may have learned or dropped it since.

        NOTE: the later waves of a load check their layers against the header the first
        wave verified. A value rewritten meanwhile with other bytes fails that check and
        is then read whole, so a stale header costs one read, never a wrong byte; the
        waves of one load may come from two valid versions of the value (each layer
        checked against its own), as on the remote tier.
        """
        if known is not None:
            pieces = plan.verify_runs(known, parts)
        else:
            got = plan.verify_all(parts, fingerprint=self._fingerprint, key=key)
            pieces = None if got is None else got[1]
            if got is not None:
                self._headers[key] = got[0]
                if len(self._headers) > _HEADERS_KEPT:
                    del self._headers[next(iter(self._headers))]
        if pieces is None:
            self._headers.pop(key, None)
        return pieces

    def queue(
        self, pipe: Any, names: Sequence[bytes], keys: Sequence[ChunkKey], plan: LayerPlan
    ) -> list[Header | None]:
        """Queue the GETRANGEs of each key's ranges on a redis pipeline.

        Returns the header each key's ranges were planned with, for `split` and `deliver`.
        """
        planned = []
        for key, name in zip(keys, names, strict=True):
            known = self._headers.get(key)
            for start, end in _ranges_of(plan, known):
                pipe.getrange(name, start, end - 1)  # NOTE: GETRANGE's end is inclusive
            planned.append(known)
        return planned

    @staticmethod
    def split(
        results: Sequence[Any], plan: LayerPlan, planned: Sequence[Header | None]
    ) -> list[Ranged]:
        """Return a pipeline's GETRANGE answers per key (`planned` from `queue`)."""
        reads, at = [], 0
        for known in planned:
            count = len(plan.ranges) if known is None else len(plan.runs)
            reads.append((known, [bytes(part) for part in results[at : at + count]]))
            at += count
        return reads

    def deliver(
        self,
        keys: Sequence[ChunkKey],
        plan: LayerPlan,
        reads: Sequence[Ranged],
        dsts: Sequence[Buffer],
    ) -> tuple[list[Verdict | None], list[int]]:
        """Write the verified layers of each key into its destination.

        Returns each key's verdict (`None` for a missing value, or one to judge whole) and
        the positions of the values that did not verify, for a whole read.

        NOTE: GETRANGE answers a missing value, and a range past a short value's end, with
        b"". Only a range from byte 0 (the header's) tells a missing value; ranges planned
        with a known header that read b"" are judged whole, or a value truncated (or
        replaced by a short one) between waves would stay, uncounted, as a miss.
        """
        verdicts: list[Verdict | None] = []
        again: list[int] = []
        for i, (key, (known, got), dst) in enumerate(zip(keys, reads, dsts, strict=True)):
            if known is None and not got[0]:  # no value
                verdicts.append(None)
                continue
            pieces = self.verify(key, plan, known, got)
            if pieces is not None:
                write_layers(dst, pieces, self._layout.num_layers)
            else:
                again.append(i)
            verdicts.append(Verdict.OK if pieces is not None else None)
        return verdicts, again

    def deliver_whole(self, plan: LayerPlan, payload: Buffer, dst: Buffer) -> None:
        """Write the planned layers of a whole, verified payload into `dst`."""
        pieces = layer_pieces(np.asarray(payload).data, plan.layers, self._layout.layer_bytes)
        write_layers(dst, pieces, self._layout.num_layers)

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Drop the headers of `keys` (their values were deleted or replaced)."""
        for key in keys:
            self._headers.pop(key, None)


def _ranges_of(plan: LayerPlan, known: Header | None) -> list[tuple[int, int]]:
    """Return the ranges of `plan` to read of a value whose header is `known` (or not)."""
    return list(plan.ranges) if known is None else plan.run_ranges(known)
