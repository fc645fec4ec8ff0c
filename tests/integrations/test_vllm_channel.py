"""The lookup channel between the scheduler and the worker ranks."""

from __future__ import annotations

import asyncio
import tempfile

import numpy as np
import pytest

from kvtiers.integrations._vllm_channel import LookupClient, LookupServer, socket_path


@pytest.fixture
def sock_dir():
    # NOTE: a short folder: Unix socket paths are limited to ~107 bytes.
    with tempfile.TemporaryDirectory(prefix="kvt") as d:
        yield d


def _answering(value: int, seen: list | None = None, delay: float = 0.0):
    async def lookup(tokens, salt):
        if seen is not None:
            seen.append((tokens.tolist(), salt))
        await asyncio.sleep(delay)
        return value

    return lookup


async def test_the_answer_is_the_minimum_over_ranks(sock_dir):
    seen: list = []
    paths = [socket_path(sock_dir, "engine-1", 0, rank) for rank in range(3)]
    servers = [
        LookupServer(path, _answering(v, seen))
        for path, v in zip(paths, [512, 256, 768], strict=True)
    ]
    for server in servers:
        await server.start()
    client = LookupClient(paths)
    try:
        tokens = np.arange(600, dtype=np.int64)
        assert await client.lookup(tokens, "tenant") == 256
        assert seen == [(list(range(600)), "tenant")] * 3
        assert await client.lookup(tokens, b"raw") == 256  # the connection is reused
    finally:
        await client.aclose()
        for server in servers:
            await server.aclose()


async def test_concurrent_lookups_on_one_connection(sock_dir):
    path = socket_path(sock_dir, "e", 0, 0)
    calls = []

    async def lookup(tokens, salt):
        calls.append(int(tokens[0]))
        await asyncio.sleep(0.05 if tokens[0] == 0 else 0)
        return int(tokens[0]) * 64

    server = LookupServer(path, lookup)
    await server.start()
    client = LookupClient([path])
    try:
        answers = await asyncio.gather(*(client.lookup(np.array([i, 1]), None) for i in range(5)))
        assert answers == [0, 64, 128, 192, 256]
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_failed_lookup_raises_on_the_asking_side(sock_dir):
    path = socket_path(sock_dir, "e", 0, 0)

    async def broken(tokens, salt):
        raise OSError("disk gone")

    server = LookupServer(path, broken)
    await server.start()
    client = LookupClient([path])
    try:
        with pytest.raises(LookupError, match="disk gone"):
            await client.lookup(np.array([1, 2]), None)
    finally:
        await client.aclose()
        await server.aclose()


async def test_an_unreachable_rank_is_an_error_and_reconnects_later(sock_dir):
    path = socket_path(sock_dir, "e", 0, 0)
    client = LookupClient([path], connect_timeout=0.5)
    with pytest.raises(OSError):
        await client.lookup(np.array([1]), None)
    server = LookupServer(path, _answering(64))
    await server.start()
    try:
        assert await client.lookup(np.array([1]), None) == 64
        await server.aclose()  # the worker goes away mid-session
        with pytest.raises((ConnectionError, OSError)):
            await client.lookup(np.array([1]), None)
    finally:
        await client.aclose()
        await server.aclose()


def test_socket_paths_are_short_and_distinct():
    a = socket_path("/tmp", "x" * 200, 0, 0)
    assert len(a) < 100
    assert a != socket_path("/tmp", "x" * 200, 0, 1)
    assert a != socket_path("/tmp", "x" * 200, 1, 0)
