"""Reading some layers of a stored chunk: the byte ranges, their checks, their places.

A chunk's payload is layer-major, so layer `i` is bytes `[h + i*L, h + (i+1)*L)` of the
object, `h` being the header's size and `L` a layer's. A plan reads the header and one
range per run of consecutive layers; the header is checked as `get` checks it, and each
layer against its own checksum in the header.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtiers.core.checks import is_int
from kvtiers.core.errors import InvalidInputError
from kvtiers.core.layout import KVLayout
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers.base import Buffer

__all__ = ["LayerPlan", "Pieces", "write_layers"]

Pieces = list[tuple[int, memoryview]]
"""`(layer index, that layer's bytes)` pairs."""


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """The byte ranges holding the header and some layers of any chunk of one layout."""

    layout: KVLayout
    layers: tuple[int, ...]
    """The layers read, ascending."""
    runs: tuple[tuple[int, int], ...]
    """`[first, end)` runs of consecutive layers."""
    ranges: tuple[tuple[int, int], ...]
    """`[start, end)` byte ranges: the header, then one per run."""

    @classmethod
    def make(cls, layers: Sequence[int], layout: KVLayout, header_len: int) -> LayerPlan:
        """Plan the reads of `layers` of chunks whose header takes `header_len` bytes.

        Raises:
            InvalidInputError: `layers` is empty, or holds repeated or out-of-range indices.
        """
        num = layout.num_layers
        if any(not is_int(i) or not 0 <= i < num for i in layers):
            raise InvalidInputError(f"layers: expected indices in [0, {num}), got {layers!r}")
        wanted = sorted(layers)
        if not wanted or len(set(wanted)) != len(wanted):
            raise InvalidInputError(f"layers: expected distinct layer indices, got {layers!r}")
        runs: list[tuple[int, int]] = []
        for layer in wanted:
            if runs and runs[-1][1] == layer:
                runs[-1] = (runs[-1][0], layer + 1)
            else:
                runs.append((layer, layer + 1))
        step = layout.layer_bytes
        ranges = [
            (0, header_len),
            *((header_len + a * step, header_len + b * step) for a, b in runs),
        ]
        return cls(layout, tuple(wanted), tuple(runs), tuple(ranges))

    def verify(self, parts: Sequence[Any], *, fingerprint: bytes, key: bytes) -> Pieces | None:
        """Return each layer read, verified; `None` if any range or check fails.

        Args:
            parts: what was read for `ranges`: bytes, or the exception a range raised.
            fingerprint: the layout fingerprint the reader expects.
            key: the key the object was read under.
        """
        if len(parts) != len(self.ranges) or any(not isinstance(p, bytes) for p in parts):
            return None
        verdict, header = fmt.check_header(
            parts[0],
            fingerprint=fingerprint,
            key=key,
            payload_len=self.layout.chunk_bytes,
            num_layers=self.layout.num_layers,
        )
        if header is None or verdict is not fmt.Verdict.OK:
            return None
        step, pieces = self.layout.layer_bytes, []
        for (first, end), part in zip(self.runs, parts[1:], strict=True):
            view = memoryview(part)
            if view.nbytes != (end - first) * step:
                return None
            for j, layer in enumerate(range(first, end)):
                piece = view[j * step : (j + 1) * step]
                if not fmt.check_layer(header, layer, piece):
                    return None
                pieces.append((layer, piece))
        return pieces

    def from_payload(self, payload: memoryview) -> Pieces:
        """Return the planned layers of a whole, verified payload."""
        step = self.layout.layer_bytes
        return [(i, payload[i * step : (i + 1) * step]) for i in self.layers]


def write_layers(dst: Buffer, pieces: Pieces, num_layers: int) -> None:
    """Write each `(layer, bytes)` into its slice of the chunk buffer `dst`, nothing else."""
    if dst.flags.c_contiguous:
        flat = dst.reshape(-1)
        for layer, piece in pieces:
            step = piece.nbytes
            flat[layer * step : (layer + 1) * step] = np.frombuffer(piece, np.uint8)
    elif dst.ndim > 1 and dst.shape[0] == num_layers:  # layer-major view: dst[i] is layer i
        for layer, piece in pieces:
            np.copyto(dst[layer], np.frombuffer(piece, np.uint8).reshape(dst[layer].shape))
    else:  # any other strided view: edit a copy, write it back whole
        flat = np.ascontiguousarray(dst).reshape(-1)
        write_layers(flat, pieces, num_layers)
        np.copyto(dst, flat.reshape(dst.shape))
