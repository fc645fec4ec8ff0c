"""Poisoned KV: with `integrity = "hmac-sha256"` a forged chunk is never loaded."""

from __future__ import annotations

from pathlib import Path

import fsspec
import lmdb
import numpy as np
import pytest
import xxhash

from kvtiers import TieredCache
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import KVLayout
from kvtiers.testing.tiers import TierTests
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers._chunk_format import Verdict
from kvtiers.tiers._integrity import auth_key_from_config
from kvtiers.tiers.lmdb import LMDBTier
from kvtiers.tiers.remote import RemoteTier
from tests.conftest import SMALL_LAYOUT, make_kv, same_bytes, small_layout
from tests.reliability._factories import (
    CHUNK,
    LAYOUT,
    SECRET,
    SECRET_ENV,
    dsts,
    integrity,
    keys,
    lmdb_config,
    memory_url,
    payloads,
    remote_config,
)
from tests.tiers.conftest import MotoS3

pytestmark = pytest.mark.reliability

FP = LAYOUT.fingerprint
KEY = SECRET.encode()
OTHER_KEY = b"another-secret-of-32-bytes-xxxxx"


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)


# -- the stored format ---------------------------------------------------------------


def _check(raw: bytes, key: bytes, auth_key: bytes | None = KEY) -> Verdict:
    return fmt.check_value(raw, fingerprint=FP, key=key, payload_len=CHUNK, auth_key=auth_key)[0]


@pytest.mark.parametrize("num_layers", [0, LAYOUT.num_layers])
def test_tagged_value_verifies_only_under_its_secret(num_layers: int) -> None:
    (k,), (src,) = keys(1), payloads(1)
    value = fmt.pack_value(FP, k, src.data, num_layers=num_layers, auth_key=KEY)
    assert len(value) == fmt.value_bytes(FP, CHUNK, num_layers=num_layers, tagged=True)
    verdict, payload = fmt.check_value(
        value, fingerprint=FP, key=k, payload_len=CHUNK, auth_key=KEY
    )
    assert verdict is Verdict.OK and bytes(payload or b"") == src.tobytes()
    assert _check(value, k, OTHER_KEY) is Verdict.FORGED
    assert _check(value, k, None) is Verdict.OK  # a reader without a secret ignores the tag


def test_untagged_and_recomputed_checksum_forgeries_are_forged() -> None:
    (k,), (src, evil) = keys(1), payloads(2)
    assert _check(fmt.pack_value(FP, k, src.data), k) is Verdict.FORGED  # no tag at all
    # a writer without the secret re-tags a forged payload with its own key
    assert _check(fmt.pack_value(FP, k, evil.data, auth_key=OTHER_KEY), k) is Verdict.FORGED
    # a valid value with its payload swapped and the xxh3 checksum recomputed
    good = fmt.pack_value(FP, k, src.data, auth_key=KEY)
    header = fmt.check_value(good, fingerprint=FP, key=k, payload_len=CHUNK)
    assert header[0] is Verdict.OK
    head_len = len(good) - CHUNK
    parsed = fmt._parse(memoryview(good), fingerprint=FP, key=k, payload_len=CHUNK)[1]
    assert parsed is not None and parsed.tag is not None
    swapped = fmt._header(FP, k, CHUNK, xxhash.xxh3_64_digest(evil), None, parsed.tag)
    assert len(swapped) == head_len
    assert _check(swapped + evil.tobytes(), k) is Verdict.FORGED


def test_tag_binds_the_key() -> None:
    (k1, k2), (src,) = keys(2), payloads(1)
    good = fmt.pack_value(FP, k1, src.data, auth_key=KEY)
    parsed = fmt._parse(memoryview(good), fingerprint=FP, key=k1, payload_len=CHUNK)[1]
    assert parsed is not None and parsed.tag is not None
    moved = fmt._header(FP, k2, CHUNK, parsed.checksum, None, parsed.tag) + src.tobytes()
    assert _check(moved, k2) is Verdict.FORGED
    assert _check(good, k2) is Verdict.FOREIGN


def test_untagged_formats_still_read_without_a_secret() -> None:
    (k,), (src,) = keys(1), payloads(1)
    for num_layers in (0, LAYOUT.num_layers):
        value = fmt.pack_value(FP, k, src.data, num_layers=num_layers)
        assert _check(value, k, None) is Verdict.OK


# -- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"integrity": "sha1"}, "integrity"),
        ({"integrity": 1}, "integrity"),
        ({"integrity": "hmac-sha256"}, "integrity_key_env"),
        (
            {"integrity": "hmac-sha256", "integrity_key_env": "KVTIERS_UNSET_VAR"},
            "integrity_key_env",
        ),
        ({"integrity": "hmac-sha256", "integrity_key_env": "KVTIERS_SHORT"}, "integrity_key_env"),
        ({"integrity_key_env": SECRET_ENV}, "integrity_key_env"),
    ],
)
@pytest.mark.parametrize("kind", ["lmdb", "remote"])
def test_bad_integrity_config_is_a_config_error_at_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict, field: str, kind: str
) -> None:
    monkeypatch.delenv("KVTIERS_UNSET_VAR", raising=False)
    monkeypatch.setenv("KVTIERS_SHORT", "short")
    tier = {"kind": kind, "capacity": "1MiB", **options}
    tier.update({"path": str(tmp_path / "db")} if kind == "lmdb" else {"url": memory_url()})
    cfg = {"layout": SMALL_LAYOUT, "tiers": [{"kind": "dram", "capacity": "64KiB"}, tier]}
    with pytest.raises(ConfigError, match=rf"^tiers\[1\]\.{field}:"):
        TieredCache.from_config(cfg)


def test_integrity_off_by_default() -> None:
    assert auth_key_from_config(TierConfig("remote", 1, options={})) is None


# -- the lmdb tier -----------------------------------------------------------------------


def _plant_lmdb(path: Path, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    try:
        with env.begin(write=True, db=env.open_db(b"chunks")) as txn:
            txn.put(key, value)
    finally:
        env.close()


@pytest.mark.parametrize("forger_key", [None, OTHER_KEY])
async def test_forged_lmdb_entry_is_never_loaded(tmp_path: Path, forger_key: bytes | None) -> None:
    path, ks, srcs = tmp_path / "db", keys(3), payloads(4)
    async with LMDBTier(lmdb_config(path, **integrity()), LAYOUT) as tier:
        assert await tier.put(ks, srcs[:3]) == [True] * 3
    # a writer with access to the environment replaces chunk 1 (same size: in place)
    forged = fmt.pack_value(FP, ks[1], srcs[3].data, auth_key=forger_key or OTHER_KEY)
    if forger_key is None:  # untagged: xxh3 checksum valid, no tag
        forged = fmt.pack_value(FP, ks[1], srcs[3].data)
    _plant_lmdb(path, ks[1], forged)
    async with LMDBTier(lmdb_config(path, **integrity()), LAYOUT) as tier:
        out = dsts(3)
        assert await tier.get(ks, out) == [True, False, True]
        assert (out[1] == 7).all()
        assert np.array_equal(out[0], srcs[0]) and np.array_equal(out[2], srcs[2])
        assert (tier.counters.forged, tier.counters.corrupt) == (1, 1)
        assert await tier.contains(ks) == [True, False, True]  # deleted


# -- the remote tier -----------------------------------------------------------------


def _object(tier: RemoteTier, key: bytes) -> str:
    return f"{tier._store.protocol}://{tier.namespace}/{key[:2].hex()}/{key.hex()}"


async def _forged_remote_is_never_loaded(config: TierConfig, storage_options: dict) -> None:
    ks, srcs = keys(3), payloads(4)
    async with RemoteTier(config, LAYOUT) as tier:
        assert await tier.put(ks, srcs[:3]) == [True] * 3
        path = _object(tier, ks[1])
        fs, _ = fsspec.url_to_fs(path, **storage_options)
        # a writer without the secret overwrites one object with valid checksums
        forged = fmt.pack_value(FP, ks[1], srcs[3].data, num_layers=LAYOUT.num_layers)
        fs.pipe_file(fs._strip_protocol(path), forged)
        out = dsts(3)
        assert await tier.get(ks, out) == [True, False, True]
        assert (out[1] == 7).all()
        assert np.array_equal(out[0], srcs[0]) and np.array_equal(out[2], srcs[2])
        assert (tier.counters.forged, tier.counters.corrupt) == (1, 1)
        # and a layer-wise read verifies the tag too
        fs.pipe_file(fs._strip_protocol(path), forged)
        out = dsts(3)
        assert await tier.get_layers(ks, [1], out) == [True, False, True]
        assert (out[1] == 7).all()
        step = LAYOUT.layer_bytes
        assert np.array_equal(out[0][step:], srcs[0][step:])
        assert tier.counters.forged == 2


async def test_forged_object_in_memory_remote_is_never_loaded() -> None:
    await _forged_remote_is_never_loaded(remote_config(memory_url(), **integrity()), {})


async def test_forged_object_in_file_remote_is_never_loaded(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/pool"
    await _forged_remote_is_never_loaded(remote_config(url, **integrity()), {})


async def test_forged_object_in_s3_remote_is_never_loaded(moto_s3: MotoS3) -> None:
    options = moto_s3.storage_options()
    config = remote_config(moto_s3.url("forged"), **integrity(storage_options=options))
    plain = {k: v for k, v in options.items() if k != "session"}
    await _forged_remote_is_never_loaded(config, plain)


async def test_cache_never_loads_kv_planted_by_a_writer_without_the_secret(tmp_path: Path) -> None:
    layout = small_layout()
    url = f"file://{tmp_path}/pool"
    remote = {"kind": "remote", "capacity": "4MiB", "url": url}
    tiers = [{"kind": "dram", "capacity": 16 * layout.chunk_bytes}]
    attacker = {"layout": SMALL_LAYOUT, "tiers": [*tiers, remote]}
    victim = {"layout": SMALL_LAYOUT, "tiers": [*tiers, {**remote, **integrity()}]}
    tokens = list(range(64))
    evil, good = make_kv(layout, 64, seed=666), make_kv(layout, 64, seed=1)
    async with TieredCache.from_config(attacker) as cache:
        await cache.store(tokens, evil)
    async with TieredCache.from_config(victim) as cache:
        assert (await cache.load(tokens)).shape[2] == 0
        stats = cache.stats()
        assert stats.tiers[1].forged >= 1 and stats.tiers[1].hits == 0
        assert await cache.store(tokens, good) == 64
        await cache.flush()
    async with TieredCache.from_config(victim) as cache:
        assert await cache.lookup(tokens) == 64
        assert same_bytes(await cache.load(tokens), good)


# -- the conformance suite, with integrity on ------------------------------------------------


class TestLMDBTierWithIntegrity(TierTests):
    tier_cls = LMDBTier
    atomic_batches = True

    def entry_bytes(self) -> int:
        return fmt.value_bytes(self.layout.fingerprint, self.layout.chunk_bytes, tagged=True)

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> LMDBTier:
        options = {"path": str(tmp_path / "lmdb"), **integrity()}
        return LMDBTier(TierConfig("lmdb", capacity_bytes, options=options), layout)


class TestRemoteTierWithIntegrity(TierTests):
    tier_cls = RemoteTier

    def entry_bytes(self) -> int:
        layout = self.layout
        return fmt.value_bytes(
            layout.fingerprint, layout.chunk_bytes, num_layers=layout.num_layers, tagged=True
        )

    async def make_tier(self, tmp_path: Path, layout: KVLayout, capacity_bytes: int) -> RemoteTier:
        options = {"url": f"file://{tmp_path}/pool", **integrity()}
        return RemoteTier(TierConfig("remote", capacity_bytes, options=options), layout)
