"""Asking Linux for AMX tile data, as the vLLM worker does at start-up."""

from __future__ import annotations

import subprocess
import sys

from tests.integrations.conftest import cpu_has_amx

_PROBE = """
from kvtiers.integrations._amx import granted_amx_tiles, request_amx_tiles
asked = request_amx_tiles()
print(asked, granted_amx_tiles(), request_amx_tiles())
"""


def test_a_process_may_use_amx_tiles_once_it_asked_and_asking_again_is_harmless():
    # A fresh process: the permission is the process's, for every thread.
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    if cpu_has_amx():
        assert out == ["True", "True", "True"]
    else:  # no AMX (or not x86-64 Linux): nothing granted, nothing raised
        assert out == ["False", "False", "False"]
