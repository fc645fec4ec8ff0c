"""Argument types shared by the `kvtiers` subcommands."""

from __future__ import annotations

import argparse
import math
import re

from kvtiers.core.checks import describe

__all__ = ["non_negative_int", "parse_age", "positive_int"]

_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# NOTE: [0-9], not \d: int() and float() also take other scripts' digits, "1_000" and signs.
_AGE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_DIGITS_RE = re.compile(r"[0-9]+")


def positive_int(text: str) -> int:
    """Parse a command-line integer >= 1, in ASCII digits (an argparse `type`)."""
    value = _digits(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {describe(text)}")
    return value


def non_negative_int(text: str) -> int:
    """Parse a command-line integer >= 0, in ASCII digits (an argparse `type`)."""
    value = _digits(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {describe(text)}")
    return value


def _digits(text: str) -> int | None:
    """Return the integer `text` spells in ASCII digits only, or `None`."""
    if not _DIGITS_RE.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than Python turns into an int
        return None


def parse_age(text: str) -> float:
    """Parse an age such as 3600, 90m, 12h or 7d into seconds.

    An argparse `type`.
    """
    match = _AGE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected an age such as 3600, 90m, 12h or 7d, got {describe(text)}"
        )
    seconds = float(match.group(1)) * _AGE_UNITS[match.group(2)]
    if not math.isfinite(seconds):  # hundreds of digits read as a float: inf
        raise argparse.ArgumentTypeError(f"expected an age of finite length, got {describe(text)}")
    return seconds
