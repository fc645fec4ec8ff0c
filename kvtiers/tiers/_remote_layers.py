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

from kvtiers.core.layout import KVLayout
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers._layers import Pieces, check_layers, layer_pieces, write_layers

__all__ = ["LayerPlan", "Pieces", "write_layers"]


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """The byte ranges holding the header and some layers of any chunk of one layout."""

    layout: KVLayout
    layers: tuple[int, ...]
    """The layers read, ascending."""
    runs: tuple[tuple[int, int], ...]
    """`[first, end)` runs of consecutive layers."""
    ranges: tuple[tuple[int, int], ...]
    """`[start, end)` byte ranges: the header, then one per run; a run from layer 0 is
    read with the header, in its range."""
    header_len: int
    """The header's planned size, length prefix included."""

    @classmethod
    def make(cls, layers: Sequence[int], layout: KVLayout, header_len: int) -> LayerPlan:
        """Plan the reads of `layers` of chunks whose header takes `header_len` bytes.

        Raises:
            InvalidInputError: `layers` is empty, or holds repeated or out-of-range indices.
        """
        wanted = check_layers(layers, layout.num_layers)
        runs: list[tuple[int, int]] = []
        for layer in wanted:
            if runs and runs[-1][1] == layer:
                runs[-1] = (runs[-1][0], layer + 1)
            else:
                runs.append((layer, layer + 1))
        step = layout.layer_bytes
        ranges = [(header_len + a * step, header_len + b * step) for a, b in runs]
        if runs[0][0] == 0:  # the header and layer 0 on are one range: one request less
            ranges[0] = (0, ranges[0][1])
        else:
            ranges.insert(0, (0, header_len))
        return cls(layout, wanted, tuple(runs), tuple(ranges), header_len)

    def verify(self, parts: Sequence[Any], *, fingerprint: bytes, key: bytes) -> Pieces | None:
        """Return each layer read, verified; `None` if any range or check fails.

        Args:
            parts: what was read for `ranges`: bytes, or the exception a range raised.
            fingerprint: the layout fingerprint the reader expects.
            key: the key the object was read under.
        """
        got = self.verify_all(parts, fingerprint=fingerprint, key=key)
        return None if got is None else got[1]

    def verify_all(
        self, parts: Sequence[Any], *, fingerprint: bytes, key: bytes
    ) -> tuple[fmt.Header, Pieces] | None:
        """`verify`, also returning the checked header (for `run_ranges` reads later)."""
        if len(parts) != len(self.ranges) or any(not isinstance(p, bytes) for p in parts):
            return None
        if self.runs[0][0] == 0:  # split the header from the layers read with it
            joined = memoryview(parts[0])
            parts = [joined[: self.header_len], joined[self.header_len :], *parts[1:]]
        verdict, header = fmt.check_header(
            parts[0],
            fingerprint=fingerprint,
            key=key,
            payload_len=self.layout.chunk_bytes,
            num_layers=self.layout.num_layers,
        )
        if header is None or verdict is not fmt.Verdict.OK:
            return None
        pieces = self.verify_runs(header, parts[1:])
        return None if pieces is None else (header, pieces)

    def run_ranges(self, header: fmt.Header) -> list[tuple[int, int]]:
        """Return the byte ranges of the runs alone, for an object whose header is known."""
        off, step = header.payload_offset, self.layout.layer_bytes
        return [(off + a * step, off + b * step) for a, b in self.runs]

    def verify_runs(self, header: fmt.Header, parts: Sequence[Any]) -> Pieces | None:
        """Check the runs read (one part per run) against `header`'s per-layer checksums."""
        if len(parts) != len(self.runs):
            return None
        step, pieces = self.layout.layer_bytes, []
        for (first, end), part in zip(self.runs, parts, strict=True):
            if not isinstance(part, bytes | memoryview):
                return None
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
        return layer_pieces(payload, self.layers, self.layout.layer_bytes)
