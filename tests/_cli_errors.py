"""Check that a `kvtiers` command refused bad input the way the command line must."""

from __future__ import annotations

from typing import Any


def one_line_error(capsys: Any, code: int, *, status: int | None = None) -> str:
    """Return the one line a failed command wrote to stderr, checking its exit status.

    `status` is the exact status expected; any non-zero one by default.
    """
    err = capsys.readouterr().err
    assert code != 0 if status is None else code == status, (code, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvtiers "), err
    return lines[0]
