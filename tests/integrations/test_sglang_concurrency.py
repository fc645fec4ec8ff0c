"""The SGLang storage backend under many threads at once, and with tiers failing under them.

HiCache calls its storage backend from its prefetch and backup threads and from the
scheduler thread at the same time; an exception in one of them ends it for good. The
scenarios (`sglang_concurrency_scenarios.py`) run in SGLang's own virtualenv on real host
pools: each hit is compared byte for byte, anything that escapes a call is reported with
its traceback, and the threads and caches left behind are counted.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from kvtiers.integrations._runtime import LoopThread
from tests.integrations.test_sglang import run as run_scenario

CONFIGS = [
    ("mha", "layer_first", "lmdb"),
    ("mha", "page_first", "remote"),
    ("mla", "page_first", "dram-lmdb"),
    ("mla", "layer_first", "remote"),
]


def run(python: Path, *args: str) -> dict[str, Any]:
    return run_scenario(python, *args, script="sglang_concurrency_scenarios.py", timeout=600)


@pytest.fixture(scope="module")
def overlaps(sglang_python, tmp_path_factory) -> dict[str, Any]:
    """Every configuration's threads, in one SGLang process."""
    args = [part for config in CONFIGS for part in config]
    return run(sglang_python, "overlap", str(tmp_path_factory.mktemp("overlap")), *args)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "layout", "tiers"), CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_threads_on_overlapping_pages_get_exact_hits_and_consistent_counts(
    overlaps, kind, layout, tiers
):
    out = overlaps[f"{kind}-{layout}-{tiers}"]
    assert out["errors"] == [] and out["alive"] == 0
    assert out["calls"] == 4 * 150
    assert out["hits"] > 0 and out["wrong"] == 0
    assert out["bad_exists"] == 0
    assert out["failures"] == {}
    # SGLang's metrics, taken by another thread all along, add up to what the calls said
    assert out["metrics"]["prefetch"] == out["hits"]
    assert out["metrics"]["backup"] == out["set_true"]
    assert out["metrics"]["entries"][0] == out["metrics"]["entries"][1]
    assert out["loaded_tokens"] == out["hits"] * out["page"]


@pytest.mark.slow
def test_closing_under_calls_and_dropping_unclosed_release_everything(sglang_python, tmp_path):
    out = run(sglang_python, "close", str(tmp_path))
    assert out["errors"] == [] and out["alive"] == 0 and out["wrong"] == 0
    # two racing closes release the shared cache once: the other backend keeps it
    assert out["other_ok"] == [True] * 6 and out["other_exact"] == [True] * 6
    assert out["entries_after_close"] == 0 and out["leaked_after_close"] == []
    # a backend only garbage-collected closes its caches (loop and LMDB threads included)
    assert out["entries_after_gc"] == 0 and out["leaked_after_gc"] == []
    assert out["reopened_exists"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "layout", "tier"),
    [("mha", "layer_first", "remote"), ("mla", "page_first", "lmdb")],
    ids=["remote-pool-goes", "lmdb-values-rot"],
)
def test_a_tier_failing_under_the_threads_gives_misses(sglang_python, tmp_path, kind, layout, tier):
    out = run(sglang_python, "faults", str(tmp_path), kind, layout, tier)
    assert out["errors"] == [] and out["alive"] == 0
    assert out["hits"] > 0 and out["wrong"] == 0  # garbage is never served
    if tier == "lmdb":
        assert all(out["corrupted"]) and out["corrupt_found"] > 0


def test_a_call_racing_the_loops_stop_is_refused_not_left_waiting():
    """A coroutine submitted while the loop shuts down is refused at once.

    Before, it was accepted after the loop's last turn and never run: its caller (one of
    SGLang's threads, as a backend was closed under it) waited out its whole timeout.
    """
    loop = LoopThread("test-loop")
    started, stopping, submitted = threading.Event(), threading.Event(), threading.Event()

    async def slow_to_cancel() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stopping.set()  # the loop is shutting down: hold it there for a moment
            submitted.wait(60)
            raise

    loop.submit(slow_to_cancel())
    assert started.wait(60)  # else the stop cancels it before its `try`
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    assert stopping.wait(60)
    late = asyncio.sleep(0.5)
    try:
        with pytest.raises(RuntimeError):
            loop.submit(late).result(timeout=30)  # the timeout only guards a hang
    finally:
        submitted.set()
        stopper.join(60)
    loop.stop(60)  # idempotent: waits (a hang guard) for the loop thread to end
    assert not loop.alive
    assert late.cr_frame is None  # closed, never left unawaited
