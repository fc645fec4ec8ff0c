"""The engine's parallel shape as the vLLM connector sees it, and each worker's shard.

vLLM runs one worker per TP rank of each pipeline stage (per data-parallel rank). Each
worker owns the KV of its heads (TP) and its layers (PP), so each stores under a layout of
its own, and the scheduler must ask every worker and take the minimum. This module says
which shapes the connector supports, how many workers answer, which one this process is,
and what layout its shard has.

It imports vLLM; `import kvtiers` never imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1 import kv_cache_interface
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)

from kvtiers.core.layout import KVLayout
from kvtiers.integrations._vllm_kv import PagedLayout, detect_layout
from kvtiers.integrations._vllm_plan import chunk_size_for

__all__ = ["Topology"]


@dataclass(frozen=True, slots=True)
class Topology:
    """The engine's tensor, pipeline and data parallel sizes, checked for support."""

    tp_size: int
    """Tensor-parallel ranks per stage; each holds some KV heads (all of MLA's latent)."""
    pp_size: int
    """Pipeline stages; each holds some layers."""
    dp_rank: int
    """This engine's data-parallel rank (each DP rank is an engine of its own)."""
    window: int | None = None
    """The smallest sliding window of a KV-cache group (vLLM's hybrid KV-cache manager
    frees blocks behind it); `None` when every group keeps all its tokens."""
    attention_chunk: int | None = None
    """The tokens of one chunk of local attention (the greatest common divisor of several);
    vLLM's hybrid KV-cache manager frees the blocks of a request's earlier chunks. `None`
    without chunked local attention."""
    layer_groups: dict[str, int] = field(default_factory=dict)
    """The KV-cache group of each layer, by name, with more than one group."""
    mamba_groups: tuple[int, ...] = ()
    """The KV-cache groups of a state-space model's Mamba layers (vLLM's align mode keeps
    their recurrent state per block); empty for other models."""

    @classmethod
    def of(cls, vllm_config: Any, kv_cache_config: Any, *, store_generated: bool) -> Topology:
        """Return the engine's topology.

        Raises:
            ValueError: the model has KV-cache groups the connector cannot pool (other
                than full attention, sliding windows, chunked local attention and Mamba
                state in vLLM's align mode), the engine uses context parallelism (no rank
                holds whole chunks), or generated tokens are to be stored from KV that vLLM
                frees during decoding (R-SWA, sliding windows, chunked local attention) or
                of a state-space model (no state is kept at their end).
        """
        window, local = _check_supported(
            vllm_config, kv_cache_config, store_generated=store_generated
        )
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        states = tuple(
            g
            for g, group in enumerate(groups)
            if _is_aligned_state(getattr(group, "kv_cache_spec", None))
        )
        layer_groups = (
            {name: g for g, group in enumerate(groups) for name in group.layer_names}
            if len(groups) > 1
            else {}
        )
        parallel = vllm_config.parallel_config
        return cls(
            tp_size=int(parallel.tensor_parallel_size),
            pp_size=int(parallel.pipeline_parallel_size),
            dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
            window=window,
            attention_chunk=local,
            layer_groups=layer_groups,
            mamba_groups=states,
        )

    @property
    def hybrid(self) -> bool:
        """Whether vLLM's hybrid KV-cache manager frees blocks or splits the layers.

        Then loads are asynchronous (vLLM takes no block-level load errors with several
        groups), and `chunk_size_for` bounds the chunk size.
        """
        return (
            self.window is not None or self.attention_chunk is not None or bool(self.layer_groups)
        )

    @property
    def mamba_layers(self) -> frozenset[str]:
        """Return the names of the Mamba layers (whose state is not KV)."""
        return frozenset(n for n, g in self.layer_groups.items() if g in self.mamba_groups)

    @property
    def num_ranks(self) -> int:
        """Return the workers of one engine, each with its own shard."""
        return self.tp_size * self.pp_size

    def tp_rank(self) -> int:
        """Return this worker's tensor-parallel rank."""
        return _tp_rank() if self.tp_size > 1 else 0

    def rank(self) -> int:
        """Return this worker's rank in its engine (`pp_rank * tp_size + tp_rank`)."""
        tp_rank = _tp_rank() if self.tp_size > 1 else 0
        return _pp_rank() * self.tp_size + tp_rank if self.pp_size > 1 else tp_rank

    def chunk_size(self, block_size: int, requested: int | None) -> int:
        """Return the chunk size for this model (`_vllm_plan.chunk_size_for`).

        Raises:
            ConfigError: `requested` does not suit the block size or the model's sliding
                windows, local attention or recurrent states.
        """
        return chunk_size_for(
            block_size,
            requested,
            self.window,
            self.attention_chunk,
            state_space=bool(self.mamba_groups),
        )

    def worker_layout(
        self,
        vllm_config: Any,
        kv_caches: dict[str, torch.Tensor],
        *,
        block_size: int,
        chunk_size: int,
        model_name: str | None,
    ) -> tuple[PagedLayout, KVLayout]:
        """Return vLLM's paged layout of `kv_caches` and this worker's chunk layout.

        A pipeline stage holds only its own layers; its stage goes into the model name
        (`<model>#pp<stage>/<stages>`), so stages never share a key. MLA's latent cache is
        the same on every TP rank, so the ranks share one layout (TP rank 0 of the TP
        size). Not across TP sizes: the all-reduces sum in another order, so the latents
        of deeper layers differ in their last bits.
        """
        model = vllm_config.model_config
        first = next(iter(kv_caches.values()))
        mla = bool(model.use_mla)
        paged = detect_layout(
            first,
            block_size=block_size,
            num_kv_heads=1 if mla else model.get_num_kv_heads(vllm_config.parallel_config),
            head_size=model.get_head_size(),
            mla=mla,
        )
        sharded = self.tp_size > 1 and not mla
        name = model_name or str(model.model)
        if self.pp_size > 1:
            name = f"{name}#pp{_pp_rank()}/{self.pp_size}"
        layout = KVLayout(
            model=name,
            model_revision=str(model.revision or ""),
            num_layers=len(kv_caches),
            num_kv_heads=paged.num_kv_heads,
            head_size=paged.head_size,
            dtype=str(first.dtype).removeprefix("torch."),
            chunk_size=chunk_size,
            tp_rank=_tp_rank() if sharded else 0,
            tp_size=self.tp_size,
            kind="mla" if mla else "mha",
        )
        return paged, layout


def _unsupported(spec: Any) -> str:
    """Return why a KV-cache group of `spec` is refused, and what the user can do."""
    name = type(spec).__name__
    mamba = getattr(kv_cache_interface, "MambaSpec", None)
    if mamba is not None and isinstance(spec, mamba):
        # NOTE: vLLM runs state-space and linear-attention models only under its hybrid
        # KV-cache manager, so its flag to turn the manager off is no way out here.
        return (
            "KVTiersConnector pools the recurrent state of a state-space or linear-attention "
            f"model ({name}) only where vLLM keeps it per block: serve it with prefix "
            "caching on and --mamba-cache-mode align, or without the kvtiers connector"
        )
    cross = getattr(kv_cache_interface, "CrossAttentionSpec", None)
    if cross is not None and isinstance(spec, cross):
        # NOTE: only encoder-decoder models have cross-attention layers, and vLLM's
        # scheduler refuses every KV connector on those, with the manager on or off.
        return (
            f"KVTiersConnector cannot serve an encoder-decoder model ({name}): vLLM takes "
            "no KV connector on encoder-decoder models; serve this model without the "
            "kvtiers connector"
        )
    return (
        "KVTiersConnector pools full-attention, sliding-window and chunked-local-attention "
        f"KV, not {name}; pass --disable-hybrid-kv-cache-manager"
    )


def _check_supported(
    vllm_config: Any, kv_cache_config: Any, *, store_generated: bool
) -> tuple[int | None, int | None]:
    """Refuse what the connector cannot pool.

    Returns:
        The smallest sliding window and the attention chunk (`Topology`), where any.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    specs = [getattr(group, "kv_cache_spec", None) for group in groups]
    windows, locals_, states = _attention_of(specs)
    if store_generated:
        _check_generated(specs, windows, locals_, states)
    block_sizes = {int(spec.block_size) for spec in specs if spec is not None}
    block_sizes.add(int(vllm_config.cache_config.block_size))
    if len(block_sizes) > 1:
        raise ValueError(
            "KVTiersConnector needs vLLM's block size in every KV-cache group, got "
            f"{sorted(block_sizes)}; pass --disable-hybrid-kv-cache-manager"
        )
    parallel = vllm_config.parallel_config
    for option in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if int(getattr(parallel, option, 1) or 1) > 1:
            # NOTE: context parallelism splits a request's tokens across ranks, so no rank
            # holds whole chunks.
            raise ValueError(f"KVTiersConnector does not support {option} > 1 yet")
    return (min(windows) if windows else None), (math.gcd(*locals_) if locals_ else None)


def _attention_of(specs: list[Any]) -> tuple[list[int], list[int], bool]:
    """Return the groups' sliding windows, local chunks, and whether any keeps states.

    Raises:
        ValueError: a group of a kind the connector cannot pool.
    """
    windows: list[int] = []
    locals_: list[int] = []
    states = False
    for spec in specs:
        if spec is None or isinstance(spec, FullAttentionSpec):
            continue
        if type(spec) is SlidingWindowSpec:
            # NOTE: vLLM frees the blocks behind a window as a request advances, so the
            # connector saves each chunk in the step that completes it (its blocks are
            # all live then) and loads skip the freed ones.
            windows.append(int(spec.sliding_window))
        elif _is_aligned_state(spec):
            # NOTE: vLLM's align mode keeps a Mamba layer's state at block boundaries (one
            # prefill checkpoint per prompt); the connector stores and loads that state.
            states = True
        elif type(spec) is ChunkedLocalAttentionSpec:
            # NOTE: vLLM frees a request's blocks of earlier local-attention chunks: a
            # chunk that divides the attention chunk never straddles that boundary, so
            # its blocks are all live in the step that completes it (`chunk_size_for`).
            # No later query of the model attends to freed KV, but a stored chunk must
            # hold every layer's true KV, not the null block's.
            locals_.append(int(spec.attention_chunk_size))
        else:
            raise ValueError(_unsupported(spec))
    return windows, locals_, states


def _check_generated(
    specs: list[Any], windows: list[int], locals_: list[int], states: bool
) -> None:
    """Refuse `store_generated` where vLLM frees or never keeps generated tokens' KV."""
    if windows or locals_:
        # NOTE: generated tokens' blocks behind a window or in an earlier local-attention
        # chunk are freed while decoding, before the finished request's save could read.
        kind = "sliding-window" if windows else "chunked-local-attention"
        raise ValueError(
            f"KVTiersConnector cannot store generated tokens of a {kind} model "
            "under vLLM's hybrid KV-cache manager (vLLM frees their KV while decoding); "
            "set store_generated = false or pass --disable-hybrid-kv-cache-manager"
        )
    if states:
        # NOTE: vLLM keeps no state at the end of the generated tokens, only at the prompt's
        # checkpoint.
        raise ValueError(
            "KVTiersConnector cannot store generated tokens of a state-space model (vLLM "
            "keeps its state only at the prompt's checkpoint); set store_generated = false"
        )
    rswa = getattr(kv_cache_interface, "RSWASpec", None)
    if rswa is not None and any(isinstance(s, rswa) for s in specs):
        # NOTE: R-SWA keeps every prompt token's KV but frees generated tokens' blocks
        # that fall out of its window while decoding, so at the end they hold other KV.
        raise ValueError(
            "KVTiersConnector cannot store generated tokens of an R-SWA model (vLLM frees "
            "their KV while decoding); set store_generated = false"
        )


def _is_aligned_state(spec: Any) -> bool:
    """Return whether `spec` is a Mamba group whose state vLLM keeps per block (align mode)."""
    mamba = getattr(kv_cache_interface, "MambaSpec", None)
    return (
        mamba is not None
        and isinstance(spec, mamba)
        and getattr(spec, "mamba_cache_mode", None) == "align"
    )


def _tp_rank() -> int:
    """Return this worker's TP rank."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _pp_rank() -> int:
    """Return this worker's pipeline stage."""
    from vllm.distributed.parallel_state import get_pp_group

    return int(get_pp_group().rank_in_group)
