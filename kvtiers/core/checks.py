"""Checks of integer settings, shared by everything that validates a config or a model file."""

from __future__ import annotations

from typing import TypeGuard

from kvtiers.core.errors import ConfigError

__all__ = ["MAX_DIM", "check_int", "is_int"]

MAX_DIM = 2**31 - 1
"""The largest dimension (layers, heads, head size, tokens, context) accepted: 32 bits, as
engines' own."""


def is_int(value: object) -> TypeGuard[int]:
    """Return whether `value` is an integer (`True` and `False` are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int, maximum: int = MAX_DIM) -> int:
    """Return `value` if it is an integer in [`minimum`, `maximum`].

    Raises:
        ConfigError: it is not; the message names the field `name`.
    """
    if not is_int(value) or not minimum <= value <= maximum:
        raise ConfigError(
            f"{name}: expected an integer in [{minimum}, {maximum}], got {value!r:.40}"
        )
    return value
