"""Values that break naive code: nested thousands deep (recursion) or huge (int-to-text)."""

from __future__ import annotations

from typing import Any

__all__ = ["deep_dict", "deep_list"]


def deep_list(depth: int) -> list[Any]:
    """Return a list nested `depth` levels deep."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def deep_dict(depth: int, key: str = "a") -> dict[str, Any]:
    """Return a dict nested `depth` levels deep under `key`."""
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {key: value}
    return value
