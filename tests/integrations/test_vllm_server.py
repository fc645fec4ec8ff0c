"""The vLLM connector behind vLLM's OpenAI-compatible server, as a vLLM user runs it.

`python -m vllm.entrypoints.openai.api_server ... --kv-transfer-config '{...KVTiersConnector...}'`
in vLLM's default (multiprocess) mode, driven over HTTP: prompts sharing a prefix are
served from kvtiers (the usage's `cached_tokens`), the server's `/metrics` carries kvtiers'
counters and vLLM's split of cached tokens by source, and `POST /reset_prefix_cache
?reset_external=true` (the endpoint RL frameworks call after a weight sync) clears kvtiers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import scenario_env
from tests.tiers.servers import free_port

pytestmark = pytest.mark.slow

PREFIX, CHUNK = 256, 64


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(3, 500) for _ in range(23 + 17 * i)] for i in range(3)]


class Server:
    """A running vLLM OpenAI server on 127.0.0.1."""

    def __init__(self, python: Path, model: Path, work: Path) -> None:
        self.model, self.port = str(model), free_port()
        tiers = [
            {"kind": "dram", "capacity": "64MiB"},
            {"kind": "lmdb", "path": str(work / "lmdb"), "capacity": "256MiB"},
        ]
        transfer = {
            "kv_connector": "KVTiersConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "kvtiers.integrations.vllm",
            "kv_connector_extra_config": {"chunk_size": CHUNK, "config": {"tiers": tiers}},
        }
        cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
            "--enforce-eager", "--block-size", "32", "--max-model-len", "1024",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(transfer),
        ]  # fmt: skip
        # NOTE: vLLM serves /reset_prefix_cache only in its development mode.
        env = {**scenario_env(), "VLLM_SERVER_DEV_MODE": "1"}
        self.log = work / "server.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def stop(self) -> None:
        """Stop the server and its engine-core process (SIGTERM, then SIGKILL)."""
        for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        pytest.fail(f"the server did not come up in {timeout} s:\n{self.tail()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            self.url(path),
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.load(answer)

    def complete(self, prompt: list[int]) -> tuple[list[int], int]:
        """Return the greedy output tokens of `prompt` and its cached prompt tokens."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = self.post("/v1/completions", body)
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        return answer["choices"][0]["token_ids"], cached

    def metrics(self) -> dict[str, float]:
        """Return the server's counters by name and labels (`_total` dropped)."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as answer:
            text = answer.read().decode()
        values = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("vllm:") and "_total" in name:
                values[_short(name)] = float(value)
        return values

    def tail(self) -> str:
        return self.log.read_text()[-6000:]


def _short(name: str) -> str:
    """`vllm:x_total{engine="0",model_name="m",tier="dram"}` -> `x{tier=dram}`."""
    metric, _, labels = name.removeprefix("vllm:").partition("{")
    kept = [
        part.replace('"', "")
        for part in labels.rstrip("}").split(",")
        if part and not part.startswith(("engine=", "model_name="))
    ]
    base = metric.removesuffix("_total")
    return f"{base}{{{','.join(kept)}}}" if kept else base


def test_the_openai_server_serves_prefixes_reports_them_and_resets(
    vllm_python, tiny_llama, tmp_path
):
    server = Server(vllm_python, tiny_llama, tmp_path)
    try:
        server.wait_ready()
        prompts = _prompts()
        first = [server.complete(p) for p in prompts]  # one at a time: the later ones hit
        assert [cached for _, cached in first] == [0, PREFIX, PREFIX]
        metrics = server.metrics()
        assert metrics["kvtiers_loaded_tokens"] == 2 * PREFIX
        assert metrics["kvtiers_saved_tokens"] >= PREFIX
        assert metrics["kvtiers_tier_hits{tier=dram}"] == 2 * PREFIX // CHUNK
        assert metrics["prompt_tokens_cached_by_source{source=host}"] == 2 * PREFIX
        assert metrics["kvtiers_resets"] == 0

        assert server.post("/reset_prefix_cache?reset_external=true") == {"success": True}
        # Nothing of before the reset is served; what is computed again is the same.
        assert server.complete(prompts[1]) == (first[1][0], 0)
        assert server.complete(prompts[2]) == (first[2][0], PREFIX)  # stored since
        assert server.metrics()["kvtiers_resets"] == 1
    finally:
        server.stop()
