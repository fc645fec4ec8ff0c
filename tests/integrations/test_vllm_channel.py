"""The lookup channel between the scheduler and the worker ranks."""

from __future__ import annotations

import asyncio
import tempfile

import numpy as np
import pytest

from kvtiers import LookupResult
from kvtiers.integrations._vllm_channel import LookupClient, LookupServer, socket_path


@pytest.fixture
def sock_dir():
    # NOTE: a short folder: Unix socket paths are limited to ~107 bytes.
    with tempfile.TemporaryDirectory(prefix="kvt") as d:
        yield d


def _answering(value: int | LookupResult, seen: list | None = None, delay: float = 0.0):
    found = (
        value if isinstance(value, LookupResult) else LookupResult(value, ("dram",) * (value // 64))
    )

    async def lookup(tokens, salt):
        if seen is not None:
            seen.append((tokens.tolist(), salt))
        await asyncio.sleep(delay)
        return found

    return lookup


async def test_the_answer_is_the_minimum_over_ranks(sock_dir):
    seen: list = []
    paths = [socket_path(sock_dir, "engine-1", 0, rank) for rank in range(3)]
    answers = [
        LookupResult(512, ("dram", "dram", "lmdb", "dram")),
        LookupResult(256, ("dram", "lmdb")),
        LookupResult(768, ("lmdb", "dram", "dram", "dram", "pool", "pool")),
    ]
    servers = [
        LookupServer(path, _answering(found, seen))
        for path, found in zip(paths, answers, strict=True)
    ]
    for server in servers:
        await server.start()
    client = LookupClient(paths, tier_order=["dram", "lmdb", "pool"])
    try:
        tokens = np.arange(600, dtype=np.int64)
        # The shortest hit, each chunk in the lowest tier any rank holds it in.
        expected = LookupResult(256, ("lmdb", "lmdb"))
        assert await client.lookup(tokens, "tenant") == expected
        assert seen == [(list(range(600)), "tenant")] * 3
        assert await client.lookup(tokens, b"raw") == expected  # the connection is reused
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
        return LookupResult(int(tokens[0]) * 64, ("dram",) * int(tokens[0]))

    server = LookupServer(path, lookup)
    await server.start()
    client = LookupClient([path])
    try:
        answers = await asyncio.gather(*(client.lookup(np.array([i, 1]), None) for i in range(5)))
        assert [found.num_tokens for found in answers] == [0, 64, 128, 192, 256]
        assert [len(found.tiers) for found in answers] == [0, 1, 2, 3, 4]
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
        assert (await client.lookup(np.array([1]), None)).num_tokens == 64
        await server.aclose()  # the worker goes away mid-session
        with pytest.raises((ConnectionError, OSError)):
            await client.lookup(np.array([1]), None)
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_tier_name_not_in_the_order_counts_as_the_lowest(sock_dir):
    paths = [socket_path(sock_dir, "e", 0, rank) for rank in range(2)]
    answers = [LookupResult(128, ("dram", "dram")), LookupResult(128, ("mystery", "lmdb"))]
    servers = [LookupServer(p, _answering(a)) for p, a in zip(paths, answers, strict=True)]
    for server in servers:
        await server.start()
    client = LookupClient(paths, tier_order=["dram", "lmdb"])
    try:
        found = await client.lookup(np.array([1, 2]), None)
        assert found == LookupResult(128, ("mystery", "lmdb"))
    finally:
        await client.aclose()
        for server in servers:
            await server.aclose()


async def test_a_clear_reaches_every_rank_and_sums_what_they_removed(sock_dir):
    paths = [socket_path(sock_dir, "e", 0, rank) for rank in range(3)]
    cleared: list[int] = []

    def clearing(rank: int):
        async def clear():
            cleared.append(rank)
            return 10 * (rank + 1)

        return clear

    servers = [LookupServer(p, _answering(64), clearing(r)) for r, p in enumerate(paths)]
    for server in servers:
        await server.start()
    client = LookupClient(paths)
    try:
        assert await client.clear() == 60
        assert sorted(cleared) == [0, 1, 2]
        assert (await client.lookup(np.array([1]), None)).num_tokens == 64
    finally:
        await client.aclose()
        for server in servers:
            await server.aclose()


async def test_a_clear_that_fails_or_is_not_served_raises_on_the_asking_side(sock_dir):
    async def working():
        return 1

    async def broken():
        raise OSError("read-only store")

    paths = [socket_path(sock_dir, "e", 0, rank) for rank in range(2)]
    for clear, message in ((broken, "read-only store"), (None, "does not serve 'clear'")):
        servers = [
            LookupServer(paths[0], _answering(64), working),
            LookupServer(paths[1], _answering(64), clear),  # one rank cannot clear
        ]
        for server in servers:
            await server.start()
        client = LookupClient(paths)
        try:
            with pytest.raises(LookupError, match=message):
                await client.clear()
        finally:
            await client.aclose()
            for server in servers:
                await server.aclose()


def test_socket_paths_are_short_and_distinct():
    a = socket_path("/tmp", "x" * 200, 0, 0)
    assert len(a) < 100
    assert a != socket_path("/tmp", "x" * 200, 0, 1)
    assert a != socket_path("/tmp", "x" * 200, 1, 0)
