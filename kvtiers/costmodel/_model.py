"""Models and accelerators: what prefill costs, from shapes and peak throughput."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from kvtiers.core.checks import MAX_BYTES, MAX_DIM, check_int, describe
from kvtiers.core.errors import ConfigError
from kvtiers.core.layout import DTYPE_SIZES, KVLayout

__all__ = ["GPUS", "MAX_PARAMS", "MODELS", "GPUSpec", "ModelSpec", "load_model"]


#: The largest parameter count a model may give: an exact float, so costs stay finite.
MAX_PARAMS = 2**53


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shapes of a transformer that fix its prefill FLOPs and its KV bytes per token.

    Prefill of `n` new tokens after `c` cached ones costs `2 * num_params * n` FLOPs in the
    weight matmuls plus `2 * num_layers * num_heads * (head_size + v_head_size) * pairs` in
    attention, where `pairs = n * c + n * (n + 1) / 2` counts the causal query-key pairs
    (QK^T and AV, 2 FLOPs per multiply-add). The weights term is linear, the attention term
    quadratic in the prompt length.
    """

    name: str
    """Preset or model name; the layout's model name."""
    num_params: int
    """Parameters used per token (for a mixture of experts: the activated ones)."""
    num_layers: int
    num_heads: int
    """Query heads."""
    head_size: int
    """Query/key head size in attention (MLA: the no-RoPE plus RoPE part, e.g. 192)."""
    num_kv_heads: int
    """KV heads cached per token (1 for MLA)."""
    kv_head_size: int
    """Cached elements per KV head and token (MLA: the latent, e.g. 512 + 64 = 576)."""
    kind: Literal["mha", "mla"] = "mha"
    """`"mha"` caches K and V per head (GQA included); `"mla"` caches one latent."""
    v_head_size: int = 0
    """Value head size in attention; 0 means `head_size`."""
    dtype: str = "bfloat16"
    """KV element type."""
    max_context: int = 131_072
    """Longest prompt the model takes, in tokens."""
    total_params: int = 0
    """All parameters (a mixture of experts holds more than it uses); 0 when the same."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"model.name: expected a string, got {describe(self.name, 40)}")
        check_int("model.num_params", self.num_params, 1, MAX_PARAMS)
        check_int("model.total_params", self.total_params, 0, MAX_PARAMS)
        for name in ("num_layers", "num_heads", "head_size", "num_kv_heads", "kv_head_size"):
            check_int(f"model.{name}", getattr(self, name), 1, MAX_DIM)
        check_int("model.v_head_size", self.v_head_size, 0, MAX_DIM)  # 0: head_size
        check_int("model.max_context", self.max_context, 1, MAX_DIM)
        if not isinstance(self.kind, str) or self.kind not in ("mha", "mla"):
            raise ConfigError(f"model.kind: {describe(self.kind, 40)} is not 'mha' or 'mla'")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise ConfigError(
                f"model.dtype: {describe(self.dtype, 40)} is not one of {', '.join(DTYPE_SIZES)}"
            )
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ConfigError("model.num_kv_heads: must be 1 for kind 'mla' (one latent)")
        per_token = self.num_layers * (2 if self.kind == "mha" else 1) * self.num_kv_heads
        per_token *= self.kv_head_size * DTYPE_SIZES[self.dtype]
        if per_token > MAX_BYTES:
            raise ConfigError(
                f"model.kv_head_size: {per_token:,} bytes of KV per token is more than 1 EiB"
            )

    def layout(self, chunk_size: int = 256) -> KVLayout:
        """Return the KV layout of this model with `chunk_size` tokens per chunk."""
        return KVLayout(
            model=self.name,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.kv_head_size,
            dtype=self.dtype,
            chunk_size=chunk_size,
            kind=self.kind,
        )

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV per token, all layers."""
        return self.layout().bytes_per_token

    def prefill_flops(self, num_new: int, num_cached: int = 0) -> float:
        """Return the FLOPs to prefill `num_new` tokens after `num_cached` cached ones."""
        if num_new <= 0:
            return 0.0
        pairs = num_new * num_cached + num_new * (num_new + 1) / 2
        v_size = self.v_head_size or self.head_size
        attention = 2.0 * self.num_layers * self.num_heads * (self.head_size + v_size) * pairs
        return 2.0 * self.num_params * num_new + attention


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """An accelerator's peak dense BF16 throughput and its links."""

    name: str
    peak_tflops: float
    """Dense BF16 tensor throughput, TFLOP/s, without sparsity."""
    hbm_gbps: float
    """HBM bandwidth, GB/s."""
    host_link_gbps: float
    """Host link bandwidth per direction (PCIe), GB/s: the ceiling for the dram tier."""


#: Datasheet figures (SXM/OAM parts). See docs/replay.md for sources.
GPUS: dict[str, GPUSpec] = {
    "H100": GPUSpec("H100", 989.4, 3350.0, 64.0),
    "H200": GPUSpec("H200", 989.4, 4800.0, 64.0),
    "A100": GPUSpec("A100", 312.0, 2039.0, 32.0),
    "MI300X": GPUSpec("MI300X", 1307.4, 5300.0, 64.0),
}

#: Model presets, from each model's published config.json (docs/replay.md lists them).
MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 8_030_261_248, 32, 32, 128, 8, 128),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 70_553_706_496, 80, 64, 128, 8, 128),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 7_615_616_512, 28, 28, 128, 4, 128, max_context=32_768),
    "deepseek-v3": ModelSpec(
        "deepseek-v3",
        37_000_000_000,
        61,
        128,
        192,
        1,
        576,
        kind="mla",
        v_head_size=128,
        max_context=163_840,
        total_params=671_000_000_000,
    ),
}


def load_model(spec: str) -> ModelSpec:
    """Return a model by preset name, or read one from a file.

    Args:
        spec: a preset name (`MODELS`, case-insensitive), or a path to a `.toml` or `.json`
            file holding `ModelSpec` fields (optionally under a `model` table), or a
            Hugging Face `config.json` of a dense model (parameters are then estimated).

    Raises:
        ConfigError: no such preset or file, or the file lacks a field.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"model: expected a preset name or a file path, got {describe(spec)}")
    preset = MODELS.get(spec.lower())
    if preset is not None:
        return preset
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"model: {spec!r} is neither a preset ({', '.join(MODELS)}) nor a file")
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"model: cannot read {path}: {exc}") from exc
    except RecursionError:  # arrays or tables nested thousands deep
        raise ConfigError(f"model: cannot read {path}: nested too deep") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model: {path} must hold a table at the top level")
    data = data.get("model", data)
    if not isinstance(data, dict):
        raise ConfigError(f"model: {path}: 'model' must be a table of the model's fields")
    if "num_hidden_layers" in data:
        return _from_hf_config(data, default_name=path.parent.name or path.stem)
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(data) - known, key=str)
    if unknown:
        raise ConfigError(f"model.{unknown[0]}: unknown key; expected {', '.join(sorted(known))}")
    try:
        return ModelSpec(**data)
    except TypeError as exc:
        raise ConfigError(f"model: {exc}") from exc


def _from_hf_config(cfg: dict[str, Any], *, default_name: str) -> ModelSpec:
    """Build a spec from a Hugging Face config.json; MLA and MoE need explicit fields."""
    if "kv_lora_rank" in cfg or "num_experts" in cfg or "n_routed_experts" in cfg:
        raise ConfigError(
            "model: MLA and mixture-of-experts configs are not estimated; write a model "
            "file with num_params, num_layers, num_heads, head_size, num_kv_heads, "
            "kv_head_size, kind"
        )
    hidden = _hf_int(cfg, "hidden_size")
    layers = _hf_int(cfg, "num_hidden_layers")
    heads = _hf_int(cfg, "num_attention_heads")
    kv_heads = _hf_int(cfg, "num_key_value_heads", heads)
    head = _hf_int(cfg, "head_dim") if cfg.get("head_dim") else hidden // heads
    inter = _hf_int(cfg, "intermediate_size")
    vocab = _hf_int(cfg, "vocab_size")
    # Weights of a llama-style decoder: attention (q, k, v, o), gated MLP, two norms per
    # layer, the final norm, embeddings (and the output head unless tied).
    attention = hidden * heads * head * 2 + hidden * kv_heads * head * 2
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2) + hidden
    dtype = str(cfg.get("torch_dtype") or "bfloat16")
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or default_name),
        num_params=layers * per_layer + embeddings,
        num_layers=layers,
        num_heads=heads,
        head_size=head,
        num_kv_heads=kv_heads,
        kv_head_size=head,
        dtype=dtype if dtype in DTYPE_SIZES else "bfloat16",
        max_context=_hf_int(cfg, "max_position_embeddings", 131_072),
    )


def _hf_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """Return a positive integer field of a Hugging Face config (`default` when absent).

    An integral float (`4096.0`) counts as its integer.

    Raises:
        ConfigError: the field is missing, or not an integer in [1, `MAX_DIM`].
    """
    if key not in cfg and default is not None:
        return default
    if key not in cfg:
        raise ConfigError(f"model: config.json lacks {key!r}")
    value = cfg[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return check_int(f"model: config.json {key}", value, 1)
