"""Block plans and the per-layer gather and scatter kernels.

A chunk of `chunk_size` tokens covers `chunk_size // block_size` engine blocks, and in its
payload one layer's plane (K, V or the latent) is those blocks back to back. So a copy is
row indexing: rows of a plane (one row per block) to consecutive rows of the payload.

Two ways to run a layer:
- *direct*: payloads on the KV's device (CPU, or an HBM tier's blocks): one `index_select`
  or `index_put_` per chunk writes straight into its destination. (Scatters use
  `index_put_`: on CPU `index_copy_` runs at a tenth of its speed for a chunk's few rows.)
- *staged*: host payloads with KV on a CUDA device. DMA needs contiguous ranges and engine
  blocks are scattered, so one kernel per layer packs the layer's blocks of every chunk
  into a device staging buffer (or unpacks them from it), and one DMA per chunk moves the
  chunk's layer slice across PCIe. The bytes cross the bus once; the pack is a
  device-local copy at HBM speed. A kernel writing straight into pinned host memory would
  save the pack but hold SMs for the whole transfer and slow the engine's compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtiers.core.errors import InvalidInputError, LayoutMismatch
from kvtiers.core.layout import KVLayout
from kvtiers.gpu.paged import UNIT_DTYPES, PagedKV, as_rows

__all__ = [
    "BatchPlan",
    "check_payloads",
    "gather_direct",
    "new_staging",
    "pack",
    "plan_batch",
    "scatter_direct",
    "staging_shape",
    "unpack",
]


@dataclass(frozen=True, slots=True, eq=False)
class BatchPlan:
    """The engine blocks behind each chunk of a batch, on the KV's device."""

    paged: PagedKV
    layout: KVLayout
    block_ids: torch.Tensor
    """`(num_chunks, blocks_per_chunk)` int64: chunk `j`'s engine blocks, in token order."""
    combined_ids: torch.Tensor
    """`(num_chunks, num_kv, blocks_per_chunk)` int64: the same blocks as rows of the
    layer's combined view (plane `c`, block `b` at row `c * num_blocks + b`)."""

    @property
    def num_chunks(self) -> int:
        """Chunks in the batch."""
        return int(self.block_ids.shape[0])

    @property
    def blocks_per_chunk(self) -> int:
        """Engine blocks per chunk."""
        return int(self.block_ids.shape[1])


def plan_batch(
    paged: PagedKV,
    layout: KVLayout,
    block_table: Any,
    chunk_idxs: Any,
    *,
    unique: bool,
) -> BatchPlan:
    """Check a block table; return each chunk's blocks on the KV's device.

    Call it with the copy stream current: on CUDA the ids travel on that stream.

    Args:
        paged: the engine's KV.
        layout: the chunk layout.
        block_table: the request's engine block ids in token order (list, NumPy array or
            tensor; a CUDA tensor is read back to the host first, which waits for it).
        chunk_idxs: which chunks of the request (chunk `k` is tokens `[k * chunk_size,
            (k + 1) * chunk_size)`).
        unique: whether the chunks must not share a block (a scatter writes them).

    Raises:
        LayoutMismatch: `paged` does not match `layout`.
        InvalidInputError: the table is too short, an id is out of range, or (with
            `unique`) two chunks map to one block.
    """
    paged.check_layout(layout)
    per_chunk = layout.chunk_size // paged.block_size
    table = _int_array(block_table, "block_table")
    idxs = _int_array(chunk_idxs, "chunk_idxs")
    if idxs.size and int(idxs.min()) < 0:
        raise InvalidInputError(f"chunk_idxs: negative chunk index {int(idxs.min())}")
    last = int(idxs.max()) if idxs.size else -1
    if (last + 1) * per_chunk > len(table):
        raise InvalidInputError(
            f"block_table: {len(table)} blocks hold {len(table) * paged.block_size} tokens, "
            f"but chunk {last} needs {(last + 1) * layout.chunk_size}"
        )
    ids = table[idxs[:, None] * per_chunk + np.arange(per_chunk)]
    bad = ids[(ids < 0) | (ids >= paged.num_blocks)]
    if bad.size:
        raise InvalidInputError(
            f"block_table: block id {int(bad[0])} is out of range [0, {paged.num_blocks})"
        )
    if unique and len(np.unique(ids)) != ids.size:
        raise InvalidInputError("block_table: two chunks to fill share an engine block")
    planes = np.arange(paged.num_kv, dtype=np.int64)[None, :, None] * paged.num_blocks
    combined = ids[:, None, :] + planes
    device = paged.device
    return BatchPlan(paged, layout, _upload(ids, device), _upload(combined, device))


def _int_array(values: Any, name: str) -> npt.NDArray[np.int64]:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidInputError(f"{name}: expected a 1-D sequence of integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _upload(arr: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type == "cpu":
        return host
    # Pinned, so the upload is asynchronous on the current (copy) stream.
    return host.pin_memory().to(device, non_blocking=True)


def check_payloads(
    layout: KVLayout,
    device: torch.device,
    payloads: Sequence[torch.Tensor],
    num: int,
    name: str,
    *,
    full: bool,
) -> bool:
    """Check payloads or their layer slices; return whether they are on host.

    They must be `num` contiguous tensors of the layout's dtype and shape, all on the host
    or all on `device` (the KV's).

    Raises:
        LayoutMismatch: a wrong dtype or shape.
        InvalidInputError: a wrong count, a strided payload, or mixed or foreign devices.
    """
    if len(payloads) != num:
        raise InvalidInputError(f"{name}: {len(payloads)} payloads for {num} chunks")
    want = layout.chunk_shape() if full else layout.chunk_shape()[1:]
    dtype = getattr(torch, layout.dtype)
    devices = set()
    for t in payloads:
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != want:
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t)
            raise LayoutMismatch(f"{name}: expected {dtype} tensors of {want}, got {got}")
        if not t.is_contiguous():
            raise InvalidInputError(f"{name}: payloads must be contiguous")
        devices.add(t.device)
    host = torch.device("cpu")
    if devices - {device, host} or len(devices) > 1:
        found = sorted(map(str, devices))
        raise InvalidInputError(f"{name}: on {found}; expected all on the host or on {device}")
    return device.type == "cuda" and devices == {host}


# -- direct: payloads on the KV's device -----------------------------------------------------


def gather_direct(plan: BatchPlan, layer: int, dsts: Sequence[torch.Tensor], width: int) -> int:
    """Copy `layer` of each chunk into its payload slice; return kernels run.

    `dsts[j]` is chunk `j`'s contiguous layer slice, `(num_kv, chunk_size, ...)`.
    """
    paged, num_kv, per_chunk = plan.paged, plan.paged.num_kv, plan.blocks_per_chunk
    combined = paged.combined_rows(layer, width)
    planes = paged.rows(layer, width) if combined is None else ()
    for j, dst in enumerate(dsts):
        out = as_rows(dst, (num_kv, per_chunk), paged.block_bytes, width)
        if combined is not None:
            ids = plan.combined_ids[j].view(-1)
            torch.index_select(combined, 0, ids, out=out.view(num_kv * per_chunk, -1))
        for c, rows in enumerate(planes):
            torch.index_select(rows, 0, plan.block_ids[j], out=out[c])
    return len(dsts) * (1 if combined is not None else num_kv)


def scatter_direct(plan: BatchPlan, layer: int, srcs: Sequence[torch.Tensor], width: int) -> int:
    """Copy payload slices into `layer`'s blocks; return the kernels run."""
    paged, num_kv, per_chunk = plan.paged, plan.paged.num_kv, plan.blocks_per_chunk
    combined = paged.combined_rows(layer, width)
    planes = paged.rows(layer, width) if combined is None else ()
    for j, src in enumerate(srcs):
        rows_in = as_rows(src, (num_kv, per_chunk), paged.block_bytes, width)
        if combined is not None:
            ids = plan.combined_ids[j].view(-1)
            combined.index_put_((ids,), rows_in.view(num_kv * per_chunk, -1))
        for c, rows in enumerate(planes):
            rows.index_put_((plan.block_ids[j],), rows_in[c])
    return len(srcs) * (1 if combined is not None else num_kv)


# -- staged: pack into / unpack from a staging buffer on the device --------------------------


def staging_shape(plan: BatchPlan, num_chunks: int) -> tuple[int, ...]:
    """Return a staging buffer's shape for one layer of `num_chunks` chunks."""
    paged = plan.paged
    units = paged.block_bytes // paged.unit_width
    return (num_chunks, paged.num_kv, plan.blocks_per_chunk, units)


def new_staging(plan: BatchPlan, num_chunks: int) -> torch.Tensor:
    """Return an uninitialised staging buffer (on the current stream, on CUDA)."""
    unit = UNIT_DTYPES[plan.paged.unit_width]
    return torch.empty(staging_shape(plan, num_chunks), dtype=unit, device=plan.paged.device)


def pack(plan: BatchPlan, layer: int, lo: int, hi: int, stage: torch.Tensor) -> int:
    """Gather `layer` of chunks `lo:hi` into `stage`; return the kernels run."""
    paged, width = plan.paged, plan.paged.unit_width
    combined = paged.combined_rows(layer, width)
    if combined is not None:
        ids = plan.combined_ids[lo:hi].reshape(-1)
        torch.index_select(combined, 0, ids, out=stage.view(-1, stage.shape[-1]))
        return 1
    for c, rows in enumerate(paged.rows(layer, width)):
        # NOTE: stage[:, c] is strided; aten.index writes it in place (index_select cannot).
        torch.ops.aten.index.Tensor_out(rows, [plan.block_ids[lo:hi]], out=stage[:, c])
    return paged.num_kv


def unpack(plan: BatchPlan, layer: int, lo: int, hi: int, stage: torch.Tensor) -> int:
    """Scatter `stage` into `layer` of chunks `lo:hi`; return the kernels run."""
    paged, width = plan.paged, plan.paged.unit_width
    combined = paged.combined_rows(layer, width)
    if combined is not None:
        ids = plan.combined_ids[lo:hi].reshape(-1)
        combined.index_put_((ids,), stage.view(-1, stage.shape[-1]))
        return 1
    for c, rows in enumerate(paged.rows(layer, width)):
        rows.index_put_((plan.block_ids[lo:hi],), stage[:, c])
    return paged.num_kv
