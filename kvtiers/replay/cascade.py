"""Build the simulated tier cascades from command-line values and configs."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from kvtiers.core.checks import describe
from kvtiers.core.config import CacheConfig, parse_size
from kvtiers.core.errors import ConfigError
from kvtiers.eviction import available_policies
from kvtiers.replay.simulate import TierSpec

__all__ = ["from_config", "parse_capacity", "parse_policies", "single_tier"]

#: The largest capacity a replay takes, in blocks (the policies size their parts in floats).
MAX_CAPACITY_BLOCKS = 2**53
# NOTE: ASCII only: `\d` would take other scripts' digits ("٥٠%").
_SHARE_RE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*%\s*$", re.ASCII)
_BLOCKS_RE = re.compile(r"^\s*(\d+)\s*$", re.ASCII)
_MAX_DIGITS = 20  # of a whole number or its decimals: past 2**53 blocks, or below one


def parse_policies(text: str) -> list[str]:
    """Return policy names from a comma list, or every shipped policy for `"all"`.

    LRU, the baseline, comes first; the rest keep their order.

    Raises:
        ConfigError: an unknown name.
    """
    if not isinstance(text, str):
        raise ConfigError(f"--policy: expected a comma list of policies, got {describe(text)}")
    known = available_policies()
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        names = known
    if not names:
        raise ConfigError("--policy: expected a comma list of policies, or 'all'")
    for name in names:
        if name not in known:
            raise ConfigError(
                f"--policy: unknown policy {name!r}; expected one of {', '.join(known)} or all"
            )
    unique = list(dict.fromkeys(names))
    return sorted(unique, key=lambda n: n != "lru")


def parse_capacity(text: str, *, unique_blocks: int, block_bytes: int | None) -> int:
    """Return a capacity in blocks from `"9140"` (blocks), `"5%"` or `"16GiB"`.

    A share is of the trace's unique blocks, rounded down. Bytes need `block_bytes`.

    Raises:
        ConfigError: malformed, below one block, above `MAX_CAPACITY_BLOCKS`, or bytes
            without a layout.
    """
    if not isinstance(text, str):
        raise ConfigError(
            f"--capacity: expected blocks (9140), a share (5%) or a size (16GiB), "
            f"got {describe(text)}"
        )
    where = f"--capacity {text.strip()[:40]!r}"
    if match := _BLOCKS_RE.match(text):
        blocks = math.floor(_number(match.group(1), None, where))
    elif match := _SHARE_RE.match(text):
        # NOTE: exact arithmetic, so 10% of 43,920 is 4,392 and not 4,391.
        whole, decimals = match.groups()
        blocks = math.floor(_number(whole, decimals, where) * unique_blocks / 100)
    else:
        num_bytes = parse_size(text.strip(), where=where)
        if block_bytes is None:
            raise ConfigError(
                f"{where}: a size in bytes needs the KV layout; pass --model or a --config "
                "with a [layout], or give blocks (9140) or a share (5%)"
            )
        blocks = num_bytes // block_bytes
    if blocks < 1:
        raise ConfigError(f"{where}: is less than one block")
    if blocks > MAX_CAPACITY_BLOCKS:
        raise ConfigError(f"{where}: is more than 2**53 blocks")
    return blocks


def _number(whole: str, decimals: str | None, where: str) -> Fraction:
    """Return a decimal number exactly, within Python's limit on digits."""
    whole = whole.lstrip("0") or "0"
    decimals = (decimals or "").rstrip("0")
    if len(whole) > _MAX_DIGITS:
        raise ConfigError(f"{where}: is more than 2**53 blocks")
    if len(decimals) > _MAX_DIGITS:
        raise ConfigError(f"{where}: more than {_MAX_DIGITS} decimals")
    return Fraction(int(whole + decimals), 10 ** len(decimals))


def single_tier(capacity_blocks: int, policy: str) -> list[TierSpec]:
    """Return one DRAM tier of `capacity_blocks` evicted by `policy`."""
    return [TierSpec("dram", capacity_blocks, policy)]


def from_config(
    config: CacheConfig,
    *,
    block_bytes: int,
    policy: str | None = None,
    top_capacity: int | None = None,
) -> list[TierSpec]:
    """Return the cascade of a cache config, each capacity in blocks of `block_bytes`.

    Args:
        config: the tiers, top first.
        block_bytes: bytes of one trace block.
        policy: the top tier's policy instead of its configured one.
        top_capacity: the top tier's capacity in blocks instead of its configured one.

    Raises:
        ConfigError: a tier holds less than one block, or names an unknown policy.
    """
    specs: list[TierSpec] = []
    for tc in config.tiers:
        top = tc.index == 0
        blocks = (
            top_capacity if top and top_capacity is not None else tc.capacity_bytes // block_bytes
        )
        if blocks < 1:
            raise ConfigError(
                f"{tc.where}.capacity: {tc.capacity_bytes:,} B is less than one "
                f"{block_bytes:,}-byte block"
            )
        name = policy if top and policy is not None else tc.eviction
        if name not in available_policies():
            raise ConfigError(
                f"{tc.where}.eviction: unknown policy {name!r}; expected one of "
                f"{', '.join(available_policies())}"
            )
        specs.append(TierSpec(tc.name, blocks, name, tc.kind, tc.write_policy))
    return specs
