"""Shared factories for the test suite."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtiers import KVLayout

SMALL_LAYOUT = {
    "model": "test-model",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_size": 8,
    "dtype": "float16",
    "chunk_size": 16,
}


def small_layout(**overrides: Any) -> KVLayout:
    """Return a small layout (2 KiB chunks) for tests."""
    return KVLayout(**{**SMALL_LAYOUT, **overrides})


def make_config(
    tmp_path: Path | None = None,
    *,
    dram_chunks: int = 32,
    lmdb_chunks: int | None = None,
    write_policy: str = "write_through",
    eviction: str = "lru",
    layout: dict[str, Any] | None = None,
    lmdb_dir: str = "lmdb",
) -> dict[str, Any]:
    """Return a config dict: a DRAM tier, and an LMDB tier below it when asked."""
    lay = {**SMALL_LAYOUT, **(layout or {})}
    chunk_bytes = small_layout(**(layout or {})).chunk_bytes
    tiers: list[dict[str, Any]] = [
        {"kind": "dram", "capacity": dram_chunks * chunk_bytes, "eviction": eviction}
    ]
    if lmdb_chunks is not None:
        assert tmp_path is not None
        tiers.append(
            {
                "kind": "lmdb",
                "path": str(tmp_path / lmdb_dir),
                # room for headers: capacity counts whole stored values
                "capacity": lmdb_chunks * (chunk_bytes + 256),
                "write_policy": write_policy,
            }
        )
    return {"layout": lay, "tiers": tiers}


def make_kv(layout: KVLayout, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Return random KV of `num_tokens` tokens for `layout`."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(
        0,
        256,
        (*layout.kv_shape(num_tokens)[:-1], layout.head_size * layout.itemsize),
        generator=gen,
        dtype=torch.uint8,
    )
    return data.view(getattr(torch, layout.dtype))


@pytest.fixture
def layout() -> KVLayout:
    return small_layout()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Return whether two tensors hold bit-identical data (NaN patterns included)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--schedule-seeds",
        default="",
        metavar="SPEC",
        help=(
            "seeds of the concurrency schedules (tests/test_cache_concurrency.py): "
            "comma-separated seeds, or random:N for N fresh ones; a hunt for races "
            "(docs/reliability.md). Default: the fixed seeds."
        ),
    )


def schedule_seeds(config: pytest.Config, default: list[int]) -> list[int]:
    """Return the seeds `--schedule-seeds` asks for, or `default`."""
    spec = str(config.getoption("schedule_seeds")).strip()
    if not spec:
        return default
    if spec.startswith("random:"):
        draw = random.SystemRandom()
        return [draw.randrange(2**32) for _ in range(int(spec.removeprefix("random:")))]
    return [int(part) for part in spec.split(",")]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip CUDA-marked tests on machines without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
