"""Settle the vLLM worker's asynchronous loads: each request is written whole, or fails.

Under vLLM's hybrid KV-cache manager loads run outside the forward pass and vLLM takes no
block-level load errors, so an ended load either delivered every planned token, and is
written into every layer at once (`write_whole`, with a state-space model's states after
the KV), or it is given up, and vLLM recomputes the whole request. `WorkerSide.take_loads`
decides when a load has ended (or outlived `load_timeout_s`); this module settles it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtiers.integrations._staging import StagingTensors
from kvtiers.integrations._vllm_loads import LayerSet, Load, write_whole
from kvtiers.integrations._vllm_mamba import StateStore

__all__ = ["settle_whole"]

logger = logging.getLogger("kvtiers.vllm")


def settle_whole(
    job: Load,
    kv: LayerSet,
    staging: StagingTensors,
    states: StateStore | None,
    count: Callable[[str, float], None],
) -> bool:
    """Write an ended asynchronous load into vLLM's blocks; return whether it was written.

    A load that came up short, failed, or is still running (it outlived its deadline) is
    cancelled instead, its request's states are dropped, and the failure is logged and
    counted.

    Args:
        job: the load, ended or past its deadline.
        kv: vLLM's layers.
        staging: where the load staged (its tensor is released once written).
        states: a state-space model's states, written with the KV (none: no states).
        count: adds to one of the worker's counters.
    """
    spec = job.spec
    try:
        loaded = job.future.result(timeout=0)
        if loaded < spec.end:
            raise RuntimeError(f"{loaded} of {spec.end} tokens found")
        write_whole(kv, job)
        if spec.state_blocks and states is not None:  # one with the other
            states.write(spec)
        staging.release(job.staging, job.future)
        count("loaded_tokens", spec.end - spec.start)
    except Exception as exc:
        job.future.cancel()
        if states is not None:
            states.drop(spec.req_id)
        logger.warning("kvtiers: a load failed (%s); vLLM recomputes", exc)
        count("load_errors", 1)
        count("load_failed_tokens", spec.end - spec.start)
        return False
    return True
