"""Factories shared by the reliability suite: tiers on small layouts, keys, payloads."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np

from kvtiers.core.config import TierConfig
from kvtiers.testing.tiers import SMALL_LAYOUT
from kvtiers.tiers import _chunk_format as fmt

LAYOUT = SMALL_LAYOUT
CHUNK = LAYOUT.chunk_bytes
SECRET_ENV = "KVTIERS_TEST_INTEGRITY_KEY"
SECRET = "0123456789abcdef0123456789abcdef"


def lmdb_value_bytes(*, tagged: bool = False) -> int:
    return fmt.value_bytes(LAYOUT.fingerprint, CHUNK, tagged=tagged)


def remote_value_bytes(*, tagged: bool = False) -> int:
    return fmt.value_bytes(LAYOUT.fingerprint, CHUNK, num_layers=LAYOUT.num_layers, tagged=tagged)


def lmdb_config(path: Path | str, num_chunks: int = 64, **options: Any) -> TierConfig:
    size = num_chunks * lmdb_value_bytes(tagged="integrity" in options)
    return TierConfig("lmdb", size, options={"path": str(path), **options}, index=1)


def remote_config(url: str, num_chunks: int = 64, **options: Any) -> TierConfig:
    size = num_chunks * remote_value_bytes(tagged="integrity" in options)
    return TierConfig("remote", size, options={"url": url, **options}, index=1)


def memory_url() -> str:
    return f"memory://kvtiers-reliability/{uuid.uuid4().hex[:12]}"


def keys(num: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed + 1000)
    return [rng.bytes(16) for _ in range(num)]


def payloads(num: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK, dtype=np.uint8) for _ in range(num)]


def dsts(num: int, fill: int = 7) -> list[np.ndarray]:
    return [np.full(CHUNK, fill, dtype=np.uint8) for _ in range(num)]


def integrity(**extra: Any) -> dict[str, Any]:
    """Return the options that turn integrity on with the test secret."""
    return {"integrity": "hmac-sha256", "integrity_key_env": SECRET_ENV, **extra}
