"""Listings of a remote pool that cannot read part of it fail, and say where.

fsspec's local `find` skips a folder it may not read (its `walk` swallows the
`PermissionError`), so a scan undercounted the pool and the tier's capacity eviction and
TTL expiry missed the objects in it. A listing must fail instead; the tier then counts the
failed scan, logs it once, and keeps its catalog as it was.

Where file modes stop this user (not root), a folder is made unlistable by its mode. As
root, whom modes do not stop, it is simulated at the fsspec boundary: the local
filesystem's `ls` of that folder raises the `PermissionError` `os.scandir` raises. The
commands as another user, on real modes: `tests/test_cli_remote_listing.py`.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from kvtiers.core.errors import TierIOError
from kvtiers.tiers._remote_access import scan
from kvtiers.tiers._remote_admin import list_pool, open_store, purge_namespace
from kvtiers.tiers._remote_breaker import StoreUnavailable
from tests.tiers.conftest import MotoS3
from tests.tiers.test_remote import LAYOUT, keys, make_config, make_tier, payloads

ROOT = os.geteuid() == 0

Deny = Callable[[Path], None]


@pytest.fixture
def deny(monkeypatch: pytest.MonkeyPatch) -> Iterator[Deny]:
    """Yield a function that makes a folder unlistable until the test ends."""
    denied: list[Path] = []
    listed = LocalFileSystem.ls

    def ls(fs: LocalFileSystem, path: str, detail: bool = False, **kwargs: Any) -> Any:
        folder = fs._strip_protocol(path)
        if any(folder == str(d) for d in denied):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), folder)
        return listed(fs, path, detail=detail, **kwargs)

    if ROOT:
        monkeypatch.setattr(LocalFileSystem, "ls", ls)
    yield lambda folder: (denied.append(folder), None if ROOT else folder.chmod(0))[1]
    for folder in denied:
        folder.chmod(0o755)


def allow(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo `deny` for every folder (the test goes on with a readable pool)."""
    monkeypatch.undo()
    folder.chmod(0o755)


async def stored_pool(tmp_path: Path, num: int = 4) -> tuple[str, str]:
    """Return the URL and namespace of a `file://` pool holding `num` chunks."""
    url = f"file://{tmp_path}/pool"
    async with make_tier(url) as tier:
        assert await tier.put(keys(num), payloads(num)) == [True] * num
        return url, tier.namespace


def prefix_folder(namespace: str, key: bytes) -> Path:
    return Path(namespace) / key[:2].hex()


async def test_a_scan_that_cannot_list_a_folder_raises_naming_it(
    tmp_path: Path, deny: Deny
) -> None:
    """Before, the scan returned the other three objects."""
    url, namespace = await stored_pool(tmp_path)
    folder = prefix_folder(namespace, keys(4)[0])
    deny(folder)
    async with open_store(make_config(url)) as store:
        with pytest.raises(StoreUnavailable) as caught:
            await scan(store, namespace)
    assert f"PermissionError: [Errno 13] Permission denied: '{folder}'" in str(caught.value)


@pytest.mark.parametrize("where", ["root", "namespace", "prefix"])
async def test_pool_listings_that_cannot_list_a_folder_raise(
    tmp_path: Path, deny: Deny, where: str
) -> None:
    """`remote ls`, `inspect` and `purge` list through these. Before, `list_pool` left out
    what it could not list (a pool whose namespace it could not list was "empty"), and a
    dry-run purge counted the objects it saw."""
    url, namespace = await stored_pool(tmp_path)
    folder = {
        "root": tmp_path / "pool",
        "namespace": Path(namespace),
        "prefix": prefix_folder(namespace, keys(4)[1]),
    }[where]
    deny(folder)
    config = make_config(url)
    with pytest.raises(TierIOError, match="cannot list the pool") as listed:
        await list_pool(config, LAYOUT)
    assert f"Permission denied: '{folder}'" in str(listed.value)
    if where == "root":  # a purge lists the namespace only
        return
    with pytest.raises(TierIOError, match="failed") as purged:
        await purge_namespace(config, LAYOUT.fingerprint.hex(), older_than=None, dry_run=True)
    assert f"Permission denied: '{folder}'" in str(purged.value)


async def test_a_folder_deleted_during_a_listing_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulated timing: a purge emptied and removed a prefix folder between its parent's
    listing and its own. That is no failure: its objects are gone."""
    url, namespace = await stored_pool(tmp_path)
    gone = str(prefix_folder(namespace, keys(4)[2]))
    listed = LocalFileSystem.ls

    def ls(fs: LocalFileSystem, path: str, detail: bool = False, **kwargs: Any) -> Any:
        if fs._strip_protocol(path) == gone:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), gone)
        return listed(fs, path, detail=detail, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "ls", ls)
    async with open_store(make_config(url)) as store:
        listing = await scan(store, namespace)
        assert await store.find(f"{namespace}/nothing-here") == {}
    lost = {k for k in keys(4) if str(prefix_folder(namespace, k)) == gone}
    assert set(listing.objects) == set(keys(4)) - lost


async def test_a_tier_scan_that_cannot_list_a_folder_is_counted_and_changes_nothing(
    tmp_path: Path,
    deny: Deny,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, the scan shrank the catalog to the objects it saw (usage undercounted, so
    capacity eviction missed the rest) and TTL expiry never reached the hidden ones; no
    error was counted or logged. Now each failed scan counts an error, the first one of a
    run logs a warning naming the folder, and the catalog stays until a scan succeeds."""
    url = f"file://{tmp_path}/pool"
    caplog.set_level(logging.DEBUG, logger="kvtiers")
    async with make_tier(url, ttl=100) as tier:
        start = time.time()
        tier.clock = lambda: start
        await tier.put(keys(4), payloads(4))
        before, errors = tier.usage(), tier.counters.errors
        folder = prefix_folder(tier.namespace, keys(4)[0])
        deny(folder)
        tier.clock = lambda: start + 150  # every object is past its TTL
        caplog.clear()
        await tier.scan_now()
        await tier.scan_now()
        assert tier.usage() == before
        assert tier.counters.errors == errors + 2
        assert tier.take_evicted() == []
        assert len([p for p in Path(tier.namespace).rglob("*") if len(p.name) == 32]) == 4
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1, warned
        assert "scan failed" in warned[0] and f"Permission denied: '{folder}'" in warned[0]

        allow(folder, monkeypatch)
        caplog.clear()
        await tier.scan_now()  # all four expire now, the hidden one too
        assert tier.usage().num_entries == 0
        assert sorted(tier.take_evicted()) == sorted(keys(4))
        assert any("scans succeed again" in r.getMessage() for r in caplog.records)


async def test_s3_listings_are_unchanged(moto_s3: MotoS3) -> None:
    """On S3 a listing is one flat request (s3fs), with no folders to skip."""
    url = moto_s3.url()
    options = {"storage_options": moto_s3.storage_options()}
    async with make_tier(url, **options) as tier:
        await tier.put(keys(4), payloads(4))
        namespace = tier.namespace
    async with open_store(make_config(url, **options)) as store:
        listing = await scan(store, namespace)
    assert set(listing.objects) == set(keys(4))
    [pool] = [ns for ns in await list_pool(make_config(url, **options), LAYOUT) if ns.current]
    assert set(pool.listing.objects) == set(keys(4))
