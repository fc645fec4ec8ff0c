"""A hypothesis state machine drives `TieredCache` (dram -> lmdb, small) against a dict model.

Token sequences come from a few families sharing first chunks, so chains share prefixes;
both tiers are far smaller than what is stored, so both evict all the time. The model is
the set of chunk prefixes ever stored, and the KV of a chunk is a function of its prefix,
so the model also knows every byte a load may return.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtiers import TieredCache
from tests.conftest import SMALL_LAYOUT, make_kv, same_bytes, small_layout

pytestmark = pytest.mark.reliability

LAY = small_layout()
CS = LAY.chunk_size
STEPS = {"cases": 0, "steps": 0}


def _tokens(family: int, branch: int, num_chunks: int) -> list[int]:
    """Chunk 0 is the family's; later chunks depend on the branch from chunk `family % 3`."""
    out: list[int] = []
    for c in range(num_chunks):
        owner = branch if c > family % 3 else 0
        out.extend((family * 100 + owner * 10 + c) * 64 + t for t in range(CS))
    return out


def _chunk_kv(prefix: tuple[int, ...]) -> torch.Tensor:
    seed = xxhash.xxh64_intdigest(repr(prefix).encode()) % 2**31
    return make_kv(LAY, CS, seed=seed)


def _kv(tokens: list[int]) -> torch.Tensor:
    parts = [_chunk_kv(tuple(tokens[: (i + 1) * CS])) for i in range(len(tokens) // CS)]
    return torch.cat(parts, dim=2) if parts else make_kv(LAY, 0)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        STEPS["cases"] += 1
        self.dir = tempfile.mkdtemp(prefix="kvtiers-stateful-")
        cfg = {
            "layout": SMALL_LAYOUT,
            "tiers": [
                {"kind": "dram", "capacity": 4 * LAY.chunk_bytes},
                {
                    "kind": "lmdb",
                    "path": f"{self.dir}/db",
                    "capacity": 10 * (LAY.chunk_bytes + 200),
                },
            ],
        }
        self.runner = asyncio.Runner()
        self.cache = TieredCache.from_config(cfg)
        self.runner.run(self.cache.open())
        self.stored: set[tuple[int, ...]] = set()  # chunk prefixes ever stored

    def teardown(self) -> None:
        try:
            self.runner.run(self.cache.close())
        finally:
            self.runner.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self, coro: Any) -> Any:
        STEPS["steps"] += 1
        return self.runner.run(coro)

    seqs = st.builds(_tokens, st.integers(0, 3), st.integers(0, 2), st.integers(1, 5))

    @rule(tokens=seqs, tail=st.integers(0, CS - 1))
    def store(self, tokens: list[int], tail: int) -> None:
        tokens = tokens + list(range(tail))  # a partial tail chunk is never stored
        kv = torch.cat([_kv(tokens[: len(tokens) - tail]), make_kv(LAY, tail)], dim=2)
        new = self._run(self.cache.store(tokens, kv))
        prefixes = [tuple(tokens[: (i + 1) * CS]) for i in range(len(tokens) // CS)]
        # chunks evicted from every tier count as new again, so only bounds hold
        assert 0 <= new <= CS * len(prefixes) and new % CS == 0
        self.stored.update(prefixes)

    @rule(tokens=seqs)
    def lookup_then_load(self, tokens: list[int]) -> None:
        n = self._run(self.cache.lookup(tokens))
        assert n % CS == 0 and n <= len(tokens)
        for i in range(n // CS):  # never a chunk the model lacks
            assert tuple(tokens[: (i + 1) * CS]) in self.stored
        out = self._run(self.cache.load(tokens))
        m = out.shape[2]
        assert m == n, (m, n)  # nothing ran in between: what lookup saw, load delivers
        assert same_bytes(out, _kv(tokens[:m]))

    @rule(tokens=seqs)
    def load(self, tokens: list[int]) -> None:
        out = self._run(self.cache.load(tokens))
        m = out.shape[2]
        for i in range(m // CS):
            assert tuple(tokens[: (i + 1) * CS]) in self.stored
        assert same_bytes(out, _kv(tokens[:m]))

    @precondition(lambda self: bool(self.stored))
    @rule()
    def flush(self) -> None:
        self._run(self.cache.flush())

    @invariant()
    def pins_released_when_idle(self) -> None:
        # queued write-through chunks keep their DRAM block pinned until written
        self._run(self.cache.flush())
        assert self.cache.pin_count() == 0

    @invariant()
    def within_capacity(self) -> None:
        for tier in self.cache.stats().tiers:
            assert tier.usage.used_bytes <= tier.usage.capacity_bytes


CacheMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
