"""The `handoff` scenario of vllm_scenarios.py: prefill and decode on two engines.

A prefill engine (`kv_role = "kv_producer"`, one output token per prompt, as a
disaggregated-serving proxy asks it) stores the prompts in a `file://` pool and returns
`kv_transfer_params` announcing what it stored. A decode engine (`kv_consumer`) gets each
prompt with those params, as the proxy passes them on. Its pool receives the producer's
objects only two seconds after the requests arrive (a producer whose saves are still on
their way): the decode engine waits for them instead of computing the prompts, loads them,
answers exactly as an engine without kvtiers, and stores nothing. Then a decode engine
whose announced KV never arrives gives up after `handoff_wait_s` and computes the prompts.
Last, `store_generated` on a consumer is refused when the engine is built.

`handoff-mp` runs after it on the same work folder: a consumer in vLLM's default mode
(scheduler and worker in separate processes, so its lookups go through the lookup
channel), whose pool gets `handoff`'s producer objects two seconds after its requests.

`handoff-tp2`: the same hand-off between two engines of tensor parallelism 2 (vLLM's
default mode, two workers each), each rank storing and loading its own shard under its own
layout. The consumer's pool gets rank 0's shards two seconds after the requests and rank
1's two seconds later: a prompt is loaded only once both ranks hold it (the scheduler's
answer is the minimum over ranks), never from one rank's shards with the other's computed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from vllm_scenarios import CHUNK, MAX_TOKENS, PREFIX_TOKENS, Engine, make_prompts

COPY_AFTER_S = 2.0


def pool(work: Path, name: str) -> dict[str, Any]:
    """DRAM over a `file://` pool in `work / name`."""
    remote = {"kind": "remote", "url": f"file://{work / name}", "capacity": "256MiB"}
    return {"tiers": [{"kind": "dram", "capacity": "64MiB"}, remote]}


def objects_in(root: Path) -> set[Path]:
    """Return the chunk objects under `root` (`.../<key[:2] hex>/<key hex>`), relative to it."""
    return {
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_file() and len(p.parent.name) == 4 and p.name.startswith(p.parent.name)
    }


def objects_by_rank(root: Path) -> dict[int, set[Path]]:
    """Return `root`'s chunk objects by the TP rank of their namespace's layout record."""
    from kvtiers.tiers._layout_record import REMOTE_NAME, decode

    ranks: dict[int, set[Path]] = {}
    for relative in objects_in(root):
        fields = decode((root / relative.parents[1] / REMOTE_NAME).read_bytes())
        if fields is None:
            raise RuntimeError(f"no layout record for {relative}")
        ranks.setdefault(fields["tp_rank"], set()).add(relative)
    return ranks


def copy_objects(source: Path, target: Path, only: set[Path] | None = None) -> None:
    """Copy `source`'s chunk objects (or `only` those) into `target`, each appearing whole."""
    for relative in sorted(objects_in(source) if only is None else only):
        dest = target / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = dest.with_name(f".{dest.name}.part")
        shutil.copyfile(source / relative, staged)
        os.replace(staged, dest)


def decode(
    engine: Engine,
    prompts: list[list[int]],
    params: list[Any],
    *,
    copy_from: Path | None = None,
    waves: list[set[Path]] | None = None,
) -> dict[str, Any]:
    """Run `prompts` with the producer's params; copy its objects in after a pause.

    With `waves`, wave `i` of `copy_from`'s objects is copied `(i + 1) * COPY_AFTER_S`
    after the requests; without, all of them after `COPY_AFTER_S`.
    """
    copiers = []
    if copy_from is not None:
        for i, wave in enumerate(waves or [objects_in(copy_from)]):
            after = (i + 1) * COPY_AFTER_S
            copiers.append(threading.Timer(after, copy_objects, (copy_from, engine.pool, wave)))
    for copier in copiers:
        copier.start()
    started = time.perf_counter()
    outputs = engine.generate(prompts, kv_transfer_params=params)
    seconds = time.perf_counter() - started
    for copier in copiers:
        copier.join()
    return {
        "outputs": outputs,
        "seconds": seconds,
        "stats": dict(engine.reported),
    }


def handoff_prompts() -> list[list[int]]:
    prompts = make_prompts(seed=5)
    rng = random.Random(6)  # and one prompt of whole chunks
    prompts.append(prompts[0][:PREFIX_TOKENS] + [rng.randrange(3, 500) for _ in range(CHUNK)])
    return prompts


def scenario_handoff(model: str, work: Path) -> dict[str, Any]:
    prompts = handoff_prompts()
    result: dict[str, Any] = {"prompt_lengths": [len(p) for p in prompts]}

    base = Engine(model, None, prefix_caching=False)
    result["baseline"] = base.generate(prompts)
    base.close()

    producer = Engine(
        model, pool(work, "pool-p"), prefix_caching=False, kv_role="kv_producer", max_tokens=1
    )
    prefilled = producer.generate(prompts)
    result["params"] = [o["kv_transfer_params"] for o in prefilled]
    (work / "params.json").write_text(json.dumps(result["params"]))  # for handoff-mp
    result["producer_stats"] = dict(producer.reported)
    producer.connector.flush(60)
    producer.close()
    result["producer_objects"] = len(objects_in(work / "pool-p"))

    handoff = {"handoff_wait_s": 60}
    consumer = Engine(
        model, pool(work, "pool-d"), prefix_caching=False, kv_role="kv_consumer", extra=handoff
    )
    consumer.pool = work / "pool-d"
    result["decode"] = decode(consumer, prompts, result["params"], copy_from=work / "pool-p")
    consumer.connector.flush(60)
    consumer.close()
    result["decode_objects"] = len(objects_in(work / "pool-d"))

    # Announced KV that never comes: the consumer gives up after handoff_wait_s.
    late = {"handoff_wait_s": 1}
    consumer = Engine(
        model, pool(work, "pool-empty"), prefix_caching=False, kv_role="kv_consumer", extra=late
    )
    result["never"] = decode(consumer, prompts, result["params"])
    consumer.close()

    try:
        Engine(
            model,
            pool(work, "pool-x"),
            prefix_caching=False,
            kv_role="kv_consumer",
            extra={"store_generated": True},
        )
        result["consumer_store_generated"] = "accepted"
    except Exception as exc:  # vLLM wraps the connector's error in its own
        result["consumer_store_generated"] = f"{type(exc).__name__}: {exc}"
    return result


def scenario_handoff_mp(model: str, work: Path) -> dict[str, Any]:
    """A consumer in vLLM's default mode, after `scenario_handoff` on the same `work`."""
    params = json.loads((work / "params.json").read_text())
    handoff = {"handoff_wait_s": 60}
    consumer = Engine(
        model, pool(work, "pool-mp"), prefix_caching=False, kv_role="kv_consumer", extra=handoff
    )
    consumer.pool = work / "pool-mp"
    result = decode(consumer, handoff_prompts(), params, copy_from=work / "pool-p")
    consumer.close()
    result["objects"] = len(objects_in(work / "pool-mp"))
    return result


def scenario_handoff_tp2(model: str, work: Path) -> dict[str, Any]:
    """The hand-off between a producer and a consumer of tensor parallelism 2."""
    from vllm_scenarios import bind_ranks

    bind_ranks(2)
    prompts = handoff_prompts()
    result: dict[str, Any] = {"prompt_lengths": [len(p) for p in prompts]}
    base = Engine(model, None, prefix_caching=False, tensor_parallel=2)
    result["baseline"] = base.generate(prompts)
    base.close()

    producer = Engine(
        model,
        pool(work, "pool-p"),
        prefix_caching=False,
        tensor_parallel=2,
        kv_role="kv_producer",
        max_tokens=1,
    )
    prefilled = producer.generate(prompts)
    params = [o["kv_transfer_params"] for o in prefilled]
    result["params"] = params
    producer.close()  # the connectors' shutdown waits for the workers' saves
    by_rank = objects_by_rank(work / "pool-p")
    result["producer_objects"] = {str(rank): len(objects) for rank, objects in by_rank.items()}

    handoff = {"handoff_wait_s": 60}
    consumer = Engine(
        model,
        pool(work, "pool-d"),
        prefix_caching=False,
        tensor_parallel=2,
        kv_role="kv_consumer",
        extra=handoff,
    )
    consumer.pool = work / "pool-d"
    waves = [by_rank.get(0, set()), by_rank.get(1, set())]
    result["decode"] = decode(consumer, prompts, params, copy_from=work / "pool-p", waves=waves)
    consumer.close()
    result["decode_objects"] = len(objects_in(work / "pool-d"))
    return result


__all__ = ["MAX_TOKENS", "scenario_handoff", "scenario_handoff_mp", "scenario_handoff_tp2"]
