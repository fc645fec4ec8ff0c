"""Shared fixtures of the core tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.core._cross_process import HASH_SEEDS, run_in_fresh_interpreters


@pytest.fixture(scope="session")
def cross_process_results() -> dict[str, dict[str, Any]]:
    """Return, per PYTHONHASHSEED, the fingerprints and keys a fresh interpreter computes.

    Computed once per session, as fresh interpreters take seconds to import kvtiers.
    """
    return run_in_fresh_interpreters(HASH_SEEDS)
