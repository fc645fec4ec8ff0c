"""The remote tier's objects as bytes: their size, packing, and checked copies into buffers.

An object is a chunk in the lmdb tier's format (`_chunk_format`) with per-layer checksums,
and an integrity tag when the tier's options ask for one. Nothing reaches a caller's buffer
before it is verified. Chunks from `_OFFLOAD_BYTES` are checked and copied in a small
thread pool, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.tiers import _chunk_format as fmt
from kvtiers.tiers._cancellation import wait_out
from kvtiers.tiers._chunk_format import Verdict
from kvtiers.tiers._integrity import auth_key_from_config
from kvtiers.tiers._remote_layers import LayerPlan, Pieces, write_layers
from kvtiers.tiers.base import Buffer

__all__ = ["ObjectCodec"]

_T = TypeVar("_T")
_OFFLOAD_BYTES = 256 * 2**10  # chunks from this size are checked and copied off the loop


class ObjectCodec:
    """Pack chunks into the remote tier's objects; verify objects and copy them out.

    Args:
        config: the tier's config (capacity, integrity options).
        layout: the KV layout of the chunks.

    Raises:
        ConfigError: bad integrity options, or a capacity that cannot hold one object.
    """

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        self.layout = layout
        self.fingerprint = layout.fingerprint
        self.auth_key = auth_key_from_config(config)
        self.header_len = fmt.header_bytes(
            self.fingerprint,
            layout.chunk_bytes,
            num_layers=layout.num_layers,
            tagged=self.auth_key is not None,
        )
        self.value_bytes = self.header_len + layout.chunk_bytes
        """Bytes of one stored object (header and payload)."""
        if config.capacity_bytes < self.value_bytes:
            raise ConfigError(
                f"{config.where}.capacity: capacity too small for one chunk; a stored chunk "
                f"takes {self.value_bytes} bytes (header and payload), got {config.capacity_bytes}"
            )
        self._cpu: ThreadPoolExecutor | None = None

    def open(self, name: str) -> None:
        """Start the thread pool if chunks are large (`name`: the tier's, for its threads)."""
        if self.layout.chunk_bytes >= _OFFLOAD_BYTES:
            self._cpu = ThreadPoolExecutor(4, thread_name_prefix=f"kvtiers-remote-{name}")

    async def close(self) -> None:
        """Wait for the thread pool's work to end and stop it."""
        if self._cpu is not None:
            await asyncio.to_thread(self._cpu.shutdown, wait=True)

    def pack(self, key: ChunkKey, src: Buffer) -> bytes:
        """Return the object that stores the chunk `src` under `key`."""
        payload = np.ascontiguousarray(src).reshape(-1)
        return fmt.pack_value(
            self.fingerprint,
            key,
            payload.data,
            num_layers=self.layout.num_layers,
            auth_key=self.auth_key,
        )

    async def judge(
        self, key: ChunkKey, raw: bytes | memoryview | None, dst: Buffer
    ) -> tuple[Verdict | None, int]:
        """Check one object read and copy it into `dst`; its verdict (`None`: none) and size."""
        if raw is None:
            return None, 0
        return await self.offload(self._check_and_copy, key, raw, dst), len(raw)

    async def deliver_layers(
        self, key: ChunkKey, got: Pieces | bytes | memoryview | None, plan: LayerPlan, dst: Buffer
    ) -> tuple[Verdict | None, int]:
        """Copy the layers of `plan` that a ranged read returned into `dst`.

        `got` is the verified layers, or the whole object (checked here first), or `None`
        for none. Returns its verdict and the object's size.
        """
        if got is None:
            return None, 0
        if isinstance(got, bytes | memoryview):
            return await self.offload(self._check_and_copy_layers, key, got, plan, dst)
        await self.offload(write_layers, dst, got, self.layout.num_layers)
        return Verdict.OK, self.value_bytes

    def _check(self, key: ChunkKey, raw: bytes | memoryview) -> tuple[Verdict, memoryview | None]:
        return fmt.check_value(
            raw,
            fingerprint=self.fingerprint,
            key=key,
            payload_len=self.layout.chunk_bytes,
            auth_key=self.auth_key,
            num_layers=self.layout.num_layers,
        )

    def _check_and_copy(self, key: ChunkKey, raw: bytes | memoryview, dst: Buffer) -> Verdict:
        return fmt.check_into(
            raw,
            dst,
            fingerprint=self.fingerprint,
            key=key,
            payload_len=self.layout.chunk_bytes,
            auth_key=self.auth_key,
            num_layers=self.layout.num_layers,
        )

    def _check_and_copy_layers(
        self, key: ChunkKey, raw: bytes | memoryview, plan: LayerPlan, dst: Buffer
    ) -> tuple[Verdict, int]:
        verdict, payload = self._check(key, raw)
        if payload is not None:
            write_layers(dst, plan.from_payload(payload), self.layout.num_layers)
        return verdict, len(raw)

    async def offload(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run CPU work on a chunk (checksum, copy) off the loop when chunks are large.

        On cancellation the work is waited for, so nothing touches a caller's buffer later.
        """
        if self._cpu is None:
            return fn(*args)
        fut = asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await wait_out({fut})
            raise
