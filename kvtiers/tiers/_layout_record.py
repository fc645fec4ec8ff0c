"""A store's note of the layouts it holds chunks of, for `kvtiers inspect`.

A chunk's header names its layout by fingerprint only, a hash. So that an operator can
tell the namespaces of a shared store apart (which model, TP rank, pipeline stage), each
tier writes the layout it opens with beside its chunks: the lmdb tier under the key
`layout:<fingerprint>` of its `meta` database, the remote tier as the object `_layout` in
its namespace. The record is msgpack `[b"KVTL", 1, {field: value}]`, the fields of
`KVLayout.to_dict`. It is a label, never read to serve a chunk: a missing or unreadable
record only leaves the namespace unnamed.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvtiers.core.layout import KVLayout

__all__ = ["LMDB_PREFIX", "REMOTE_NAME", "decode", "describe", "encode"]

LMDB_PREFIX = b"layout:"
"""Keys of layout records in an lmdb environment's `meta` database (then 16 bytes)."""
REMOTE_NAME = "_layout"
"""The name of the layout record in a remote namespace."""
_MAGIC = b"KVTL"
_VERSION = 1
_MAX_BYTES = 64 * 1024  # a record is a few hundred bytes; anything larger is not ours


def encode(layout: KVLayout) -> bytes:
    """Return the record of `layout`."""
    packed: bytes = msgpack.packb([_MAGIC, _VERSION, layout.to_dict()], use_bin_type=True)
    return packed


def decode(raw: bytes | memoryview | None) -> dict[str, Any] | None:
    """Return the layout fields of a record, or `None` if it is missing or not one."""
    if raw is None or len(raw) > _MAX_BYTES:
        return None
    try:
        magic, version, fields = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if magic != _MAGIC or version != _VERSION or not isinstance(fields, dict):
        return None
    if not all(isinstance(k, str) for k in fields):
        return None
    return fields


def describe(fields: dict[str, Any]) -> str:
    """Return a record's layout as one short phrase for a terminal."""
    get = fields.get
    revision = f"@{get('model_revision')}" if get("model_revision") else ""
    heads = "latent" if get("kind") == "mla" else f"{get('num_kv_heads')} kv heads x"
    return (
        f"{get('model')}{revision}, tp {get('tp_rank')}/{get('tp_size')}, "
        f"{get('num_layers')} layers, {heads} {get('head_size')}, {get('dtype')}, "
        f"chunk {get('chunk_size')}"
    )
