"""The loop thread and the per-process cache registry of the vLLM connector."""

from __future__ import annotations

import threading

import pytest

from kvtiers import CacheState, TieredCache
from kvtiers.integrations._runtime import CacheRegistry, LoopThread
from tests.conftest import make_config


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
