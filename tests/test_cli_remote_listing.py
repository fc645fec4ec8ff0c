"""A `file://` pool with a folder the user may not list: `inspect`, `remote`, `purge` exit 1.

fsspec's local `find` skips a folder it may not read without a word, so these commands
reported fewer objects (or none) and exited 0. A listing that could not read part of the
pool must say so instead: exit status 1 and one line on stderr naming the folder and the
cause, changing nothing. The folders are real, with real modes, and the commands run as a
user those modes stop (`nobody` when the suite runs as root; see `test_cli_permissions`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import test_cli_permissions as perm
from tests.test_cli_live import fingerprint, write_toml

pytest.importorskip("lmdb")

shared_dir = perm.shared_dir  # fixtures: a folder others may enter; kvtiers as `nobody`
restricted = perm.restricted

DENIED = 0o700 if perm.ROOT else 0o000
"""A folder the command's user may not list or enter (the owner's mode, as a tier makes it)."""
NAMES_ONLY = 0o744 if perm.ROOT else 0o444
"""A folder whose names the command's user may read, but not the objects' details."""


def namespace(root: Path) -> Path:
    return root / "pool" / fingerprint()


def a_prefix(root: Path) -> Path:
    """Return one `<key[:2] hex>` folder of the pool (it holds one or more objects)."""
    return next(p for p in sorted(namespace(root).iterdir()) if p.is_dir() and len(p.name) == 4)


def run_denied(
    root: Path, run: Callable[..., Any], folder: Path, mode: int, *argv: str
) -> tuple[str, list[tuple[str, int]]]:
    """Set `folder` to `mode`, run `kvtiers *argv`; return its one error line (status 1)."""
    before = perm.pool_files(root)
    folder.chmod(mode)
    try:
        line = perm.one_line(run(*argv), 1)
    finally:
        folder.chmod(0o755)
    assert "Traceback" not in line
    return line, before


def test_inspect_of_a_pool_with_a_prefix_folder_it_may_not_list_exits_1(shared_dir, restricted):
    """Real: one `<key[:2] hex>` folder is the caches' user's, mode 0700. Before, `inspect`
    listed the other objects only and exited 0."""
    url = perm.remote_pool(shared_dir)["tiers"][0]["url"]
    folder = a_prefix(shared_dir)
    line, before = run_denied(shared_dir, restricted, folder, DENIED, "inspect", url, "--json")
    assert line.startswith("kvtiers inspect: TierIOError: "), line
    assert "cannot list the pool" in line
    assert f"Permission denied: '{folder}'" in line, line
    assert perm.pool_files(shared_dir) == before


@pytest.mark.parametrize("where", ["namespace", "prefix names only"])
def test_remote_ls_of_a_pool_with_a_folder_it_may_not_read_exits_1(shared_dir, restricted, where):
    """Real: the layout's folder is mode 0700 (before, `remote ls` printed "empty"), or a
    prefix folder lets others read its names but not stat its objects (mode 0744; before,
    its objects went uncounted). Either way, exit status 0 before."""
    config = perm.remote_pool(shared_dir)
    toml = write_toml(shared_dir / "tiers.toml", config)
    toml.chmod(0o644)
    folder, mode = (
        (namespace(shared_dir), DENIED)
        if where == "namespace"
        else (a_prefix(shared_dir), NAMES_ONLY)
    )
    line, before = run_denied(shared_dir, restricted, folder, mode, "remote", "ls", str(toml))
    assert line.startswith("kvtiers remote: TierIOError: "), line
    assert "cannot list the pool" in line
    assert f"Permission denied: '{folder}" in line, line  # the folder, or an object in it
    assert perm.pool_files(shared_dir) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["remote", "purge", "{toml}", "--all", "--dry-run"],
        ["purge", "{url}", "--fingerprint", "{fp}", "--dry-run"],
    ],
)
def test_a_dry_run_purge_that_cannot_list_a_folder_exits_1(shared_dir, restricted, argv):
    """Real: a prefix folder is mode 0700. Before, the dry run counted the objects it could
    see ("would delete 3 objects") and exited 0."""
    config = perm.remote_pool(shared_dir)
    toml = write_toml(shared_dir / "tiers.toml", config)
    toml.chmod(0o644)
    url = config["tiers"][0]["url"]
    args = [a.format(toml=toml, url=url, fp=fingerprint()[:8]) for a in argv]
    folder = a_prefix(shared_dir)
    line, before = run_denied(shared_dir, restricted, folder, DENIED, *args)
    assert line.startswith(f"kvtiers {argv[0]}: TierIOError: "), line
    assert f"Permission denied: '{folder}'" in line, line
    assert perm.pool_files(shared_dir) == before


def test_a_readable_pool_still_lists_as_that_user(shared_dir, restricted):
    """Control: with every folder readable, the same user lists the whole pool."""
    config = perm.remote_pool(shared_dir)
    toml = write_toml(shared_dir / "tiers.toml", config)
    toml.chmod(0o644)
    done = restricted("remote", "ls", str(toml))
    assert done.returncode == 0, done
    assert "this layout: 4 objects" in done.stdout, done.stdout
