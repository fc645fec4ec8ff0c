"""Hints ahead of local object reads: which paths, when, and that misses stay misses."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvtiers.core.config import TierConfig
from kvtiers.core.layout import KVLayout
from kvtiers.tiers import _readahead, _remote_fetch
from kvtiers.tiers._readahead import HINT_AHEAD, ahead_of, will_need
from kvtiers.tiers.remote import RemoteTier

# 4 layers x 2 x 64 tokens x 8 heads x 128 x 2 bytes = 1 MiB a chunk: hinted.
BIG = KVLayout(model="hint", num_layers=4, num_kv_heads=8, head_size=128, chunk_size=64)


def test_each_path_is_hinted_once_ahead_of_its_read() -> None:
    paths = [f"p{i}" for i in range(10)]
    hinted = [p for i in range(len(paths)) for p in ahead_of(paths, i)]
    assert hinted == paths[1:]  # every path but the first (read at once), once each
    assert list(ahead_of(paths, 0)) == paths[1 : 1 + HINT_AHEAD]
    assert list(ahead_of(paths, 2)) == [paths[2 + HINT_AHEAD]]
    assert list(ahead_of(paths[:1], 0)) == []


def test_will_need_skips_what_it_cannot_open(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.write_bytes(b"x" * 4096)
    will_need([str(tmp_path / "missing"), str(real), str(tmp_path)])  # no exception
    assert real.read_bytes() == b"x" * 4096


@pytest.mark.parametrize("in_flight", [1, HINT_AHEAD])
async def test_big_local_objects_hint_the_next_ones_and_read_back_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_flight: int
) -> None:
    hinted: list[str] = []

    def record(paths: list[str]) -> None:
        hinted.extend(paths)
        _readahead.will_need(paths)

    monkeypatch.setattr(_remote_fetch, "will_need", record)
    rng = np.random.default_rng(0)
    keys = [rng.bytes(16) for _ in range(8)]
    srcs = [rng.integers(0, 256, BIG.chunk_bytes, dtype=np.uint8) for _ in keys]
    options = {"url": f"file://{tmp_path}/pool", "max_in_flight": in_flight}
    config = TierConfig("remote", 64 * 2**20, options=options)
    async with RemoteTier(config, BIG) as tier:
        assert await tier.put(keys, srcs) == [True] * 8
        dsts = [np.zeros(BIG.chunk_bytes, dtype=np.uint8) for _ in keys]
        missing = rng.bytes(16)
        assert await tier.get([*keys, missing], [*dsts, dsts[0].copy()]) == [True] * 8 + [False]
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    if in_flight >= HINT_AHEAD:  # the reads in flight keep the disk busy already
        assert hinted == []
        return
    assert len(hinted) == 8  # every object after the first, the missing one included
    assert all(os.path.isfile(p) for p in hinted[:7])  # real local paths
