"""Tier links: bandwidth and latency of reading cached KV, and how to write them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvtiers.core.errors import ConfigError

__all__ = [
    "DEFAULT_LINKS",
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
_BANDWIDTH_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?(B|b|bit)?\s*(?:/s|ps)\s*$")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s)\s*$")
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
        if not _is_finite(self.bandwidth) or not self.bandwidth > 0:
            raise ConfigError(
                f"tier {self.name}: bandwidth must be a finite number > 0, "
                f"got {self.bandwidth!r:.40}"
            )
        if not _is_finite(self.latency) or not self.latency >= 0:
            raise ConfigError(
                f"tier {self.name}: latency must be a finite number >= 0, got {self.latency!r:.40}"
            )

    def load_seconds(self, num_bytes: float) -> float:
        """Return the time to read `num_bytes` in one batch (0 for nothing)."""
        return self.latency + num_bytes / self.bandwidth if num_bytes > 0 else 0.0


def _is_finite(value: object) -> bool:
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
}


def default_link(name: str, kind: str) -> TierLink:
    """Return the default link of a tier, by its name, else its kind, else as DRAM."""
    base = DEFAULT_LINKS.get(name) or DEFAULT_LINKS.get(kind) or DEFAULT_LINKS["dram"]
    return TierLink(name, base.bandwidth, base.latency)


def parse_bandwidth(text: str, *, where: str = "bandwidth") -> float:
    """Return bytes per second from text such as `"50GB/s"`, `"12.5 GiB/s"` or `"100Gbps"`.

    A lowercase `b` or `bit` means bits.

    Raises:
        ConfigError: the text is not a bandwidth, or not a finite one.
    """
    match = _BANDWIDTH_RE.match(text)
    if match is None:
        raise ConfigError(f"{where}: expected a bandwidth such as '50GB/s', got {text!r}")
    number, prefix, unit = match.groups()
    value = float(number) * _BYTE_UNITS[(prefix or "").lower()]
    if unit in ("b", "bit"):
        value /= 8
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {text.strip()[:40]!r} is not a finite bandwidth")
    if value <= 0:
        raise ConfigError(f"{where}: must be > 0, got {text!r}")
    return value


def parse_duration(text: str, *, where: str = "latency") -> float:
    """Return seconds from text such as `"20us"`, `"1.5ms"` or `"0.02s"`.

    Raises:
        ConfigError: the text is not a duration, or not a finite one.
    """
    match = _DURATION_RE.match(text)
    if match is None:
        raise ConfigError(f"{where}: expected a duration such as '20us' or '5ms', got {text!r}")
    value = float(match.group(1)) * _SECONDS[match.group(2)]
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {text.strip()[:40]!r} is not a finite duration")
    return value


def parse_tier_link(text: str) -> TierLink:
    """Return a link from `NAME[:BANDWIDTH[:LATENCY]]`, e.g. `"nvme:5GB/s:100us"`.

    Missing parts come from the defaults for that name (`DEFAULT_LINKS`), else DRAM's.

    Raises:
        ConfigError: a part is malformed.
    """
    name, *rest = text.split(":")
    name = name.strip()
    if not name or len(rest) > 2:
        raise ConfigError(f"--tier: expected NAME[:BANDWIDTH[:LATENCY]], got {text!r}")
    base = default_link(name, name)
    bandwidth = parse_bandwidth(rest[0], where=f"--tier {name}") if rest else base.bandwidth
    latency = parse_duration(rest[1], where=f"--tier {name}") if len(rest) > 1 else base.latency
    return TierLink(name, bandwidth, latency)
