"""Tier links: bandwidth and latency of reading cached KV, and how to write them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvtiers.core.checks import describe
from kvtiers.core.errors import ConfigError

__all__ = [
    "DEFAULT_LINKS",
    "MAX_LATENCY",
    "MIN_BANDWIDTH",
    "TierLink",
    "default_link",
    "parse_bandwidth",
    "parse_duration",
    "parse_tier_link",
]

_BYTE_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
# NOTE: ASCII digits and spaces only (`\d` would take "５GB/s"); `µs` is matched literally.
_BANDWIDTH_RE = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?(B|b|bit)?\s*(?:/s|ps)\s*$", re.ASCII
)
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s)\s*$", re.ASCII)

MIN_BANDWIDTH = 1.0
"""The slowest link accepted, bytes per second: below it a load's seconds leave floats."""
MAX_LATENCY = 86_400.0
"""The longest latency accepted, seconds (a day); a sum of several stays finite."""
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True, slots=True)
class TierLink:
    """How fast a tier delivers cached KV to the GPU."""

    name: str
    """Tier name or kind."""
    bandwidth: float
    """Bytes per second."""
    latency: float = 0.0
    """Seconds before the first byte of one batched read."""

    def __post_init__(self) -> None:
        if not is_real(self.bandwidth) or not self.bandwidth >= MIN_BANDWIDTH:
            raise ConfigError(
                f"tier {self.name}: bandwidth must be a finite number > 0, at least 1 B/s, "
                f"got {describe(self.bandwidth, 40)}"
            )
        if not is_real(self.latency) or not 0 <= self.latency <= MAX_LATENCY:
            raise ConfigError(
                f"tier {self.name}: latency must be a finite number of seconds from 0 to a day "
                f"(86400), got {describe(self.latency, 40)}"
            )

    def load_seconds(self, num_bytes: float) -> float:
        """Return the time to read `num_bytes` in one batch (0 for nothing)."""
        return self.latency + num_bytes / self.bandwidth if num_bytes > 0 else 0.0


def is_real(value: object) -> bool:
    """Return whether `value` is a real number (not a bool) that a float holds finitely."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the largest float
        return False


#: Defaults by tier kind (and the usual names for them): PCIe Gen5 host copies, one NVMe
#: drive, an object store over a ~10 Gb/s path. Override them with `--tier`.
DEFAULT_LINKS: dict[str, TierLink] = {
    "hbm": TierLink("hbm", 1000e9, 10e-6),
    "dram": TierLink("dram", 50e9, 20e-6),
    "lmdb": TierLink("lmdb", 5e9, 100e-6),
    "nvme": TierLink("nvme", 5e9, 100e-6),
    "remote": TierLink("remote", 1.5e9, 20e-3),
    "s3": TierLink("s3", 1.5e9, 20e-3),
    # NOTE: the pool stores sit across the network, not beside the GPU: DRAM's figures
    # would make them look as fast as local memory.
    "redis": TierLink("redis", 1.25e9, 200e-6),
    "mooncake": TierLink("mooncake", 12.5e9, 50e-6),
}


def default_link(name: str, kind: str) -> TierLink:
    """Return the default link of a tier, by its name, else its kind, else as DRAM."""
    base = DEFAULT_LINKS.get(name) or DEFAULT_LINKS.get(kind) or DEFAULT_LINKS["dram"]
    return TierLink(name, base.bandwidth, base.latency)


def parse_bandwidth(text: str, *, where: str = "bandwidth") -> float:
    """Return bytes per second from text such as `"50GB/s"`, `"12.5 GiB/s"` or `"100Gbps"`.

    A lowercase `b` or `bit` means bits.

    Raises:
        ConfigError: the text is not a bandwidth, or not one from 1 B/s to a finite one.
    """
    if not isinstance(text, str):
        raise ConfigError(f"{where}: expected a bandwidth such as '50GB/s', got {describe(text)}")
    match = _BANDWIDTH_RE.match(text)
    if match is None:
        raise ConfigError(f"{where}: expected a bandwidth such as '50GB/s', got {text!r}")
    number, prefix, unit = match.groups()
    value = float(number) * _BYTE_UNITS[(prefix or "").lower()]
    if unit in ("b", "bit"):
        value /= 8
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {text.strip()[:40]!r} is not a finite bandwidth")
    if value < MIN_BANDWIDTH:
        raise ConfigError(f"{where}: must be at least 1 B/s, got {text!r}")
    return value


def parse_duration(text: str, *, where: str = "latency") -> float:
    """Return seconds from text such as `"20us"`, `"1.5ms"` or `"0.02s"`.

    Raises:
        ConfigError: the text is not a duration, or is longer than a day.
    """
    if not isinstance(text, str):
        raise ConfigError(
            f"{where}: expected a duration such as '20us' or '5ms', got {describe(text)}"
        )
    match = _DURATION_RE.match(text)
    if match is None:
        raise ConfigError(f"{where}: expected a duration such as '20us' or '5ms', got {text!r}")
    value = float(match.group(1)) * _SECONDS[match.group(2)]
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {text.strip()[:40]!r} is not a finite duration")
    if value > MAX_LATENCY:
        raise ConfigError(f"{where}: {text.strip()[:40]!r} is longer than a day")
    return value


def parse_tier_link(text: str) -> TierLink:
    """Return a link from `NAME[:BANDWIDTH[:LATENCY]]`, e.g. `"nvme:5GB/s:100us"`.

    Missing parts come from the defaults for that name (`DEFAULT_LINKS`), else DRAM's.

    Raises:
        ConfigError: a part is malformed.
    """
    if not isinstance(text, str):
        raise ConfigError(f"--tier: expected NAME[:BANDWIDTH[:LATENCY]], got {describe(text)}")
    name, *rest = text.split(":")
    name = name.strip()
    if not name or len(rest) > 2:
        raise ConfigError(f"--tier: expected NAME[:BANDWIDTH[:LATENCY]], got {text!r}")
    base = default_link(name, name)
    bandwidth = parse_bandwidth(rest[0], where=f"--tier {name}") if rest else base.bandwidth
    latency = parse_duration(rest[1], where=f"--tier {name}") if len(rest) > 1 else base.latency
    return TierLink(name, bandwidth, latency)
