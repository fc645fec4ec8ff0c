"""Fixed inputs for the cross-process determinism checks, and the script that hashes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

GOLDEN_LAYOUT: dict[str, Any] = {
    "model": "golden",
    "num_layers": 2,
    "num_kv_heads": 1,
    "head_size": 4,
}
DET_LAYOUT: dict[str, Any] = {
    "model": "det",
    "num_layers": 3,
    "num_kv_heads": 2,
    "head_size": 8,
    "chunk_size": 4,
}
DET_TOKENS = list(range(1000, 1018))
DET_SALT = "tenant-1"
HASH_SEEDS = ("0", "4242")

_SCRIPT = textwrap.dedent(
    f"""
    import json

    from kvtiers.core.keys import ChunkHasher
    from kvtiers.core.layout import KVLayout

    layout = KVLayout(**{DET_LAYOUT!r})
    hasher = ChunkHasher(layout.fingerprint, layout.chunk_size)
    keys = hasher.keys({DET_TOKENS!r}, salt={DET_SALT!r})
    print(json.dumps({{
        "golden_fingerprint": KVLayout(**{GOLDEN_LAYOUT!r}).fingerprint.hex(),
        "fingerprint": layout.fingerprint.hex(),
        "keys": [k.hex() for k in keys],
    }}))
    """
)


def run_in_fresh_interpreters(hash_seeds: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Return, per seed, the fingerprints and keys computed by a new Python process.

    The processes run in parallel: each takes seconds to import kvtiers (and torch with it).
    """
    procs = {}
    for seed in hash_seeds:
        env = dict(os.environ)
        env["PYTHONHASHSEED"] = seed
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        procs[seed] = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results: dict[str, dict[str, Any]] = {}
    for seed, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"PYTHONHASHSEED={seed}: {stderr}"
        results[seed] = json.loads(stdout)
    return results
