"""Prefill/decode hand-off through the pool: roles, and what a producer announces.

With prefill and decode on different vLLM instances, the pool carries the prompt's KV from
one to the other. The prefill instance (`kv_role = "kv_producer"`) stores the full chunks
of each prompt, as `kv_both` does, and returns with each finished request the number of
its prompt tokens it holds in kvtiers:

    kv_transfer_params = {"kvtiers": {"stored_tokens": N}}

A proxy passes these on with the request it sends to the decode instance, as vLLM's
disaggregated-serving proxies pass `kv_transfer_params`. The producer's saves reach the
shared tiers in the background, so the decode instance's first lookup can come before
them; the scheduler side then answers vLLM 'ask again later' and looks again (see
`SchedulerSide`). A decode instance (`kv_role = "kv_consumer"`) loads and stores nothing:
its prompts were stored by the producer, and its decode steps are not reused.

Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtiers.core.checks import is_int
from kvtiers.core.errors import ConfigError

__all__ = ["PARAMS_KEY", "Role", "announce", "announced_tokens"]

PARAMS_KEY = "kvtiers"
"""The key of kvtiers' entry in vLLM's `kv_transfer_params`."""

_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(frozen=True, slots=True)
class Role:
    """What an engine's `kv_role` lets the connector do."""

    saves: bool
    """Store what the engine computes (`kv_both`, `kv_producer`)."""
    announces: bool
    """Return the stored prompt tokens with each finished request (`kv_producer`)."""

    @classmethod
    def of(cls, kv_role: str | None) -> Role:
        """Return the role named by vLLM's `kv_role` (`None` counts as `kv_both`).

        Raises:
            ConfigError: a role vLLM does not define.
        """
        role = "kv_both" if kv_role is None else kv_role
        if role not in _ROLES:
            raise ConfigError(f"kv_role: expected one of {', '.join(_ROLES)}, got {kv_role!r}")
        return cls(saves=role != "kv_consumer", announces=role == "kv_producer")


def announce(stored_tokens: int) -> dict[str, Any]:
    """Return the `kv_transfer_params` a producer hands on for `stored_tokens` tokens."""
    return {PARAMS_KEY: {"stored_tokens": stored_tokens}}


def announced_tokens(params: Any) -> int | None:
    """Return the prompt tokens a producer announced in a request's `kv_transfer_params`.

    `None` when `params` holds no kvtiers entry (another connector's, or none).

    Raises:
        ValueError: the kvtiers entry is malformed.
    """
    if not isinstance(params, Mapping) or PARAMS_KEY not in params:
        return None
    entry = params[PARAMS_KEY]
    value = entry.get("stored_tokens") if isinstance(entry, Mapping) else None
    if not is_int(value) or value < 0:
        raise ValueError(
            f"kv_transfer_params[{PARAMS_KEY!r}]: expected {{'stored_tokens': <int >= 0>}}, "
            f"got {entry!r:.200}"
        )
    return int(value)
