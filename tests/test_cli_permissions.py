"""Files, folders and objects the user may not open: `inspect`, `purge`, `remote`.

The commands run as real processes under a user the file modes stop: `nobody` when the
suite runs as root (whom modes do not stop), else this user with modes that deny the owner
too. Each must exit with status 1 (the store cannot be read or changed) and one line on
stderr naming the path and the cause, and change nothing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_cli_live import (
    HANG_GUARD_S,
    KVTIERS,
    digest,
    fill,
    fingerprint,
    lmdb_config,
    write_toml,
)
from tests.test_cli_store_errors import stored

pytest.importorskip("lmdb")

NOBODY = 65534
ROOT = os.geteuid() == 0
"""As root the commands run as `nobody`, whom a mode of the caches' user alone stops; as
another user they run as that user, and the modes stop the owner too."""

# Real processes that import torch: two commands each.
READS = [["inspect", "--verify"], ["purge", "--fingerprint", "{fp}"]]


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """Yield a folder that another user may enter, under the system's temporary folder."""
    root = Path(tempfile.mkdtemp(prefix="kvtiers-perm-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        for sub in [root, *root.rglob("*")]:  # give back what a test took away
            if not sub.is_symlink():
                sub.chmod(0o700 if sub.is_dir() else 0o600)
        shutil.rmtree(root)


def run_restricted(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run the real `kvtiers` as a user file modes apply to: `nobody` when we are root."""
    as_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return subprocess.run(
        [*(as_user if ROOT else []), KVTIERS, *argv],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


@pytest.fixture(scope="module")
def restricted() -> Any:
    """Return `run_restricted`; skip where that user cannot run kvtiers at all."""
    try:
        probe = run_restricted("--version")
    except OSError as exc:  # no setpriv
        pytest.skip(f"cannot run kvtiers as another user here: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"cannot run kvtiers as another user here: {probe.stderr.strip()[-200:]}")
    return run_restricted


def one_line(done: subprocess.CompletedProcess[str], status: int) -> str:
    assert done.returncode == status, done
    [line] = done.stderr.splitlines()
    assert line.startswith("kvtiers "), line
    return line


def opened_to_others(path: Path, *, lock_mode: int, dir_mode: int = 0o755) -> None:
    (path / "data.mdb").chmod(0o644)
    (path / "lock.mdb").chmod(lock_mode)
    path.chmod(dir_mode)  # last: a mode without x stops the owner from changing the files


@pytest.mark.parametrize("argv", READS)
def test_a_lock_file_the_user_may_not_open_exits_1_naming_it(shared_dir, restricted, argv):
    """Real: lock.mdb is the caches' user's, mode 0600; another user runs the command."""
    path = stored(shared_dir)
    opened_to_others(path, lock_mode=0o600 if ROOT else 0)
    before = digest(path / "data.mdb")
    command, *flags = (arg.format(fp=fingerprint()[:8]) for arg in argv)
    line = one_line(restricted(command, str(path), *flags), 1)
    assert (
        f"TierIOError: {path}: cannot open the LMDB environment: lock.mdb: Permission denied"
        in line
    )
    assert digest(path / "data.mdb") == before


@pytest.mark.parametrize("argv", READS)
def test_a_folder_the_user_may_not_enter_exits_1(shared_dir, restricted, argv):
    """Real: the tier's folder is mode 0700 (as a tier creates it). Before, a traceback."""
    path = stored(shared_dir)
    opened_to_others(path, lock_mode=0o666, dir_mode=0o700 if ROOT else 0o600)
    command, *flags = (arg.format(fp=fingerprint()[:8]) for arg in argv)
    line = one_line(restricted(command, str(path), *flags), 1)
    assert f"TierIOError: {path}: cannot read the LMDB environment: Permission denied" in line


# -- remote pools ----------------------------------------------------------------------------


def remote_pool(root: Path, dir_mode: int = 0o755) -> dict[str, Any]:
    """Return a config of one `file://` pool under `root` holding 4 chunks, readable by all."""
    tier = {"kind": "remote", "url": f"file://{root}/pool", "capacity": 30 * (2048 + 512)}
    config = {**lmdb_config(root), "tiers": [tier]}
    asyncio.run(fill(config, 4))
    for sub in [*(root / "pool").rglob("*"), root / "pool"]:
        sub.chmod(dir_mode if sub.is_dir() else 0o644)
    return config


def pool_files(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p), p.stat().st_size) for p in (root / "pool").rglob("*") if p.is_file())


@pytest.mark.parametrize("argv", [["inspect", "--verify"], ["purge", "--bad"]])
def test_an_object_the_user_may_not_read_exits_1(shared_dir, restricted, argv):
    """Real: one object of the pool is mode 0000. Before, a traceback (StoreUnavailable)."""
    url = remote_pool(shared_dir)["tiers"][0]["url"]
    hidden = next(p for p in (shared_dir / "pool").rglob("*") if p.is_file() and len(p.name) == 32)
    hidden.chmod(0)
    before = pool_files(shared_dir)
    line = one_line(restricted(argv[0], url, *argv[1:]), 1)
    assert f"TierIOError: cannot read the pool: {url}: PermissionError" in line
    assert hidden.name in line
    assert pool_files(shared_dir) == before


@pytest.mark.parametrize(
    "argv",
    [["remote", "purge", "{toml}", "--all"], ["purge", "{url}", "--fingerprint", "{fp}"]],
)
def test_a_pool_the_user_may_not_change_exits_1_in_one_line(shared_dir, restricted, argv):
    """Real: the pool's folders are the caches' user's, mode 0755. Before, a warning of the
    store's retries ("serving misses") came first, as a cache would log it."""
    config = remote_pool(shared_dir, 0o755 if ROOT else 0o555)
    toml = write_toml(shared_dir / "tiers.toml", config)
    toml.chmod(0o644)
    before = pool_files(shared_dir)
    url = config["tiers"][0]["url"]
    done = restricted(*(a.format(toml=toml, url=url, fp=fingerprint()[:8]) for a in argv))
    line = one_line(done, 1)
    assert "TierIOError" in line and "failed" in line and "PermissionError" in line
    assert pool_files(shared_dir) == before
