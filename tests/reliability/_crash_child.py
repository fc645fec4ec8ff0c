"""A zygote for the crash trials: imports kvtiers once, then forks writers and verifiers.

Run as `python -m tests.reliability._crash_child KIND TARGET`, with KIND `lmdb`,
`lmdb-writemap` or `remote` and TARGET the LMDB folder or the `file://` URL. It reads
commands from stdin, one a line:

- `store SEED`: fork a writer that stores chunks in a loop until it is killed; print its pid.
- `verify SEED PID`: reap the writer PID, fork a fresh verifier, wait for it, print its JSON.

Forking skips the interpreter and torch start-up (seconds), so 20 trials take seconds. The
zygote itself never opens the store: LMDB forbids an environment open across a fork.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvtiers.core.config import TierConfig
from kvtiers.tiers.lmdb import LMDBTier
from kvtiers.tiers.remote import RemoteTier
from tests.reliability._factories import LAYOUT, lmdb_config, remote_config

CAPACITY_CHUNKS = 48  # smaller than what a writer stores: evictions run while it is killed
BATCH = 4


def chunk_key(seed: int, i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{seed}:{i}".encode())


def expected(key: bytes) -> np.ndarray:
    rng = np.random.default_rng(np.frombuffer(key, np.uint32))
    return rng.integers(0, 256, LAYOUT.chunk_bytes, dtype=np.uint8)


def make_tier(kind: str, target: str) -> LMDBTier | RemoteTier:
    if kind in ("lmdb", "lmdb-writemap"):
        options = {"writemap": True} if kind == "lmdb-writemap" else {}
        return LMDBTier(lmdb_config(target, CAPACITY_CHUNKS, **options), LAYOUT)
    config: TierConfig = remote_config(target, CAPACITY_CHUNKS, scan_interval=0.05)
    return RemoteTier(config, LAYOUT)


async def store_forever(kind: str, target: str, seed: int) -> None:
    async with make_tier(kind, target) as tier:
        i = 0
        while True:
            ks = [chunk_key(seed, i + j) for j in range(BATCH)]
            await tier.put(ks, [expected(k) for k in ks])
            out = [np.empty(LAYOUT.chunk_bytes, np.uint8) for _ in ks]
            await tier.get(ks, out)  # reads and their recency records die mid-way too
            i += BATCH


def stored_keys(kind: str, target: str) -> list[bytes]:
    """Return every chunk key the store holds, read around the tier."""
    if kind.startswith("lmdb"):
        import lmdb

        env = lmdb.open(target, max_dbs=4, readonly=True, lock=False)
        try:
            with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
                return [bytes(k) for k in txn.cursor().iternext(values=False)]
        finally:
            env.close()
    root = Path(target.removeprefix("file://")) / LAYOUT.fingerprint.hex()
    found = [p.name for p in root.glob("??" * 2 + "/*") if not p.name.startswith(".")]
    return [bytes.fromhex(name) for name in found]


async def verify(kind: str, target: str, seed: int) -> dict[str, Any]:
    found = stored_keys(kind, target)
    async with make_tier(kind, target) as tier:
        out = [np.empty(LAYOUT.chunk_bytes, np.uint8) for _ in found]
        hits = await tier.get(found, out) if found else []
        bad = sum(
            not hit or not np.array_equal(buf, expected(k))
            for k, hit, buf in zip(found, hits, out, strict=True)
        )
        # the tier keeps working: a new batch goes in and reads back
        ks = [chunk_key(-seed - 1, j) for j in range(BATCH)]
        put = await tier.put(ks, [expected(k) for k in ks])
        back = [np.empty(LAYOUT.chunk_bytes, np.uint8) for _ in ks]
        got = await tier.get(ks, back)
        works = (
            all(put)
            and all(got)
            and all(np.array_equal(b, expected(k)) for k, b in zip(ks, back, strict=True))
        )
        return {"found": len(found), "bad": bad, "works": works, "corrupt": tier.counters.corrupt}


def _child(fn: Any) -> None:
    code = 0
    try:
        fn()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        os._exit(code)


def _fork_writer(kind: str, target: str, seed: int) -> int:
    pid = os.fork()
    if pid == 0:
        _child(lambda: asyncio.run(store_forever(kind, target, seed)))
    return pid


def _fork_verifier(kind: str, target: str, seed: int) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)

        def run() -> None:
            result = asyncio.run(verify(kind, target, seed))
            os.write(write, json.dumps(result).encode())

        _child(run)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    return text or json.dumps({"error": status})


def main() -> None:
    kind, target = sys.argv[1], sys.argv[2]
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "store":
            print(_fork_writer(kind, target, int(args[0])), flush=True)
        elif cmd == "verify":
            os.waitpid(int(args[1]), 0)
            print(_fork_verifier(kind, target, int(args[0])), flush=True)


if __name__ == "__main__":
    main()
