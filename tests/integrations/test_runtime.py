"""The loop thread and the per-process cache registry of the vLLM connector."""

from __future__ import annotations

import threading

import pytest

from kvtiers import CacheState, TieredCache
from kvtiers.integrations._runtime import CacheRegistry, LoopThread
from tests.conftest import make_config, small_layout


def test_loop_thread_runs_coroutines_and_stops():
    loop = LoopThread("test-loop")

    async def where():
        return threading.current_thread().name

    assert loop.run(where(), 5) == "test-loop"
    loop.stop()
    assert not loop.alive
    loop.stop()  # idempotent


def test_registry_shares_one_cache_and_closes_it_with_the_last_user(tmp_path):
    registry = CacheRegistry()
    config = make_config(tmp_path, lmdb_chunks=16)
    built = []

    def build():
        built.append(TieredCache.from_config(config))
        return built[-1]

    first = registry.acquire("key", build)
    second = registry.acquire("key", build)
    assert first is second and len(built) == 1
    assert first.cache.state is CacheState.OPEN
    registry.publish("engine", 0, first)
    assert registry.find("engine", 0) is first
    registry.release(first)
    assert first.cache.state is CacheState.OPEN
    registry.release(second)
    assert first.cache.state is CacheState.CLOSED
    assert not first.loop.alive
    assert registry.find("engine", 0) is None
    # The same LMDB path opens again in this process once the last user released it.
    third = registry.acquire("key", build)
    assert third is not first and third.cache.state is CacheState.OPEN
    registry.release(third)


def test_a_cache_that_cannot_open_leaves_nothing_behind(tmp_path):
    registry = CacheRegistry()
    bad = make_config(tmp_path, lmdb_chunks=16)
    (tmp_path / "lmdb").write_text("not a folder")  # LMDB cannot open a file as its folder
    with pytest.raises(Exception):  # noqa: B017 - whatever the tier raises
        registry.acquire("bad", lambda: TieredCache.from_config(bad))
    entry = registry.acquire("good", lambda: TieredCache.from_config(make_config()))
    registry.release(entry)
    assert entry.cache.state is CacheState.CLOSED


_EXIT_SCRIPT = """
import sys
from pathlib import Path
from kvtiers import TieredCache
from kvtiers.integrations._runtime import CACHES
from tests.conftest import make_config, make_kv, small_layout

config = make_config(Path(sys.argv[1]), dram_chunks=256, lmdb_chunks=256)
entry = CACHES.acquire("exit", lambda: TieredCache.from_config(config))
layout = small_layout()
for i in range(40):  # stores submitted, never awaited: the process just ends
    tokens = [i * 1000 + t for t in range(4 * layout.chunk_size)]
    entry.loop.submit(entry.cache.store(tokens, make_kv(layout, len(tokens), seed=i)))
"""


def test_caches_still_open_at_interpreter_exit_are_closed_with_their_writes_drained(tmp_path):
    """A process that never shuts its engine down (an offline `LLM` left to exit) still
    gets every accepted chunk into its write-through tiers, and logs no failed close."""
    import asyncio
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "closing the cache failed" not in proc.stderr
    assert "Traceback" not in proc.stderr

    async def count() -> int:
        config = make_config(tmp_path, dram_chunks=256, lmdb_chunks=256)
        config["tiers"] = config["tiers"][1:]  # the LMDB tier alone
        layout = small_layout()
        found = 0
        async with TieredCache.from_config(config, layout=layout) as cache:
            for i in range(40):
                tokens = [i * 1000 + t for t in range(4 * layout.chunk_size)]
                found += await cache.lookup(tokens) // layout.chunk_size
        return found

    assert asyncio.run(count()) == 40 * 4
