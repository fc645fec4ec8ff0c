"""Checks of settings, shared by everything that validates a config or a model file."""

from __future__ import annotations

import reprlib
from typing import Any, TypeGuard

from kvtiers.core.errors import ConfigError

__all__ = ["MAX_BYTES", "MAX_DIM", "check_int", "describe", "is_int"]

MAX_DIM = 2**31 - 1
"""The largest dimension (layers, heads, head size, tokens, context) accepted: 32 bits, as
engines' own."""

MAX_BYTES = 2**60
"""The largest byte count accepted (1 EiB): no tier holds more, and more overflows C sizes
downstream."""

# NOTE: Python refuses to turn an int of more than 4,300 digits into text (ValueError);
# 14,000 bits is about 4,215 digits.
_MAX_SHOWN_BITS = 14_000


class _ShortRepr(reprlib.Repr):
    """A repr bounded in size and depth, and safe for any integer."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = self.maxlong = 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > _MAX_SHOWN_BITS:
            digits = int(x.bit_length() * 0.30103)  # log10(2)
            return f"<{'a negative' if x < 0 else 'an'} integer of about {digits:,} digits>"
        return str(super().repr_int(x, level))

    def repr_instance(self, x: Any, level: int) -> str:
        # NOTE: this calls the value's own __repr__, which reprlib guards against raising
        # but not against a placeholder with an address in it (not reproducible).
        text = str(super().repr_instance(x, level))
        return f"<{type(x).__name__}>" if text.endswith(f" instance at {id(x):#x}>") else text


_SHORT_REPR = _ShortRepr()


def describe(value: object, limit: int = 60) -> str:
    """Return a short repr of `value` for an error message, whatever it is.

    Bounded in length (about `limit` characters) and in work: a huge integer, a structure
    nested thousands deep or sharing itself, or a `__repr__` that raises never turns the
    error being reported into another one.
    """
    try:
        text = _SHORT_REPR.repr(value)
    except Exception:  # a RecursionError or ValueError from a hostile value
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
            f"{name}: expected an integer in [{minimum}, {maximum}], got {describe(value)}"
        )
    return value
