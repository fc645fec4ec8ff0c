"""Planning and checking reads of some layers of a stored chunk (`LayerPlan`)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtiers.core.errors import InvalidInputError
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers._remote_layers import LayerPlan
from tests.conftest import small_layout

LAYOUT = small_layout(num_layers=4)
KEY = bytes(range(16))


def stored(payload: bytes) -> bytes:
    return fmt.pack_value(LAYOUT.fingerprint, KEY, payload, num_layers=LAYOUT.num_layers)


def header_len() -> int:
    return fmt.header_bytes(LAYOUT.fingerprint, LAYOUT.chunk_bytes, num_layers=LAYOUT.num_layers)


@pytest.mark.parametrize(
    ("layers", "ranges"),
    [
        ([0], [(0, "h+1")]),  # the header and layer 0: one range
        ([0, 1, 3], [(0, "h+2"), ("h+3", "h+4")]),
        ([1], [(0, "h"), ("h+1", "h+2")]),
        ([3, 1, 2], [(0, "h"), ("h+1", "h+4")]),
    ],
)
def test_a_run_from_layer_0_is_read_with_the_header(layers, ranges) -> None:
    h, step = header_len(), LAYOUT.layer_bytes

    def at(x: object) -> int:
        if x == 0:
            return 0
        base, _, n = str(x).partition("+")
        return h + int(n or 0) * step

    plan = LayerPlan.make(layers, LAYOUT, h)
    assert plan.ranges == tuple((at(a), at(b)) for a, b in ranges)


@pytest.mark.parametrize("layers", [[0], [0, 1], [1, 2], [0, 2, 3], [3]])
def test_ranges_read_from_a_value_verify_to_its_layers(layers) -> None:
    payload = np.random.default_rng(1).integers(0, 256, LAYOUT.chunk_bytes, np.uint8).tobytes()
    value, step = stored(payload), LAYOUT.layer_bytes
    plan = LayerPlan.make(layers, LAYOUT, header_len())
    parts = [value[a:b] for a, b in plan.ranges]
    pieces = plan.verify(parts, fingerprint=LAYOUT.fingerprint, key=KEY)
    assert pieces is not None
    assert [i for i, _ in pieces] == sorted(layers)
    for i, piece in pieces:
        assert bytes(piece) == payload[i * step : (i + 1) * step]
    # a flipped byte in any layer read, a short range, or another key fails the read
    for _, end in plan.ranges:
        if end <= plan.header_len:
            continue  # the header alone: its last bytes digest a layer not read here
        bad = bytearray(value)
        bad[end - 1] ^= 0xFF
        again = [bytes(bad[x:y]) for x, y in plan.ranges]
        assert plan.verify(again, fingerprint=LAYOUT.fingerprint, key=KEY) is None
    assert plan.verify(parts, fingerprint=LAYOUT.fingerprint, key=bytes(16)) is None
    assert plan.verify([p[:-1] for p in parts], fingerprint=LAYOUT.fingerprint, key=KEY) is None


def test_a_header_of_another_size_is_not_split_wrongly() -> None:
    payload = bytes(LAYOUT.chunk_bytes)
    six = fmt.pack_value(LAYOUT.fingerprint, KEY, payload)  # no per-layer checksums
    plan = LayerPlan.make([0], LAYOUT, header_len())
    parts = [six[a:b] for a, b in plan.ranges]
    assert plan.verify(parts, fingerprint=LAYOUT.fingerprint, key=KEY) is None


@pytest.mark.parametrize("layers", [[], [4], [-1], [1, 1], [True]])
def test_bad_layer_lists_are_refused(layers) -> None:
    with pytest.raises(InvalidInputError):
        LayerPlan.make(layers, LAYOUT, header_len())
