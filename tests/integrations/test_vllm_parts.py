"""What a vLLM connector holds open (`_vllm_parts`), tested without vLLM.

A stand-in topology replaces vLLM's config; the worker ranks are real `LookupServer`s on
Unix sockets, served from a loop thread of their own.
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import numpy as np
import pytest

from kvtiers import LookupResult
from kvtiers.integrations._runtime import LoopThread
from kvtiers.integrations._vllm_channel import LookupServer, socket_path
from kvtiers.integrations._vllm_parts import ConnectorParts
from kvtiers.integrations._vllm_plan import ConnectorSettings
from tests.conftest import make_config

ENGINE = "engine-parts"


@pytest.fixture
def sock_dir():
    # NOTE: a short folder: Unix socket paths are limited to ~107 bytes.
    with tempfile.TemporaryDirectory(prefix="kvt") as d:
        yield d


@pytest.fixture
def ranks(sock_dir):
    """Serve two worker ranks: rank 0 holds four chunks, rank 1 three, in other tiers."""
    held = {
        0: LookupResult(256, ("dram", "dram", "dram", "dram")),
        1: LookupResult(192, ("dram", "lmdb", "dram")),
    }
    cleared: list[int] = []

    def serving(rank: int) -> LookupServer:
        async def lookup(tokens, salt):
            return held[rank]

        async def clear():
            cleared.append(rank)
            return 1

        return LookupServer(socket_path(sock_dir, ENGINE, 0, rank), lookup, clear)

    loop = LoopThread(name="test-ranks")
    servers = [serving(rank) for rank in held]
    for server in servers:
        loop.run(server.start(), 10)
    yield cleared
    for server in servers:
        loop.run(server.aclose(), 10)
    loop.stop()


def _parts(sock_dir: str) -> ConnectorParts:
    topology = SimpleNamespace(num_ranks=2, dp_rank=0)
    settings = ConnectorSettings(config=make_config())
    return ConnectorParts(settings, topology, ENGINE, sock_dir, ["dram", "lmdb"])  # type: ignore[arg-type]


def test_lookups_go_to_every_rank_over_one_channel(sock_dir, ranks):
    parts = _parts(sock_dir)
    try:
        lookup = parts.make_lookup()
        found = lookup(np.arange(300, dtype=np.int64), None).result(10)
        # The shortest hit over the ranks, each chunk named by its lowest tier.
        assert found == LookupResult(192, ("dram", "lmdb", "dram"))
        loop, client = parts.channel()
        assert parts.channel() == (loop, client)  # opened once
        assert loop.run(client.clear(), 10) == 2 and sorted(ranks) == [0, 1]
    finally:
        parts.close()
    assert not loop.alive


def test_close_runs_once_and_without_anything_open(sock_dir, ranks):
    parts = _parts(sock_dir)
    parts.close()  # nothing was opened
    loop, _ = parts.channel()
    parts.close()
    parts.close()  # the finalizer after an explicit shutdown
    assert not loop.alive
    assert parts.entry is None
