"""Full disk, full map: writes are declined or evict, reads go on, nothing stored is lost.

The LMDB tier runs on a map smaller than the workload (its capacity says more would fit);
the remote tier on a store that refuses writes with ENOSPC past a quota (`_faulty_fs`).
The error is counted, and logged once, not once per chunk.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtiers.core.errors import TierIOError
from kvtiers.tiers import _lmdb_format
from kvtiers.tiers.lmdb import LMDBTier
from kvtiers.tiers.remote import RemoteTier
from tests._mounts import tmpfs
from tests.reliability import _faulty_fs as faulty
from tests.reliability._factories import (
    LAYOUT,
    dsts,
    keys,
    lmdb_config,
    payloads,
    remote_config,
    remote_value_bytes,
)

pytestmark = pytest.mark.reliability


@pytest.fixture(autouse=True)
def _faulty_store() -> Any:
    faulty.register()
    faulty.ACTIVE = faulty.Faults()
    yield
    faulty.ACTIVE = faulty.Faults()


def _full_messages(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if word in r.getMessage().lower()]


async def _check_all_held(tier: LMDBTier | RemoteTier, held: dict[bytes, np.ndarray]) -> None:
    ks = list(held)
    out = dsts(len(ks))
    assert await tier.get(ks, out) == [True] * len(ks)
    for k, buf in zip(ks, out, strict=True):
        assert np.array_equal(buf, held[k])


async def test_lmdb_on_a_map_smaller_than_the_workload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "kvtiers")
    # the capacity would take 4096 chunks; a 1 MiB map holds a few hundred
    config = lmdb_config(tmp_path / "db", 4096, map_size="1MiB")
    ks, srcs = keys(1200), payloads(1200)
    held: dict[bytes, np.ndarray] = {}
    async with LMDBTier(config, LAYOUT) as tier:
        for lo in range(0, len(ks), 8):
            batch, data = ks[lo : lo + 8], srcs[lo : lo + 8]
            stored = await tier.put(batch, data)
            held.update((k, s) for k, s, ok in zip(batch, data, stored, strict=True) if ok)
            # what the tier says it holds is there, bit-identical: evictions took the rest
            present = await tier.contains(list(held))
            held = {k: v for (k, v), ok in zip(held.items(), present, strict=True) if ok}
            await _check_all_held(tier, dict(list(held.items())[-32:]))
        counters = tier.counters
        await _check_all_held(tier, held)
        print(
            f"lmdb full map: puts {counters.puts}, declined {counters.declined}, "
            f"evictions {counters.evictions}, held {len(held)}"
        )
        assert counters.evictions > 0 and len(held) >= 64
        assert counters.corrupt == 0 and counters.errors == 0
        # the last batch went in: a full map evicts, it does not stop the tier
        assert await tier.contains(ks[-8:]) == [True] * 8
    assert not _full_messages(caplog, "map")  # evicted by the map's size: never full


async def test_lmdb_map_that_fills_up_anyway_is_logged_once_and_keeps_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as if a process with a larger map shared the environment: the limit misjudges the map
    monkeypatch.setattr(_lmdb_format, "map_capacity", lambda size, value_len: 2**40)
    caplog.set_level(logging.INFO, "kvtiers")
    config = lmdb_config(tmp_path / "db", 4096, map_size="1MiB")
    ks, srcs = keys(800), payloads(800)
    held: dict[bytes, np.ndarray] = {}
    async with LMDBTier(config, LAYOUT) as tier:
        for lo in range(0, len(ks), 8):
            batch, data = ks[lo : lo + 8], srcs[lo : lo + 8]
            stored = await tier.put(batch, data)  # never raises
            held.update((k, s) for k, s, ok in zip(batch, data, stored, strict=True) if ok)
            present = await tier.contains(list(held))
            held = {k: v for (k, v), ok in zip(held.items(), present, strict=True) if ok}
        await _check_all_held(tier, held)
        assert len(held) >= 32 and tier.counters.evictions > 0
        assert await tier.contains(ks[-8:]) == [True] * 8
    full = _full_messages(caplog, "map")
    assert len(full) == 1, full


async def test_remote_on_a_store_that_runs_out_of_space(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvtiers")
    url = f"faulty://full/{uuid.uuid4().hex[:8]}"
    value = remote_value_bytes()
    faulty.ACTIVE = faulty.Faults(quota_bytes=faulty.FaultyFileSystem().used_bytes() + 40 * value)
    ks, srcs = keys(120), payloads(120)
    held: dict[bytes, np.ndarray] = {}
    async with RemoteTier(remote_config(url, 1000, timeout=1.0, retries=2), LAYOUT) as tier:
        for lo in range(0, len(ks), 8):
            batch, data = ks[lo : lo + 8], srcs[lo : lo + 8]
            stored = await tier.put(batch, data)
            held.update((k, s) for k, s, ok in zip(batch, data, stored, strict=True) if ok)
            await _check_all_held(tier, held)  # reads keep serving while writes fail
        counters, io = tier.counters, tier.io_counters
        print(
            f"remote full store: stored {counters.puts}, declined {counters.declined}, "
            f"errors {counters.errors}, enospc injected {faulty.ACTIVE.injected['enospc']}, "
            f"io {io}"
        )
        assert 30 <= len(held) <= 40 and counters.declined >= 80
        assert io.refused == 0  # the breaker never opened: a full store is reachable
        assert tier.stats().hits == counters.hits > 0
        # space comes back: writes resume
        faulty.ACTIVE.quota_bytes = None
        assert await tier.put(ks[-4:], srcs[-4:]) == [True] * 4
        await _check_all_held(tier, {**held, **dict(zip(ks[-4:], srcs[-4:], strict=True))})
    full = _full_messages(caplog, "space")
    assert len(full) == 1, full


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """Yield a folder on a 2 MiB tmpfs; skip where mounting is not allowed (not root)."""
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        yield mnt


@pytest.mark.parametrize("kind", ["lmdb", "remote"])
async def test_a_disk_that_runs_out_of_space(
    small_disk: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    caplog.set_level(logging.INFO, "kvtiers")
    if kind == "lmdb":  # capacity and map far beyond the 2 MiB disk
        tier: LMDBTier | RemoteTier = LMDBTier(lmdb_config(small_disk / "db", 4000), LAYOUT)
    else:
        tier = RemoteTier(remote_config(f"file://{small_disk}/pool", 4000), LAYOUT)
    ks, srcs = keys(1500), payloads(1500)
    held: dict[bytes, np.ndarray] = {}
    async with tier:
        for lo in range(0, len(ks), 8):
            batch, data = ks[lo : lo + 8], srcs[lo : lo + 8]
            stored = await tier.put(batch, data)  # never raises
            held.update((k, s) for k, s, ok in zip(batch, data, stored, strict=True) if ok)
            if lo % 160 == 0:
                await _check_all_held(tier, held)  # reads keep serving
        await _check_all_held(tier, held)
        counters = tier.counters
        print(
            f"{kind} on a full disk: stored {counters.puts}, declined {counters.declined}, "
            f"failed batches or writes {counters.errors}"
        )
        assert 300 <= len(held) < 1000 and counters.declined > 500
    warnings = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "access" not in r.getMessage()
    ]
    failing = [r.getMessage() for r in warnings if "close" not in r.getMessage()]
    assert len(failing) == 1, failing


async def test_writemap_on_a_disk_too_small_for_its_map_refuses_to_open(small_disk: Path) -> None:
    # The map's file is allocated whole at open, so a full disk is an error here, never a
    # SIGBUS on a later write into the map.
    tier = LMDBTier(lmdb_config(small_disk / "db", 4000, writemap=True), LAYOUT)
    with pytest.raises(TierIOError, match="cannot open lmdb"):
        await tier.open()
    assert (small_disk / "db" / "data.mdb").stat().st_blocks == 0  # the disk is free again
    async with LMDBTier(lmdb_config(small_disk / "db", 40), LAYOUT) as plain:
        assert await plain.put(keys(8), payloads(8)) == [True] * 8  # and the path usable
