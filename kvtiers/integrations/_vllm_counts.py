"""The names of the vLLM connector's counters, with what each counts.

The scheduler side and the worker side count into `Counters` limited to these names, so a
counter that vLLM's Prometheus endpoint (`_vllm_prom`) would not export cannot be added by
mistake. `hits_<tier>` (chunks served per tier) and `loaded_bytes` are derived when the
worker's counters are taken. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["COUNTERS", "HITS_PREFIX"]

HITS_PREFIX = "hits_"
"""Prefix of the per-tier counters: `hits_<tier>` is chunks served by that tier."""

COUNTERS: Mapping[str, str] = {
    "lookups": "Lookups the scheduler started.",
    "lookup_tokens": "Prompt tokens looked up.",
    "lookup_hit_tokens": "Tokens the lookups found cached.",
    "lookup_retries": "Scheduler calls answered 'ask again later' while a lookup ran.",
    "lookup_timeouts": "Lookups that ran past lookup_deadline_s (served as misses).",
    "lookup_errors": "Lookups that failed (served as misses).",
    "planned_load_tokens": "Tokens planned to load into vLLM's blocks.",
    "planned_save_tokens": "Tokens planned to save from vLLM's blocks.",
    "loaded_tokens": "Tokens loaded into vLLM's blocks.",
    "loaded_bytes": "Bytes loaded into vLLM's blocks.",
    "load_wait_seconds": "Seconds the forward pass waited for loads.",
    "load_errors": "Loads that failed (vLLM recomputed their blocks).",
    "load_failed_tokens": "Tokens of failed loads, recomputed by vLLM.",
    "load_failed_requests": "Requests whose asynchronous load failed (recomputed whole).",
    "saved_tokens": "Tokens saved that no tier held before.",
    "saved_bytes": "Bytes saved.",
    "save_errors": "Saves that failed.",
    "state_saves": "Recurrent states of a state-space model saved.",
    "state_saves_missed": "Recurrent states not saved: vLLM's block for one was gone.",
    "state_loads": "Recurrent states loaded into vLLM's blocks.",
    "saves_skipped": "Saves skipped past max_pending_saves.",
    "resets": "Resets of the cache with vLLM's prefix cache.",
    "handoff_waits": "Requests that waited for KV a producer announced.",
    "handoff_arrived": "Waits that ended with the announced KV found.",
    "handoff_wait_ms": "Milliseconds requests waited for announced KV.",
    "handoff_timeouts": "Waits that ran past handoff_wait_s.",
    "handoff_bad_params": "Requests with kv_transfer_params kvtiers could not read.",
    "kv_events": "KV events handed to vLLM's publisher.",
    "kv_events_unnamed": "Stored chunks with no vLLM block hashes to name them by.",
    "kv_events_unconfirmed": "KV events dropped before every rank reported them.",
}
"""The counters of `KVTiersConnectorStats`, with their help texts."""
