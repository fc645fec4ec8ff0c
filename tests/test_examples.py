"""The scripts in docs/examples run as their docstrings say."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def test_custom_engine_reuses_the_chat_prefix_and_answers_the_same():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "custom_engine.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    full = ast.literal_eval(lines["prompt tokens prefilled per turn, no cache"])
    reused = ast.literal_eval(lines["prompt tokens prefilled per turn, kvtiers"])
    assert reused[0] == full[0] and all(r < f for r, f in zip(reused[1:], full[1:], strict=True))
    assert "answers identical" in done.stdout
