"""Conversions between torch tensors, NumPy buffers and the layout (the facade's helpers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtiers.core.checks import describe, is_int
from kvtiers.core.errors import InvalidInputError, LayoutMismatch, TokenError
from kvtiers.core.keys import as_token_array
from kvtiers.core.layout import KVLayout
from kvtiers.gpu.paged import host_bytes

__all__ = [
    "TORCH_DTYPES",
    "as_tokens",
    "check_chunks",
    "check_kv",
    "check_out",
    "host_bytes",
    "keep_hint",
    "torch_dtype",
]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """Return the torch dtype of the layout's elements."""
    return TORCH_DTYPES[layout.dtype]


def as_tokens(tokens: Any) -> npt.NDArray[np.int64]:
    """Return tokens (list, NumPy array or torch tensor) as a checked int64 array."""
    if isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TokenError(f"tokens: expected integer ids, got dtype {tokens.dtype}")
        if tokens.layout != torch.strided or tokens.is_meta:
            raise TokenError(f"tokens: expected a dense tensor with data, got {_kind(tokens)}")
        tokens = tokens.detach().to("cpu").numpy()
    elif isinstance(tokens, np.ma.MaskedArray):
        raise TokenError("tokens: a masked array has no ids where it is masked")
    return as_token_array(tokens)


def _kind(tensor: torch.Tensor) -> str:
    return "a meta tensor" if tensor.is_meta else f"a {tensor.layout} tensor"


def _check_memory(name: str, tensor: torch.Tensor, *, writable: bool) -> None:
    """Refuse tensors whose elements cannot be read (or, if `writable`, written) in place.

    Raises:
        LayoutMismatch: a sparse or meta tensor; to write, one that needs grad or whose
            elements overlap (an expanded view).
    """
    if tensor.layout != torch.strided or tensor.is_meta:
        raise LayoutMismatch(f"{name}: expected a dense tensor with data, got {_kind(tensor)}")
    if not writable:
        return
    if tensor.requires_grad:
        raise LayoutMismatch(f"{name}: requires grad; pass a tensor outside autograd")
    strides = tensor.stride()
    # NOTE: the membership test first: it is cheap, and the chunk checks run per chunk.
    if 0 in strides and any(st == 0 and n > 1 for st, n in zip(strides, tensor.shape, strict=True)):
        raise LayoutMismatch(f"{name}: elements overlap (an expanded view); it cannot be filled")


def check_kv(layout: KVLayout, kv: object, num_tokens: int) -> torch.Tensor:
    """Check that `kv` holds the KV of `num_tokens` tokens in the layout.

    Raises:
        LayoutMismatch: not a tensor, or wrong dtype, shape or length.
    """
    if not isinstance(kv, torch.Tensor):
        raise LayoutMismatch(f"kv: expected a torch.Tensor, got {type(kv).__name__}")
    want = layout.kv_shape(num_tokens)
    if kv.dtype != torch_dtype(layout):
        raise LayoutMismatch(f"kv: dtype {kv.dtype} does not match the layout's {layout.dtype}")
    if kv.dim() != len(want):
        raise LayoutMismatch(f"kv: expected shape {want}, got {tuple(kv.shape)}")
    if kv.shape[2] != num_tokens:
        raise LayoutMismatch(f"kv: holds {kv.shape[2]} tokens but {num_tokens} tokens were given")
    if tuple(kv.shape) != want:
        raise LayoutMismatch(f"kv: expected shape {want}, got {tuple(kv.shape)}")
    _check_memory("kv", kv, writable=False)
    return kv


def check_out(layout: KVLayout, out: object, num_tokens: int) -> torch.Tensor:
    """Check that `out` can take the KV of `num_tokens` tokens.

    Raises:
        LayoutMismatch: not a tensor, wrong dtype or shape, or too few tokens.
    """
    if not isinstance(out, torch.Tensor):
        raise LayoutMismatch(f"out: expected a torch.Tensor, got {type(out).__name__}")
    want = layout.kv_shape(num_tokens)
    if out.dtype != torch_dtype(layout):
        raise LayoutMismatch(f"out: dtype {out.dtype} does not match the layout's {layout.dtype}")
    shape = tuple(out.shape)
    if len(shape) != len(want) or shape[:2] != want[:2] or shape[3:] != want[3:]:
        raise LayoutMismatch(f"out: expected shape {want} (more tokens allowed), got {shape}")
    if shape[2] < num_tokens:
        raise LayoutMismatch(f"out: room for {shape[2]} tokens, {num_tokens} needed")
    _check_memory("out", out, writable=True)
    return out


def check_chunks(
    layout: KVLayout, chunks: object, num_keys: int, what: str, *, writable: bool = False
) -> list[torch.Tensor | npt.NDArray[np.uint8]]:
    """Check that `chunks` holds one chunk of the layout per key.

    A chunk is a torch tensor of the layout's dtype and `chunk_shape()` (any device, any
    strides), or a uint8 NumPy array of `chunk_bytes` bytes whose C-order sequence is the
    payload (any shape and strides: a view of an engine's host memory).

    Raises:
        LayoutMismatch: not a sequence, or a wrong count, type, dtype or shape; memory that
            cannot be read, or (`writable`) written, in place.
    """
    if isinstance(chunks, torch.Tensor | np.ndarray) or not isinstance(chunks, list | tuple):
        raise LayoutMismatch(f"{what}: expected a list of chunks, one per key")
    if len(chunks) != num_keys:
        raise LayoutMismatch(f"{what}: {len(chunks)} chunks for {num_keys} keys")
    want = layout.chunk_shape()
    dtype = torch_dtype(layout)
    chunk_bytes = layout.chunk_bytes
    for i, chunk in enumerate(chunks):
        if isinstance(chunk, np.ndarray):
            if chunk.dtype != np.uint8 or chunk.nbytes != chunk_bytes:
                raise LayoutMismatch(
                    f"{what}[{i}]: expected {chunk_bytes} uint8 bytes, got "
                    f"{chunk.nbytes} bytes of {chunk.dtype}"
                )
            if writable and not chunk.flags.writeable:
                raise LayoutMismatch(f"{what}[{i}]: the array is read-only")
        elif not isinstance(chunk, torch.Tensor):
            raise LayoutMismatch(
                f"{what}[{i}]: expected a torch.Tensor or a uint8 array, got {type(chunk).__name__}"
            )
        elif chunk.dtype != dtype or tuple(chunk.shape) != want:
            raise LayoutMismatch(
                f"{what}[{i}]: expected shape {want} of {layout.dtype}, got "
                f"{tuple(chunk.shape)} of {chunk.dtype}"
            )
        else:
            _check_memory(f"{what}[{i}]", chunk, writable=writable)
    return list(chunks)


def keep_hint(name: str, value: object, chunk_size: int = 1) -> int | None:
    """Return the whole chunks a reuse hint of `value` units covers (None: no hint).

    Args:
        name: the argument, for the message.
        value: tokens (with the chunk size) or chunks (`chunk_size` 1) expected reused.
        chunk_size: units per chunk.

    Raises:
        InvalidInputError: the hint is not a non-negative integer.
    """
    if value is None:
        return None
    if not is_int(value) or value < 0:
        raise InvalidInputError(f"{name}: expected a non-negative integer, got {describe(value)}")
    return value // chunk_size
