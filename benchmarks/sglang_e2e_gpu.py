"""SGLang server end to end with kvtiers as HiCache's storage layer (needs a CUDA GPU).

Usage: `python benchmarks/sglang_e2e_gpu.py --model PATH [--port 30000]` from the
repository root, in an environment with a CUDA build of SGLang (`pip install sglang`) and
kvtiers. It starts SGLang twice on `--model`, sends the same greedy requests (prompts that
share a long prefix) to each and compares the outputs:

1. baseline: `--enable-hierarchical-cache` with no storage backend;
2. kvtiers: the same plus `--hicache-storage-backend dynamic` and kvtiers' extra config
   (one LMDB tier in a temp dir). The first pass fills the storage; the second pass runs
   in a restarted server (empty GPU and host caches), so its prefixes come from L3.

It prints whether the greedy outputs are equal, the prompt tokens served from storage (the
server's `sglang:prefetched_tokens_total` metric, when exposed) and the time of each pass.
Exit status: 0 when the outputs are equal and storage served tokens, 1 otherwise. Without
a CUDA device it prints 'no CUDA device: skipped' and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

PREFIX = "You are a careful assistant. " * 120
QUESTIONS = [f"Question {i}: name a prime number above {i * 37}." for i in range(8)]


def _post(url: str, body: dict[str, Any], timeout: float = 300.0) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def _start(model: str, port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model,
        "--port", str(port), "--host", "127.0.0.1", "--enable-hierarchical-cache",
        "--page-size", "64", "--enable-metrics", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            _get(f"http://127.0.0.1:{port}/health")
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang exited with {proc.returncode}") from None
            time.sleep(2)
    _stop(proc)
    raise RuntimeError("sglang did not become healthy in 15 minutes")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _answers(port: int) -> tuple[list[str], float]:
    start = time.perf_counter()
    out = []
    for q in QUESTIONS:
        body = {
            "text": PREFIX + q,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32},
        }
        out.append(_post(f"http://127.0.0.1:{port}/generate", body)["text"])
    return out, time.perf_counter() - start


def _prefetched(port: int) -> float | None:
    text = _get(f"http://127.0.0.1:{port}/metrics")
    found = re.findall(r"^sglang:prefetched_tokens_total\S* (\S+)$", text, re.M)
    return sum(float(x) for x in found) if found else None


def main() -> int:
    """Run both servers and compare; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local model path or hub id")
    parser.add_argument("--port", type=int, default=30000)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    workdir = tempfile.mkdtemp(prefix="kvtiers-sglang-e2e-")
    extra_config = {
        "backend_name": "kvtiers",
        "module_path": "kvtiers.integrations.sglang",
        "class_name": "KVTiersStorage",
        "interface_v1": 1,
        "config": {"tiers": [{"kind": "lmdb", "path": workdir, "capacity": "32GiB"}]},
    }
    proc = _start(args.model, args.port, [])
    try:
        baseline, t_base = _answers(args.port)
    finally:
        _stop(proc)
    backend = [
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra_config),
        "--hicache-write-policy", "write_through",
    ]  # fmt: skip
    proc = _start(args.model, args.port, backend)
    try:
        first, t_first = _answers(args.port)
        time.sleep(5)  # let the backup thread write the pages to L3
    finally:
        _stop(proc)
    proc = _start(args.model, args.port, backend)  # a restarted server: empty GPU and host
    try:
        second, t_second = _answers(args.port)
        prefetched = _prefetched(args.port)
    finally:
        _stop(proc)
    equal = baseline == first == second
    print(f"greedy outputs equal with and without kvtiers: {equal}")
    print(f"prompt tokens prefetched from kvtiers: {prefetched}")
    print(f"seconds: baseline {t_base:.2f}, first pass {t_first:.2f}, from L3 {t_second:.2f}")
    return 0 if equal and prefetched else 1


if __name__ == "__main__":
    sys.exit(main())
