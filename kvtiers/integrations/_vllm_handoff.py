"""Prefill/decode hand-off through the pool: roles, and what a producer announces.

With prefill and decode on different vLLM instances, the pool carries the prompt's KV from
one to the other. The prefill instance (`kv_role = "kv_producer"`) stores the full chunks
of each prompt, as `kv_both` does, and returns with each finished request the number of
its prompt tokens it holds in kvtiers:

    kv_transfer_params = {"kvtiers": {"stored_tokens": N}}

The same entry carries a request's reuse hint, `{"kvtiers": {"keep_tokens": N}}`: only the
first N tokens are expected to be asked for again (`TieredCache.store`'s `keep_tokens`).

A proxy passes these on with the request it sends to the decode instance, as vLLM's
disaggregated-serving proxies pass `kv_transfer_params`. The producer's saves reach the
shared tiers in the background, so the decode instance's first lookup can come before
them; the scheduler side then answers vLLM 'ask again later' and looks again (see
`HandoffWaits`). A decode instance (`kv_role = "kv_consumer"`) loads and stores nothing:
its prompts were stored by the producer, and its decode steps are not reused.

Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtiers.core.checks import is_int
from kvtiers.core.errors import ConfigError
from kvtiers.integrations._vllm_plan import ConnectorSettings
from kvtiers.integrations._vllm_tracked import Tracked

__all__ = [
    "PARAMS_KEY",
    "HandoffWaits",
    "RequestParams",
    "Role",
    "announce",
    "announced_tokens",
    "params_of",
    "request_params",
]

logger = logging.getLogger("kvtiers.vllm")

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


@dataclass(frozen=True, slots=True)
class RequestParams:
    """What kvtiers' entry in a request's `kv_transfer_params` says."""

    stored_tokens: int | None = None
    """Prompt tokens a producer announced it holds (hand-off)."""
    keep_tokens: int | None = None
    """The reuse hint: leading tokens expected to be asked for again; None: no hint."""


_PARAMS = tuple(RequestParams.__dataclass_fields__)


def request_params(params: Any) -> RequestParams:
    """Read kvtiers' entry of a request's `kv_transfer_params`.

    Empty when `params` holds no kvtiers entry (another connector's, or none).

    Raises:
        ValueError: the kvtiers entry is malformed (not a table of `stored_tokens` and or
            `keep_tokens`, each an integer >= 0).
    """
    if not isinstance(params, Mapping) or PARAMS_KEY not in params:
        return RequestParams()
    entry = params[PARAMS_KEY]
    if (
        not isinstance(entry, Mapping)
        or not entry
        or not set(entry) <= set(_PARAMS)
        or not all(is_int(v) and v >= 0 for v in entry.values())
    ):
        raise ValueError(
            f"kv_transfer_params[{PARAMS_KEY!r}]: expected {{'stored_tokens': <int >= 0>}} "
            f"and/or {{'keep_tokens': <int >= 0>}}, got {entry!r:.200}"
        )
    return RequestParams(**{name: int(value) for name, value in entry.items()})


def params_of(request: Any, count: Callable[[str, int], None], eligible: bool) -> RequestParams:
    """Return what `request`'s `kv_transfer_params` tell kvtiers.

    Nothing for a request kvtiers does not serve (not `eligible`); a malformed entry is
    logged, counted (`handoff_bad_params`) and read as nothing.
    """
    if not eligible:
        return RequestParams()
    try:
        return request_params(getattr(request, "kv_transfer_params", None))
    except ValueError as exc:
        logger.warning("kvtiers: %s; ignored", exc)
        count("handoff_bad_params", 1)
        return RequestParams()


def announced_tokens(params: Any) -> int | None:
    """Return the prompt tokens a producer announced in a request's `kv_transfer_params`.

    `None` when `params` announces none (another connector's, no kvtiers entry, or one
    with a hint only).

    Raises:
        ValueError: the kvtiers entry is malformed.
    """
    return request_params(params).stored_tokens


class HandoffWaits:
    """Decide, lookup after lookup, how long a consumer's request waits for announced KV.

    Args:
        settings: the connector settings (`handoff_wait_s`, `handoff_poll_ms`).
        clock: monotonic seconds (the scheduler side's).
        count: adds to one of the scheduler side's counters.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        clock: Callable[[], float],
        count: Callable[[str, int], None],
    ) -> None:
        self._wait_s = settings.handoff_wait_s
        self._poll_s = settings.handoff_poll_ms / 1000
        self._clock = clock
        self._count = count

    def answer(self, tracked: Tracked, hit: int, wanted: int, computed: int) -> int | None:
        """Return the answer for a request awaiting `wanted` tokens, or None to look again.

        A producer's saves reach the shared tiers after it has answered, so the first
        lookups of a consumer can miss them. The request waits (vLLM skips it for a step)
        and is looked up again every `handoff_poll_ms`, for at most `handoff_wait_s`; then
        it loads the most that a lookup found. Tokens vLLM holds itself are not awaited.
        """
        # NOTE: before its first answer only lookups set `cached` (nothing is saved yet).
        tracked.cached = max(tracked.cached, hit)
        now = self._clock()
        if max(hit, computed) >= wanted:
            if tracked.waiting_since is not None:
                self._count("handoff_arrived", 1)
                self._count("handoff_wait_ms", round((now - tracked.waiting_since) * 1000))
            tracked.awaited = 0
            return hit
        if tracked.waiting_since is None:
            tracked.waiting_since = now
            self._count("handoff_waits", 1)
        end = tracked.waiting_since + self._wait_s
        if now < end:
            tracked.next_lookup_at = min(now + self._poll_s, end)
            return None
        logger.warning(
            "kvtiers: %d of %d announced tokens arrived within %ss; the rest is computed",
            tracked.cached,
            wanted,
            self._wait_s,
        )
        self._count("handoff_timeouts", 1)
        tracked.awaited = 0
        return tracked.cached

    def end(self, tracked: Tracked) -> float | None:
        """Return when the wait for announced KV ends (None: the request is not waiting)."""
        if not tracked.awaited or tracked.waiting_since is None:
            return None
        return tracked.waiting_since + self._wait_s
