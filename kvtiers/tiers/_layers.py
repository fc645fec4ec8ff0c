"""Some layers of a chunk: which may be asked for, and where they go in a chunk buffer.

A chunk's payload is layer-major, so layer `i` is one contiguous slice of it; a buffer of a
caller's memory may be any view of the payload's bytes (`Buffer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtiers.core.checks import is_int
from kvtiers.core.errors import InvalidInputError

if TYPE_CHECKING:
    from kvtiers.tiers.base import Buffer

__all__ = ["Pieces", "check_layers", "layer_pieces", "write_layers"]

Pieces = list[tuple[int, memoryview]]
"""`(layer index, that layer's bytes)` pairs."""


def check_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Return `layers` ascending, after checking them.

    Raises:
        InvalidInputError: `layers` is empty, or holds repeated or out-of-range indices.
    """
    if any(not is_int(i) or not 0 <= i < num_layers for i in layers):
        raise InvalidInputError(f"layers: expected indices in [0, {num_layers}), got {layers!r}")
    wanted = sorted(layers)
    if not wanted or len(set(wanted)) != len(wanted):
        raise InvalidInputError(f"layers: expected distinct layer indices, got {layers!r}")
    return tuple(wanted)


def layer_pieces(payload: memoryview, layers: Sequence[int], layer_bytes: int) -> Pieces:
    """Return `(layer, bytes)` of `layers` of a whole payload (flat bytes, layer-major)."""
    return [(i, payload[i * layer_bytes : (i + 1) * layer_bytes]) for i in layers]


def write_layers(dst: Buffer, pieces: Pieces, num_layers: int) -> None:
    """Write each `(layer, bytes)` into its slice of the chunk buffer `dst`, nothing else.

    Not safe for two callers writing one buffer at once when it is strided and not
    indexed by layer: such a buffer is copied, edited and written back whole.
    """
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
