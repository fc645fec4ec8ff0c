"""The stored value format: packing into a reused buffer gives the same bytes."""

from __future__ import annotations

import numpy as np
import pytest

from kvtiers.testing.tiers import SMALL_LAYOUT
from kvtiers.tiers._chunk_format import Verdict, check_value, pack_value, pack_value_into
from kvtiers.tiers._chunk_header import parse_header

KEY = bytes(range(16))


@pytest.mark.parametrize("auth_key", [None, b"s" * 32])
def test_packing_into_a_reused_buffer_equals_a_fresh_value(auth_key: bytes | None) -> None:
    payloads = [np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8) for i in range(2)]
    fresh = [pack_value(SMALL_LAYOUT.fingerprint, KEY, p.data, auth_key=auth_key) for p in payloads]
    out = memoryview(bytearray(len(fresh[0]) + 64))  # larger than one value: only a prefix used
    for payload, want in zip(payloads, fresh, strict=True):
        got = pack_value_into(out, SMALL_LAYOUT.fingerprint, KEY, payload.data, auth_key=auth_key)
        assert bytes(got) == want
        verdict, body = check_value(
            got, fingerprint=SMALL_LAYOUT.fingerprint, key=KEY, payload_len=4096, auth_key=auth_key
        )
        assert verdict is Verdict.OK and body is not None and bytes(body) == payload.tobytes()


@pytest.mark.parametrize("stored_layers", [0, 2, 4])
@pytest.mark.parametrize("hint", [0, 2, 4])
def test_the_fast_header_check_agrees_with_a_full_parse(stored_layers: int, hint: int) -> None:
    """A header of six or seven fields parses alike by byte template (the reader's hint of
    per-layer checksums) or by msgpack decode (no hint matches); a bad key is foreign."""
    fp, payload = SMALL_LAYOUT.fingerprint, np.arange(4096, dtype=np.uint16).astype(np.uint8)
    value = pack_value(fp, KEY, payload.data, num_layers=stored_layers)
    view = memoryview(value)
    fast = parse_header(view, fingerprint=fp, key=KEY, payload_len=4096, num_layers=hint)
    slow = parse_header(view, fingerprint=fp, key=KEY, payload_len=4096, num_layers=3)
    assert fast == slow and fast[0] is Verdict.OK and fast[1] is not None
    assert (fast[1].layer_checksums is None) == (stored_layers == 0)
    other = parse_header(view, fingerprint=fp, key=bytes(16), payload_len=4096, num_layers=hint)
    assert other[0] is Verdict.FOREIGN
    flipped = bytearray(value)
    flipped[fast[1].payload_offset - 1] ^= 0xFF  # the last byte of the last checksum field
    verdict, _ = check_value(flipped, fingerprint=fp, key=KEY, payload_len=4096, num_layers=hint)
    # a whole read checks the payload's checksum; a per-layer one is for reads of layers
    assert verdict is (Verdict.OK if stored_layers else Verdict.CORRUPT)
