"""An engine's paged KV cache, described for copies to and from chunks.

Serving engines keep KV in fixed-size blocks of `block_size` tokens, one buffer per layer,
and map a request's tokens to blocks with a block table (token `t` lives in block
`block_table[t // block_size]`, slot `t % block_size`). Three layouts are understood:

- `"vllm_flash"`: per layer one tensor `(2, num_blocks, block_size, num_kv_heads, head_size)`
  (vLLM's flash-attention layout; K is `[0]`, V is `[1]`).
- `"sglang_mha"`: per layer separate K and V buffers `(num_blocks * block_size, num_kv_heads,
  head_size)` (SGLang's MHA token pool; `block_size` is its page size).
- `"mla"`: per layer one latent buffer `(num_blocks, block_size, latent_dim)`.

Internally each layer is a tuple of *planes* (K and V, or the latent), and each plane is seen
as rows of raw bytes, one row per block. Every copy moves raw bytes, so fp8 and NaN payloads
round-trip bit for bit. A block must be contiguous; blocks may be strided.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from kvtiers.core.checks import is_int
from kvtiers.core.errors import InvalidInputError, LayoutMismatch
from kvtiers.core.layout import KVLayout

__all__ = [
    "UNIT_DTYPES",
    "LayerKV",
    "PagedKV",
    "PagedKind",
    "as_rows",
    "host_bytes",
    "host_tensor",
    "payload_tensor",
    "unit_width",
]

PagedKind = Literal["vllm_flash", "sglang_mha", "mla"]
LayerKV = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""One layer of an engine's KV: a tensor, or a `(k, v)` pair for `"sglang_mha"`."""

#: The integer dtype of each copy-unit width in bytes; copies move the widest unit that
#: every row, stride and address involved is a multiple of.
UNIT_DTYPES: dict[int, torch.dtype] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}
_KINDS = ("vllm_flash", "sglang_mha", "mla")


@dataclass(frozen=True, slots=True, eq=False)
class PagedKV:
    """An engine's paged KV: per-layer buffers, layout kind and block size.

    Build it with `vllm_flash`, `sglang_mha` or `mla`, or directly. The tensors are used in
    place, never copied; they must all share one dtype, device and block geometry.

    Raises:
        LayoutMismatch: a tensor has the wrong rank or shape for `kind`, the layers differ,
            or a block is not contiguous.
        InvalidInputError: unknown `kind`, bad `block_size` or no layers.
    """

    kind: PagedKind
    """Which engine layout the tensors follow."""
    layers: tuple[LayerKV, ...] = field(repr=False)
    """Per layer the tensor (or `(k, v)` pair for `"sglang_mha"`), first layer first."""
    block_size: int
    """Tokens per engine block (SGLang's page size)."""
    num_blocks: int = field(init=False)
    """Blocks per layer buffer."""
    num_kv_heads: int = field(init=False)
    """KV heads per token (1 for `"mla"`)."""
    head_size: int = field(init=False)
    """Elements per head (the latent width for `"mla"`)."""
    dtype: torch.dtype = field(init=False)
    """The element type of every buffer."""
    device: torch.device = field(init=False)
    """Where the buffers live."""
    unit_width: int = field(init=False)
    """The widest copy unit in bytes (8, 4, 2 or 1) that fits every block row."""
    _rows: tuple[tuple[torch.Tensor, ...], ...] = field(init=False, repr=False)
    # per layer, per plane: uint8 rows (num_blocks, block_bytes), views of the buffers
    _combined: tuple[torch.Tensor | None, ...] = field(init=False, repr=False)
    # per layer: uint8 rows (num_kv * num_blocks, block_bytes) covering every plane of the
    # layer with plane c's block b at row c * num_blocks + b, when one view can hold them
    # (one kernel per layer instead of one per plane); None otherwise

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidInputError(f"paged KV: kind {self.kind!r} is not one of {_KINDS}")
        size = self.block_size
        if not is_int(size) or size < 1:
            raise InvalidInputError(f"paged KV: block_size must be an integer >= 1, got {size!r}")
        layers = tuple(self.layers)
        if not layers:
            raise InvalidInputError("paged KV: no layers")
        object.__setattr__(self, "layers", layers)
        planes = [_planes_of(self.kind, layer, size, i) for i, layer in enumerate(layers)]
        first = planes[0][0]
        for i, layer_planes in enumerate(planes):
            for plane in layer_planes:
                _check_like(first, plane, f"paged KV: layer {i}")
        object.__setattr__(self, "num_blocks", first.shape[0])
        object.__setattr__(self, "num_kv_heads", first.shape[2] if first.dim() == 4 else 1)
        object.__setattr__(self, "head_size", first.shape[-1])
        object.__setattr__(self, "dtype", first.dtype)
        object.__setattr__(self, "device", first.device)
        rows = tuple(tuple(_rows_of(p, i) for p in ps) for i, ps in enumerate(planes))
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_combined", tuple(self._combine(layer) for layer in layers))
        views = [r for layer_rows in rows for r in layer_rows]
        views += [c for c in self._combined if c is not None]
        values = [self.block_bytes]
        for view in views:
            values += [view.stride(0), view.data_ptr()]
        object.__setattr__(self, "unit_width", unit_width(values))

    @classmethod
    def vllm_flash(cls, kv_caches: Sequence[torch.Tensor]) -> PagedKV:
        """Describe vLLM's flash layout: per layer `(2, blocks, block_size, H, D)`."""
        if not kv_caches or kv_caches[0].dim() != 5:
            raise LayoutMismatch("paged KV: expected per layer (2, blocks, block_size, heads, dim)")
        return cls("vllm_flash", tuple(kv_caches), kv_caches[0].shape[2])

    @classmethod
    def sglang_mha(
        cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], block_size: int
    ) -> PagedKV:
        """Describe SGLang's MHA pool: per layer K and V `(tokens, heads, dim)`."""
        if len(k_buffers) != len(v_buffers):
            raise LayoutMismatch(
                f"paged KV: {len(k_buffers)} K buffers but {len(v_buffers)} V buffers"
            )
        pairs = tuple((k, v) for k, v in zip(k_buffers, v_buffers, strict=True))
        return cls("sglang_mha", pairs, block_size)

    @classmethod
    def mla(cls, kv_caches: Sequence[torch.Tensor]) -> PagedKV:
        """Describe an MLA latent cache: per layer `(blocks, block_size, dim)`."""
        if not kv_caches or kv_caches[0].dim() != 3:
            raise LayoutMismatch("paged KV: expected per layer (blocks, block_size, latent_dim)")
        return cls("mla", tuple(kv_caches), kv_caches[0].shape[1])

    @property
    def num_layers(self) -> int:
        """Layers held."""
        return len(self.layers)

    @property
    def num_kv(self) -> int:
        """Planes per layer: 2 (K and V), or 1 for `"mla"`."""
        return len(self._rows[0])

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane."""
        return self._rows[0][0].shape[1]

    def check_layout(self, layout: KVLayout) -> None:
        """Check that this KV can fill and be filled from chunks of `layout`.

        Raises:
            LayoutMismatch: the kind, layer count, dtype, heads or head size differ, or
                `layout.chunk_size` is not a multiple of `block_size`; the message names
                the field.
        """
        want_kind = "mla" if self.kind == "mla" else "mha"
        checks: list[tuple[str, object, object]] = [
            ("kind", want_kind, layout.kind),
            ("num_layers", self.num_layers, layout.num_layers),
            ("dtype", self.dtype, getattr(torch, layout.dtype)),
            ("num_kv_heads", self.num_kv_heads, layout.num_kv_heads),
            ("head_size", self.head_size, layout.head_size),
        ]
        for name, ours, theirs in checks:
            if ours != theirs:
                raise LayoutMismatch(
                    f"paged KV: {name} is {ours} ({self.kind}) but the layout's {name} is {theirs}"
                )
        if layout.chunk_size % self.block_size:
            raise LayoutMismatch(
                f"paged KV: layout.chunk_size {layout.chunk_size} is not a multiple of the "
                f"engine's block_size {self.block_size}"
            )

    def rows(self, layer: int, width: int) -> tuple[torch.Tensor, ...]:
        """Return `layer`'s planes as rows `(num_blocks, block_bytes // width)`."""
        unit = UNIT_DTYPES[width]
        return tuple(r.view(unit) for r in self._rows[layer])

    def combined_rows(self, layer: int, width: int) -> torch.Tensor | None:
        """Return all planes of `layer` as one row view, or `None` if none can."""
        combined = self._combined[layer]
        return None if combined is None else combined.view(UNIT_DTYPES[width])

    def _combine(self, layer: LayerKV) -> torch.Tensor | None:
        if self.kind == "sglang_mha" or not isinstance(layer, torch.Tensor):
            return None
        if self.kind == "mla":
            return _rows_of(layer, 0)
        if not layer.is_contiguous():
            return None
        return layer.view(torch.uint8).view(2 * layer.shape[1], -1)


def _planes_of(kind: str, layer: object, block_size: int, i: int) -> tuple[torch.Tensor, ...]:
    """Return one layer's planes as `(num_blocks, block_size, ...)` views."""
    where = f"paged KV: layer {i}"
    if kind == "sglang_mha":
        if not isinstance(layer, tuple) or len(layer) != 2:
            raise LayoutMismatch(f"{where}: expected a (k, v) pair of tensors")
        planes = []
        for name, buf in zip("kv", layer, strict=True):
            _check_tensor(buf, 3, f"{where} {name} buffer (tokens, heads, dim)")
            if buf.shape[0] % block_size or not buf.shape[0]:
                raise LayoutMismatch(
                    f"{where}: {buf.shape[0]} token slots are not a positive multiple of "
                    f"block_size {block_size}"
                )
            planes.append(buf.unflatten(0, (buf.shape[0] // block_size, block_size)))
        return tuple(planes)
    if kind == "vllm_flash":
        _check_tensor(layer, 5, f"{where} (2, blocks, block_size, heads, dim)")
        assert isinstance(layer, torch.Tensor)
        if layer.shape[0] != 2 or layer.shape[2] != block_size:
            raise LayoutMismatch(
                f"{where}: shape {tuple(layer.shape)} is not (2, blocks, {block_size}, heads, dim)"
            )
        return (layer[0], layer[1])
    _check_tensor(layer, 3, f"{where} (blocks, block_size, latent_dim)")
    assert isinstance(layer, torch.Tensor)
    if layer.shape[1] != block_size:
        raise LayoutMismatch(
            f"{where}: shape {tuple(layer.shape)} is not (blocks, {block_size}, latent_dim)"
        )
    return (layer,)


def _check_tensor(obj: object, dim: int, what: str) -> None:
    if not isinstance(obj, torch.Tensor) or obj.dim() != dim:
        got = tuple(obj.shape) if isinstance(obj, torch.Tensor) else type(obj).__name__
        raise LayoutMismatch(f"{what}: expected a {dim}-D tensor, got {got}")


def _check_like(first: torch.Tensor, plane: torch.Tensor, where: str) -> None:
    for name, ours, theirs in (
        ("shape", tuple(plane.shape), tuple(first.shape)),
        ("dtype", plane.dtype, first.dtype),
        ("device", plane.device, first.device),
    ):
        if ours != theirs:
            raise LayoutMismatch(f"{where}: {name} {ours} differs from layer 0's {theirs}")
    if not plane.shape[0]:
        raise LayoutMismatch(f"{where}: holds no blocks")


def _rows_of(plane: torch.Tensor, i: int) -> torch.Tensor:
    """Return a plane as uint8 rows `(num_blocks, block_bytes)`, no copy."""
    if not plane[0].is_contiguous():
        raise LayoutMismatch(f"paged KV: layer {i}: each block must be contiguous in memory")
    try:
        return plane.view(torch.uint8).view(plane.shape[0], -1)
    except RuntimeError as exc:
        raise LayoutMismatch(f"paged KV: layer {i}: blocks cannot be viewed as rows") from exc


def unit_width(values: Sequence[int]) -> int:
    """Return the widest unit (8, 4, 2 or 1 bytes) that divides every value."""
    width = 8
    while width > 1 and any(v % width for v in values):
        width //= 2
    return width


def as_rows(t: torch.Tensor, lead: tuple[int, ...], row_bytes: int, width: int) -> torch.Tensor:
    """View a contiguous tensor as `(*lead, row_bytes // width)` units."""
    return t.view(torch.uint8).view(*lead, row_bytes).view(UNIT_DTYPES[width])


def payload_tensor(layout: KVLayout, buf: npt.NDArray[np.uint8] | torch.Tensor) -> torch.Tensor:
    """Return a chunk's bytes (a tier block view) as a payload tensor.

    Args:
        layout: the chunk layout.
        buf: `layout.chunk_bytes` contiguous bytes: a NumPy uint8 array (a DRAM block
            view) or a uint8 tensor (an HBM block view).

    Returns:
        A tensor of `layout.chunk_shape()` and the layout's dtype sharing `buf`'s memory.

    Raises:
        InvalidInputError: `buf` is not `chunk_bytes` contiguous uint8 bytes.
    """
    tensor = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
    if tensor.dtype != torch.uint8 or tensor.numel() != layout.chunk_bytes:
        raise InvalidInputError(
            f"payload: expected {layout.chunk_bytes} uint8 bytes, got {tensor.numel()} "
            f"{tensor.dtype}"
        )
    if not tensor.is_contiguous():
        raise InvalidInputError("payload: the block view must be contiguous")
    return tensor.view(-1).view(getattr(torch, layout.dtype)).view(layout.chunk_shape())


def host_tensor(buf: npt.NDArray[np.uint8]) -> torch.Tensor | None:
    """Return a tensor sharing the host buffer `buf`'s memory, or `None` if torch cannot.

    Read-only buffers are accepted (they are only read); arrays with negative strides
    get `None`.
    """
    try:
        if buf.flags.writeable:
            return torch.from_numpy(buf)
        with warnings.catch_warnings():  # read-only sources are only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(buf)
    except (ValueError, TypeError):  # negative strides
        return None


def host_bytes(tensor: torch.Tensor) -> npt.NDArray[np.uint8] | None:
    """Return a uint8 NumPy view of a host tensor, or `None` when there is none.

    The view shares memory, with the last axis in bytes; it exists for CPU tensors whose
    last axis is contiguous. Chunk copies through it skip per-chunk tensor wrapping, and a
    tier can read straight into it.
    """
    if not tensor.is_cpu or tensor.requires_grad or tensor.stride(-1) != 1:
        return None
    try:
        return tensor.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None
