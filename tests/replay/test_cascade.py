"""Capacities and policies from the command line (`kvtiers.replay.cascade`): typed errors."""

from __future__ import annotations

from typing import Any

import pytest

from kvtiers.core.errors import ConfigError
from kvtiers.replay import parse_capacity, parse_policies


@pytest.mark.parametrize(
    "text",
    [
        "9" * 5000,  # past Python's 4,300-digit limit on str-to-int conversion
        "9" * 5000 + "%",
        "1." + "0" * 5000 + "1%",
        "٥",  # Arabic-Indic digits
        "٥٠%",
        "５%",
        "5\u00a0%",
        "nan%",
        "inf",
        "-5",
        "1e3",
        "5%%",
        "",
    ],
    ids=lambda t: repr(t[:12]) + f"..{len(t)}",
)
def test_bad_capacities_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^--capacity "):
        parse_capacity(text, unique_blocks=1000, block_bytes=4096)


@pytest.mark.parametrize(
    ("text", "blocks"),
    [
        ("0" * 5000 + "7", 7),  # leading zeros are no digits past any limit
        ("7.0000000000000000000000000000%", 70),
        ("12.5%", 125),
        ("100%", 1000),
        ("250%", 2500),  # more than the unique blocks is allowed
        (" 9 ", 9),
        (str(2**53), 2**53),
    ],
)
def test_capacities_kept(text: str, blocks: int) -> None:
    assert parse_capacity(text, unique_blocks=1000, block_bytes=4096) == blocks


@pytest.mark.parametrize("value", [None, 5, ["5%"]], ids=repr)
def test_a_capacity_that_is_not_text(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^--capacity"):
        parse_capacity(value, unique_blocks=1000, block_bytes=4096)


@pytest.mark.parametrize("value", [None, 5, ["lru"]], ids=repr)
def test_policies_that_are_not_text(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^--policy"):
        parse_policies(value)
