"""The header of a stored chunk: how it is written, how big it is, how a reader parses it.

The header is the msgpack array of six to eight fields that `_chunk_format` describes,
behind a `u16` length prefix. Its writer and its readers sit here side by side, because the
read path's fast check compares bytes against a header this module writes: a six- or
seven-field header of one layout differs from another only in its key and checksums.
"""

from __future__ import annotations

import enum
import functools
import struct
from typing import NamedTuple

import msgpack

__all__ = [
    "DIGEST_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "Bytes",
    "Header",
    "Verdict",
    "build_header",
    "header_bytes",
    "parse_header",
    "peek_header",
]

Bytes = bytes | bytearray | memoryview

MAGIC = b"KVT1"
"""First header field of every value this format writes."""
FORMAT_VERSION = 1
"""Bump when the header changes; entries of another version are then foreign (a miss)."""

_PREFIX = struct.Struct("<H")
DIGEST_BYTES = 8  # bytes of one xxh3_64 digest
_BASE_FIELDS = 6  # without per-layer checksums
_LAYER_FIELDS = 7  # with them
_TAGGED_FIELDS = 8  # with an integrity tag (the seventh field may then be nil)
_TAG = 32  # bytes of one HMAC-SHA256 tag


class Verdict(enum.Enum):
    """What a stored value turned out to be for the key it was read under."""

    OK = 1  # ours and intact: the payload may be used
    CORRUPT = 2  # unreadable header, wrong length or checksum
    FOREIGN = 3  # intact, but of another layout, key or format version
    FORGED = 4  # intact by its checksum, but without a valid integrity tag (key given)


class Header(NamedTuple):
    """A parsed header that matched the reader's layout and key."""

    payload_len: int
    checksum: bytes
    """xxh3_64 digest of the whole payload."""
    layer_checksums: bytes | None
    """xxh3_64 digests of each layer's slice, back to back; `None` in a six-field header."""
    payload_offset: int
    """Where the payload starts in the stored value."""
    tag: bytes | None = None
    """HMAC-SHA256 tag of the value; `None` when the writer had no integrity key."""


def build_header(
    fingerprint: bytes,
    key: bytes,
    payload_len: int,
    checksum: bytes,
    layers: bytes | None,
    tag: bytes | None = None,
) -> bytes:
    """Return the length-prefixed header of a value; `layers` and `tag` are optional fields."""
    fields: list[object] = [MAGIC, FORMAT_VERSION, fingerprint, key, payload_len, checksum]
    if layers is not None or tag is not None:
        fields.append(layers)
    if tag is not None:
        fields.append(tag)
    header: bytes = msgpack.packb(fields, use_bin_type=True)
    return _PREFIX.pack(len(header)) + header


def header_bytes(
    fingerprint: bytes, payload_len: int, *, num_layers: int = 0, tagged: bool = False
) -> int:
    """Return the size of the header (length prefix included) of a stored value.

    `tagged`: whether the value carries an integrity tag (written with an `auth_key`).
    """
    layers = bytes(DIGEST_BYTES * num_layers) if num_layers > 0 else None
    tag = bytes(_TAG) if tagged else None
    return len(build_header(fingerprint, bytes(16), payload_len, bytes(DIGEST_BYTES), layers, tag))


class _Template(NamedTuple):
    """The bytes every header of one layout shares, around its key, checksum and layers."""

    head: bytes  # length prefix ... up to the key
    middle: bytes  # between the key and the checksum
    between: bytes  # between the checksum and the per-layer checksums (b"" without them)
    layers_at: int  # where the per-layer checksums start (-1 without them)
    end: int  # header length, prefix included


@functools.lru_cache(maxsize=64)
def _template(fingerprint: bytes, payload_len: int, num_layers: int) -> _Template:
    digests = bytes(DIGEST_BYTES * num_layers) if num_layers else None
    blank = build_header(fingerprint, bytes(16), payload_len, bytes(DIGEST_BYTES), digests)

    def differs_at(other: bytes) -> int:
        return next(i for i, (a, b) in enumerate(zip(blank, other, strict=True)) if a != b)

    key_at = differs_at(build_header(fingerprint, b"\xff" * 16, payload_len, bytes(8), digests))
    checksum_at = differs_at(
        build_header(fingerprint, bytes(16), payload_len, b"\xff" * 8, digests)
    )
    if digests is None:
        return _Template(blank[:key_at], blank[key_at + 16 : checksum_at], b"", -1, len(blank))
    ones = b"\xff" * len(digests)
    layers_at = differs_at(build_header(fingerprint, bytes(16), payload_len, bytes(8), ones))
    return _Template(
        blank[:key_at],
        blank[key_at + 16 : checksum_at],
        blank[checksum_at + DIGEST_BYTES : layers_at],
        layers_at,
        len(blank),
    )


def _parse_fixed(
    view: memoryview, fingerprint: bytes, key: bytes, payload_len: int, num_layers: int
) -> Header | None:
    """Match a header against its layout's template; `None` if it is not one.

    The lmdb tier writes only these (six fields, or seven with `num_layers` per-layer
    checksums), and all of one layout differ only in key and checksums, so a byte
    comparison replaces a msgpack decode on the read path.
    """
    tpl = _template(fingerprint, payload_len, num_layers)
    head = bytes(view[: tpl.end])
    key_at = len(tpl.head)
    checksum_at = key_at + 16 + len(tpl.middle)
    after = checksum_at + DIGEST_BYTES
    if (
        len(head) == tpl.end
        and head.startswith(tpl.head)
        and head[key_at : key_at + 16] == key
        and head[key_at + 16 : checksum_at] == tpl.middle
        and head[after : after + len(tpl.between)] == tpl.between
    ):
        layers = head[tpl.layers_at :] if tpl.layers_at >= 0 else None
        return Header(payload_len, head[checksum_at:after], layers, tpl.end)
    return None


def parse_header(
    view: memoryview, *, fingerprint: bytes, key: bytes, payload_len: int, num_layers: int = 0
) -> tuple[Verdict, Header | None]:
    """Parse the header at the start of `view`; the payload itself is not checked.

    `num_layers`: the per-layer checksums the reader expects most values to carry (0:
    none), which picks the fast byte comparison; any other valid header still parses.
    """
    if len(fingerprint) == 16 and len(key) == 16:  # every real layout and key
        header = _parse_fixed(view, fingerprint, key, payload_len, num_layers)
        if header is None and num_layers:
            header = _parse_fixed(view, fingerprint, key, payload_len, 0)
        if header is not None:
            return Verdict.OK, header
    if view.nbytes < _PREFIX.size:
        return Verdict.CORRUPT, None
    (header_len,) = _PREFIX.unpack_from(view)
    end = _PREFIX.size + header_len
    if end > view.nbytes:
        return Verdict.CORRUPT, None
    try:
        fields = msgpack.unpackb(view[_PREFIX.size : end], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return Verdict.CORRUPT, None
    if (
        not isinstance(fields, list)
        or len(fields) not in (_BASE_FIELDS, _LAYER_FIELDS, _TAGGED_FIELDS)
        or fields[0] != MAGIC
    ):
        return Verdict.CORRUPT, None
    version, stored_fingerprint, stored_key, stored_len, checksum = fields[1:_BASE_FIELDS]
    if version != FORMAT_VERSION or stored_fingerprint != fingerprint or stored_key != key:
        return Verdict.FOREIGN, None
    layers = fields[_BASE_FIELDS] if len(fields) > _BASE_FIELDS else None
    tag = fields[_LAYER_FIELDS] if len(fields) == _TAGGED_FIELDS else None
    if (
        stored_len != payload_len
        or not isinstance(checksum, bytes)
        or len(checksum) != DIGEST_BYTES
        or not _valid_layers(layers, payload_len)
        or (len(fields) == _TAGGED_FIELDS and (not isinstance(tag, bytes) or len(tag) != _TAG))
    ):
        return Verdict.CORRUPT, None
    return Verdict.OK, Header(stored_len, checksum, layers, end, tag)


def _valid_layers(layers: object, payload_len: int) -> bool:
    if layers is None:
        return True
    if not isinstance(layers, bytes) or not layers or len(layers) % DIGEST_BYTES:
        return False
    return payload_len % (len(layers) // DIGEST_BYTES) == 0


def peek_header(raw: Bytes) -> tuple[bytes, int] | None:
    """Return the layout fingerprint and payload size a stored value claims, unverified.

    For tools that read values of any layout (`kvtiers inspect`); `None` when the header
    cannot be parsed. Pass the result to `check_value` to verify the value.
    """
    view = memoryview(raw).cast("B")
    if view.nbytes < _PREFIX.size:
        return None
    (header_len,) = _PREFIX.unpack_from(view)
    end = _PREFIX.size + header_len
    if end > view.nbytes:
        return None
    try:
        fields = msgpack.unpackb(view[_PREFIX.size : end], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if not isinstance(fields, list) or len(fields) < _BASE_FIELDS or fields[0] != MAGIC:
        return None
    fingerprint, payload_len = fields[2], fields[4]
    if not isinstance(fingerprint, bytes) or not isinstance(payload_len, int):
        return None
    return fingerprint, payload_len
