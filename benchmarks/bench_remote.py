"""Loads of 1 GiB from a remote tier on a loopback S3 server (moto) vs raw s3fs reads.

The cache has one tier, `remote`, so `TieredCache.load` reads every chunk through the
remote tier's `get` (a ranged GET per object, checksums verified, bytes copied into `out`).
The layout is bench_dram's (Llama-3-8B) with chunks of 64 tokens: 8 MiB per chunk, 128
chunks per GiB. The baselines read the same objects with s3fs's `cat_file` (which asks for
an object's size, then its bytes) with the same concurrency (16 requests in flight), the
same with one ranged GET per object (what the tier sends), and one after another (serial).
A last row reads one layer of 32 of every chunk (`get_layers`, byte ranges) against whole
chunks.

The S3 server is moto's, in a process of its own, so that it does not share the client's
interpreter lock; it is slow (all Python), so the figures measure the client's overhead
against a raw client far more than S3's bandwidth.

Run alone: `python -m benchmarks.bench_remote [--quick]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from benchmarks._common import GIB, MIB, Result, Target, main
from benchmarks._timing import amedians_interleaved
from benchmarks.bench_dram import BYTES_PER_TOKEN, LAYOUT, VOCAB, make_kv, same_bits
from kvtiers import TieredCache

CHUNK_TOKENS = 64
REMOTE_LAYOUT = {**LAYOUT, "chunk_size": CHUNK_TOKENS}
CHUNK_BYTES = BYTES_PER_TOKEN * CHUNK_TOKENS
IN_FLIGHT = 16
BUCKET = "kvtiers-bench"

_SERVER = textwrap.dedent(
    """
    import logging, sys
    from moto import backends
    modules = tuple(backends.list_of_moto_modules())  # moto re-reads it per request
    backends.list_of_moto_modules = lambda: modules
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
    server.start()
    print("ready", flush=True)
    sys.stdin.read()
    server.stop()
    """
)


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Run a moto S3 server in a subprocess; yield its endpoint URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _storage_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "bench",
        "secret": "bench-secret",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }


async def _raw_fs(endpoint: str) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(
        asynchronous=True, skip_instance_cache=True, **_storage_options(endpoint)
    )
    await fs.set_session()
    return fs


async def _raw_reads(fs: Any, paths: list[str], in_flight: int, size: int | None = None) -> None:
    """Read every object with `cat_file`, whole (`size` None) or as one range of `size`."""
    slots = asyncio.Semaphore(in_flight)
    limits = {} if size is None else {"start": 0, "end": size}

    async def one(path: str) -> None:
        async with slots:
            data = await fs._cat_file(path, **limits)
            if len(data) < CHUNK_BYTES:
                raise AssertionError(f"short object {path}")

    await asyncio.gather(*(one(p) for p in paths))


async def _bench(total: int, repeats: int) -> list[Result]:
    num_tokens = total // BYTES_PER_TOKEN
    num_chunks = num_tokens // CHUNK_TOKENS
    tokens = np.random.default_rng(0).integers(0, VOCAB, num_tokens, dtype=np.int64)
    kv = make_kv(num_tokens)
    dst = torch.ones_like(kv)
    size = f"{total / GIB:g} GiB" if total >= GIB else f"{total // MIB} MiB"
    with moto_server() as endpoint:
        raw = await _raw_fs(endpoint)
        await raw._call_s3("create_bucket", Bucket=BUCKET)
        tier_cfg = {
            "kind": "remote",
            "url": f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}",
            "capacity": 2 * total,
            "storage_options": _storage_options(endpoint),
            "max_in_flight": IN_FLIGHT,
        }
        async with TieredCache.from_config({"layout": REMOTE_LAYOUT, "tiers": [tier_cfg]}) as cache:
            assert await cache.store(tokens, kv) == num_tokens
            tier: Any = cache.tiers[0]
            keys = cache.keys(tokens)
            paths = [f"{tier.namespace}/{k[:2].hex()}/{k.hex()}" for k in keys]

            async def load() -> None:
                out = await cache.load(tokens, out=dst)
                assert out.shape[2] == num_tokens, "a remote chunk was missing"

            await load()
            assert same_bits(dst, kv), "load returned other bytes than were stored"
            bufs = list(np.empty((num_chunks, CHUNK_BYTES), dtype=np.uint8))

            async def one_layer() -> None:
                assert all(await tier.get_layers(keys, [0], bufs))

            async def whole() -> None:
                assert all(await tier.get(keys, bufs))

            t_kv, t_raw, t_ranged, t_serial, t_layer, t_whole = await amedians_interleaved(
                [
                    load,
                    lambda: _raw_reads(raw, paths, IN_FLIGHT),
                    lambda: _raw_reads(raw, paths, IN_FLIGHT, tier.value_bytes),
                    lambda: _raw_reads(raw, paths, 1),
                    one_layer,
                    whole,
                ],
                repeats,
            )
        await raw._s3.close()
    chunks = f"{num_chunks} objects of {CHUNK_BYTES // MIB} MiB"
    return [
        Result.of_rates(
            f"remote load {size} (moto S3), {IN_FLIGHT} in flight vs raw s3fs cat_file",
            total / t_kv / GIB,
            total / t_raw / GIB,
            unit="GiB/s",
            target=Target("ratio", ">=", 0.8),
            notes=f"{chunks}; same concurrency; kvtiers verifies checksums and copies into "
            f"`out`; {t_kv * 1e3:.0f} ms vs {t_raw * 1e3:.0f} ms",
        ),
        Result.of_rates(
            f"remote load {size} (moto S3), {IN_FLIGHT} in flight vs raw one-GET cat_file",
            total / t_kv / GIB,
            total / t_ranged / GIB,
            unit="GiB/s",
            target=Target("ratio", ">=", 0.8),
            notes="the raw reads ask for the object's byte range, one GET each, as the tier "
            "does (plain cat_file first asks for the size), and neither verify nor copy the "
            f"bytes; {t_kv * 1e3:.0f} ms vs {t_ranged * 1e3:.0f} ms",
        ),
        Result.of_rates(
            f"remote load {size} (moto S3) vs serial raw s3fs cat_file",
            total / t_kv / GIB,
            total / t_serial / GIB,
            unit="GiB/s",
            notes=f"{t_kv * 1e3:.0f} ms vs {t_serial * 1e3:.0f} ms",
        ),
        Result.of_times(
            f"remote get_layers 1 of 32 layers, {num_chunks} chunks vs whole chunks",
            t_layer,
            t_whole,
            notes="byte ranges (header + one layer) vs whole objects, both through the tier; "
            "moto reads a whole object to serve any range of it, so S3 would gain more",
        ),
    ]


def run(quick: bool) -> list[Result]:
    """Time loads of 1 GiB (128 MiB with `quick`) from a loopback S3 server."""
    if quick:
        return asyncio.run(_bench(128 * MIB, 3))
    return asyncio.run(_bench(GIB, 5))


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
