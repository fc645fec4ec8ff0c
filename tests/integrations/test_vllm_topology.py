"""Which engine shapes the vLLM connector accepts (vLLM's own KV-cache spec classes).

The check runs in the vLLM virtualenv (a subprocess: the dev environment has no vLLM);
the engine configs are stand-ins with only the fields the check reads.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.integrations.conftest import scenario_env

pytestmark = pytest.mark.slow

_CHECK = textwrap.dedent(
    """
    import json
    from types import SimpleNamespace as NS

    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec, CrossAttentionSpec, FullAttentionSpec, KVCacheGroupSpec,
        MambaSpec, RSWASpec, SlidingWindowSpec,
    )

    from kvtiers.integrations._vllm_topology import Topology

    dims = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    full = KVCacheGroupSpec(["layers.0.attn"], FullAttentionSpec(**dims))
    window = KVCacheGroupSpec(["layers.1.attn"], SlidingWindowSpec(**dims, sliding_window=64))
    rswa = KVCacheGroupSpec(["layers.0.attn"], RSWASpec(**dims, rswa_window=64))
    narrow = KVCacheGroupSpec(["layers.2.attn"], SlidingWindowSpec(**dims, sliding_window=32))
    local = KVCacheGroupSpec(
        ["layers.1.attn"], ChunkedLocalAttentionSpec(**dims, attention_chunk_size=64)
    )
    local_96 = KVCacheGroupSpec(
        ["layers.2.attn"], ChunkedLocalAttentionSpec(**dims, attention_chunk_size=96)
    )
    cross = KVCacheGroupSpec(["layers.1.attn"], CrossAttentionSpec(**dims))
    mamba = KVCacheGroupSpec(
        ["layers.1.mixer"], MambaSpec(block_size=16, shapes=((2, 8),), dtypes=(torch.float16,))
    )
    def aligned(*names):
        spec = MambaSpec(
            block_size=16, shapes=((2, 8),), dtypes=(torch.float16,), mamba_cache_mode="align"
        )
        return KVCacheGroupSpec(list(names), spec)

    wide = KVCacheGroupSpec(
        ["layers.1.attn"], SlidingWindowSpec(**{**dims, "block_size": 32}, sliding_window=64)
    )

    def config(**parallel):
        fields = dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0)
        return NS(parallel_config=NS(**{**fields, **parallel}), cache_config=NS(block_size=16))

    def outcome(vllm_config, groups, store_generated=False):
        try:
            t = Topology.of(
                vllm_config, NS(kv_cache_groups=groups), store_generated=store_generated
            )
        except ValueError as exc:
            return {"error": str(exc)}
        return {
            "tp": t.tp_size, "pp": t.pp_size, "dp": t.dp_rank, "ranks": t.num_ranks,
            "window": t.window, "hybrid": t.hybrid, "groups": t.layer_groups,
            "attention_chunk": t.attention_chunk, "mamba_groups": list(t.mamba_groups),
            "mamba_layers": sorted(t.mamba_layers),
        }

    print(json.dumps({
        "full": outcome(config(tensor_parallel_size=2, pipeline_parallel_size=2,
                               data_parallel_rank=1), [full]),
        "hybrid": outcome(config(), [full, window, narrow]),
        "hybrid_generated": outcome(config(), [full, window], store_generated=True),
        "window": outcome(config(), [window]),
        "local": outcome(config(), [full, local]),
        "locals": outcome(config(), [full, local, local_96]),
        "local_generated": outcome(config(), [full, local], store_generated=True),
        "cross": outcome(config(), [full, cross]),
        "mamba": outcome(config(), [full, mamba]),
        "mamba_align": outcome(
            config(), [aligned("layers.0.mixer", "layers.2.mixer"), full, aligned("layers.3.mixer")]
        ),
        "mamba_generated": outcome(config(), [full, aligned("layers.1.mixer")], True),
        "block_sizes": outcome(config(), [full, wide]),
        "pcp": outcome(config(prefill_context_parallel_size=2), [full]),
        "dcp": outcome(config(decode_context_parallel_size=2), [full]),
        "rswa_prompts": outcome(config(), [rswa]),
        "rswa_generated": outcome(config(), [rswa], store_generated=True),
        "full_generated": outcome(config(), [full], store_generated=True),
    }))
    """
)


def test_full_sliding_and_chunked_local_attention_are_accepted_and_the_rest_refused(
    vllm_python: Path,
) -> None:
    done = subprocess.run(
        [str(vllm_python), "-c", _CHECK],
        capture_output=True,
        text=True,
        env=scenario_env(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["full"] == {
        "tp": 2, "pp": 2, "dp": 1, "ranks": 4, "window": None, "hybrid": False, "groups": {},
        "attention_chunk": None, "mamba_groups": [], "mamba_layers": [],
    }  # fmt: skip
    # vLLM's hybrid KV-cache manager: each layer's group, and the smallest window.
    hybrid = got["hybrid"]
    assert hybrid["window"] == 32 and hybrid["hybrid"]
    assert hybrid["groups"] == {"layers.0.attn": 0, "layers.1.attn": 1, "layers.2.attn": 2}
    assert got["window"]["window"] == 64 and got["window"]["groups"] == {}
    assert "store_generated = false" in got["hybrid_generated"]["error"]
    # Chunked local attention (Llama 4): the attention chunk bounds the chunk size.
    assert got["local"]["attention_chunk"] == 64 and got["local"]["hybrid"]
    assert got["local"]["window"] is None
    assert got["locals"]["attention_chunk"] == 32  # every chunk must divide 64 and 96
    assert "store_generated = false" in got["local_generated"]["error"]
    assert "chunked-local-attention model" in got["local_generated"]["error"]
    # Only encoder-decoder models have cross-attention, and vLLM takes no connector there.
    assert "CrossAttentionSpec" in got["cross"]["error"]
    assert "encoder-decoder" in got["cross"]["error"]
    assert "--disable-hybrid-kv-cache-manager" not in got["cross"]["error"]
    # vLLM runs a state-space model only under its hybrid manager, so turning it off is
    # no way out: kvtiers pools the state where vLLM keeps it per block (align mode).
    assert "MambaSpec" in got["mamba"]["error"]
    assert "--mamba-cache-mode align" in got["mamba"]["error"]
    assert "without the kvtiers connector" in got["mamba"]["error"]
    assert "--disable-hybrid-kv-cache-manager" not in got["mamba"]["error"]
    aligned = got["mamba_align"]
    assert aligned["mamba_groups"] == [0, 2] and aligned["hybrid"]
    assert aligned["mamba_layers"] == ["layers.0.mixer", "layers.2.mixer", "layers.3.mixer"]
    assert "state-space model" in got["mamba_generated"]["error"]
    assert "store_generated = false" in got["mamba_generated"]["error"]
    assert "block size in every KV-cache group, got [16, 32]" in got["block_sizes"]["error"]
    assert "prefill_context_parallel_size > 1" in got["pcp"]["error"]
    assert "decode_context_parallel_size > 1" in got["dcp"]["error"]
    # R-SWA keeps the prompt's KV (stored), not generated tokens' out of its window.
    assert got["rswa_prompts"]["ranks"] == 1 and got["full_generated"]["ranks"] == 1
    assert "store_generated = false" in got["rswa_generated"]["error"]
