"""The stored value format: packing into a reused buffer gives the same bytes."""

from __future__ import annotations

import numpy as np
import pytest

from kvtiers.testing.tiers import SMALL_LAYOUT
from kvtiers.tiers._chunk_format import Verdict, check_value, pack_value, pack_value_into

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
