"""Crash safety: writers SIGKILLed at random moments leave only whole, correct chunks.

Each trial forks a writer that stores (and reads) chunks in a loop into a tier smaller than
what it writes, kills it with SIGKILL after a random delay, and then forks a fresh process
that opens the same path, loads every chunk it finds and compares it bit for bit with what
was stored under that key, and stores and reads a new batch. Trials accumulate in one
store, so later ones also start on what earlier crashes left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability

REPO = Path(__file__).resolve().parents[2]
TRIALS = 20


def _run_trials(kind: str, target: str, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    zygote = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability._crash_child", kind, target],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    totals = {"trials": 0, "chunks_verified": 0, "max_found": 0}
    try:
        for trial in range(TRIALS):
            zygote.stdin.write(f"store {trial}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.02, 0.35))
            os.kill(pid, signal.SIGKILL)
            zygote.stdin.write(f"verify {trial} {pid}\n")
            zygote.stdin.flush()
            result = json.loads(zygote.stdout.readline())
            assert "error" not in result, f"trial {trial}: the verifier failed: {result}"
            assert result["bad"] == 0 and result["corrupt"] == 0, f"trial {trial}: {result}"
            assert result["works"], f"trial {trial}: the tier stopped working: {result}"
            totals["trials"] += 1
            totals["chunks_verified"] += result["found"]
            totals["max_found"] = max(totals["max_found"], result["found"])
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=30)
        zygote.stdout.close()
    print(f"crash trials, {kind}: {totals}")  # the figures of docs/reliability.md (-s)
    return totals


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("kind", ["lmdb", "lmdb-writemap"])
def test_lmdb_survives_sigkill_at_random_moments(tmp_path: Path, kind: str) -> None:
    totals = _run_trials(kind, str(tmp_path / "db"), seed=9)
    assert totals["trials"] == TRIALS and totals["max_found"] > 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_file_remote_survives_sigkill_at_random_moments(tmp_path: Path) -> None:
    totals = _run_trials("remote", f"file://{tmp_path}/pool", seed=10)
    assert totals["trials"] == TRIALS and totals["max_found"] > 0
