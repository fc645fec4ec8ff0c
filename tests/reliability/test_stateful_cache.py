"""Hypothesis state machines drive `TieredCache` (small tiers) against a dict model.

Token sequences come from a few families sharing first chunks, so chains share prefixes;
the tiers are far smaller than what is stored, so they evict all the time. The model is
the set of chunk prefixes ever stored, and the KV of a chunk is a function of its prefix,
so the model also knows every byte a load may return. One machine runs dram -> lmdb; the
other puts an HBM tier (its CPU seam) on top and makes some of its copies fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtiers import TieredCache, TierIOError
from kvtiers.tiers.blocks import BlockTier
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


SEQS = st.builds(_tokens, st.integers(0, 3), st.integers(0, 2), st.integers(1, 5))


class CacheMachine(RuleBasedStateMachine):
    def tiers(self) -> list[dict[str, Any]]:
        return [
            {"kind": "dram", "capacity": 4 * LAY.chunk_bytes},
            {"kind": "lmdb", "path": f"{self.dir}/db", "capacity": 10 * (LAY.chunk_bytes + 200)},
        ]

    def __init__(self) -> None:
        super().__init__()
        STEPS["cases"] += 1
        self.dir = tempfile.mkdtemp(prefix="kvtiers-stateful-")
        cfg = {"layout": SMALL_LAYOUT, "tiers": self.tiers()}
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

    @rule(tokens=SEQS, tail=st.integers(0, CS - 1))
    def store(self, tokens: list[int], tail: int) -> None:
        tokens = tokens + list(range(tail))  # a partial tail chunk is never stored
        kv = torch.cat([_kv(tokens[: len(tokens) - tail]), make_kv(LAY, tail)], dim=2)
        new = self._run(self.cache.store(tokens, kv))
        prefixes = [tuple(tokens[: (i + 1) * CS]) for i in range(len(tokens) // CS)]
        # chunks evicted from every tier count as new again, so only bounds hold
        assert 0 <= new <= CS * len(prefixes) and new % CS == 0
        self.stored.update(prefixes)

    @rule(tokens=SEQS)
    def lookup_then_load(self, tokens: list[int]) -> None:
        n = self._run(self.cache.lookup(tokens))
        assert n % CS == 0 and n <= len(tokens)
        for i in range(n // CS):  # never a chunk the model lacks
            assert tuple(tokens[: (i + 1) * CS]) in self.stored
        out = self._run(self.cache.load(tokens))
        m = out.shape[2]
        assert m == n, (m, n)  # nothing ran in between: what lookup saw, load delivers
        assert same_bytes(out, _kv(tokens[:m]))

    @rule(tokens=SEQS)
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

    @invariant()
    def index_knows_block_tiers_exactly(self) -> None:
        index = self.cache._index
        for idx, tier in enumerate(self.cache.tiers):
            if isinstance(tier, BlockTier):
                assert set(index.keys_in(idx)) == set(tier.resident_keys()), tier.name


class HBMCacheMachine(CacheMachine):
    def tiers(self) -> list[dict[str, Any]]:
        hbm = {"kind": "hbm", "capacity": 3 * LAY.chunk_bytes, "device": "cpu"}
        return [hbm, *super().tiers()]

    def _failing_copies(self) -> Any:
        """Make the HBM tier's copies fail until the returned context exits."""
        hbm = self.cache.tiers[0]

        async def failing(pairs: Any) -> None:
            raise TierIOError("hbm tier: copy failed: injected")

        @contextlib.contextmanager
        def context() -> Iterator[None]:
            hbm.copy_views = failing
            try:
                yield
            finally:
                del hbm.copy_views

        return context()

    @rule(tokens=SEQS)
    def load_while_device_copies_fail(self, tokens: list[int]) -> None:
        """A shorter load, never an exception; no residency forgotten (the invariant)."""
        with self._failing_copies():
            out = self._run(self.cache.load(tokens))
        assert same_bytes(out, _kv(tokens[: out.shape[2]]))

    @rule(tokens=SEQS)
    def store_while_device_copies_fail(self, tokens: list[int]) -> None:
        """Nothing reaches HBM; the store returns what it stored, never an exception."""
        with self._failing_copies():
            new = self._run(self.cache.store(tokens, _kv(tokens)))
        assert 0 <= new <= len(tokens) and new % CS == 0
        self.stored.update(tuple(tokens[: (i + 1) * CS]) for i in range(len(tokens) // CS))


_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
CacheMachine.TestCase.settings = _SETTINGS
HBMCacheMachine.TestCase.settings = _SETTINGS
TestCacheMachine = CacheMachine.TestCase
TestHBMCacheMachine = HBMCacheMachine.TestCase
