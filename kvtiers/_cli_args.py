"""Argument types shared by the `kvtiers` subcommands."""

from __future__ import annotations

import argparse
import re

__all__ = ["non_negative_int", "parse_age", "positive_int"]

_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def positive_int(text: str) -> int:
    """Parse a command-line integer >= 1 (an argparse `type`)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """Parse a command-line integer >= 0 (an argparse `type`)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def parse_age(text: str) -> float:
    """Parse an age such as 3600, 90m, 12h or 7d into seconds.

    An argparse `type`.
    """
    match = _AGE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected an age such as 3600, 90m, 12h or 7d, got {text!r}"
        )
    return float(match.group(1)) * _AGE_UNITS[match.group(2)]
