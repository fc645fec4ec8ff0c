"""GPU-memory tier: chunks in blocks of one pre-allocated device buffer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvtiers.core.blockpool import BlockPool
from kvtiers.core.checks import describe
from kvtiers.core.config import TierConfig
from kvtiers.core.errors import ConfigError, TierIOError
from kvtiers.core.keys import ChunkKey
from kvtiers.core.layout import KVLayout
from kvtiers.gpu._streams import CopyStream, Event, copy_pairs, wait_event
from kvtiers.gpu.paged import host_tensor
from kvtiers.tiers.base import Buffer, HostCopy, copy_serially
from kvtiers.tiers.blocks import BlockTier

__all__ = ["HBMTier"]

_POLL_S = 2.5e-4


class HBMTier(BlockTier[torch.Tensor]):
    """GPU memory tier: one device buffer of blocks, one chunk per block.

    Beyond the tier contract (whose `get`/`put` copy between device blocks and host
    buffers on the tier's own stream, from a worker thread on CUDA so that the event loop
    never blocks) it offers, like `MemoryTier`, `pinned` (device views of resident chunks,
    pinned for the context) and `reserve` (device blocks to fill in place). A copy engine
    reads and writes those views directly, so loading a chunk kept here into an engine's
    paged KV is one device-to-device copy. Eviction is the cache's job: `put` declines
    when no block is free.

    Config option `device` (default `"cuda:0"`) names the device. `"cpu"` is accepted as
    a test seam, so the tier's logic runs on machines without a GPU; it is not meant for
    production (use `dram`).

    Args:
        config: this tier's config.
        layout: the KV layout.
        host_copy: copies host-to-host pairs of `copy_views` (on the CPU seam); one
            `np.copyto` after another when not given. The cache passes its copy threads
            (resource `host_copy`).

    Raises:
        ConfigError: an unknown option, a bad device, or a capacity below one chunk.
    """

    kind = "hbm"
    _OPTIONS = frozenset({"device"})

    def __init__(
        self, config: TierConfig, layout: KVLayout, host_copy: HostCopy | None = None
    ) -> None:
        super().__init__(config, layout)
        self.device = _parse_device(config.options.get("device", "cuda:0"), config.where)
        """The device holding the blocks."""
        self._host_copy = host_copy or copy_serially
        self._buffer = torch.empty(0, dtype=torch.uint8)
        # Aborted copies: each release (unpin or free) runs once its event has fired.
        self._limbo: list[tuple[Event, Callable[[], None]]] = []
        self._stream: CopyStream | None = None

    @classmethod
    def from_config(cls, config: TierConfig, layout: KVLayout, **resources: Any) -> HBMTier:
        # docstring inherited
        return cls(config, layout, host_copy=resources.get("host_copy"))

    async def _open(self) -> None:
        where = f"{self.config.where}.device"
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"{where}: the hbm tier needs CUDA, and no CUDA device is present"
                )
            if (self.device.index or 0) >= torch.cuda.device_count():
                raise ConfigError(f"{where}: no device {self.device}")
        try:
            buffer = torch.empty(
                self.num_chunks * self.layout.chunk_bytes, dtype=torch.uint8, device=self.device
            )
        except RuntimeError as exc:  # torch.OutOfMemoryError derives from it
            raise TierIOError(f"hbm tier {self.name!r}: cannot allocate: {exc}") from exc
        self._buffer = buffer
        self._pool = BlockPool(self.num_chunks)
        self._stream = CopyStream(self.device)

    async def _close(self) -> None:
        for event, _ in self._limbo:
            await wait_event(event, max_interval_s=_POLL_S)
        self._limbo.clear()
        self._blocks.clear()
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._stream = None

    @property
    def buffer(self) -> torch.Tensor:
        """The whole device buffer."""
        return self._buffer

    def block_view(self, block_id: int) -> torch.Tensor:
        """Return the 1-D uint8 device view of one block."""
        size = self.layout.chunk_bytes
        return self._buffer[block_id * size : (block_id + 1) * size]

    async def get(self, keys: Sequence[ChunkKey], dsts: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        self._check_buffers(keys, dsts)
        found = [self._blocks.get(key) for key in keys]
        hits = [(dst, b) for dst, b in zip(dsts, found, strict=True) if b is not None]
        held = [b for _, b in hits]
        for block_id in held:
            self._pool.pin(block_id)

        def copy() -> None:
            for dst, block_id in hits:
                _to_host(self.block_view(block_id), dst)

        await self._copy(copy, on_abort=lambda: self._unpin(held))
        self._unpin(held)
        self.counters.hits += len(hits)
        self.counters.misses += len(keys) - len(hits)
        self.counters.bytes_read += len(hits) * self.layout.chunk_bytes
        return [b is not None for b in found]

    async def put(self, keys: Sequence[ChunkKey], srcs: Sequence[Buffer]) -> list[bool]:
        # docstring inherited
        self._ensure_open()
        self._check_buffers(keys, srcs)
        self._reclaim()
        stored = [key in self._blocks for key in keys]
        writes: list[tuple[int, ChunkKey, int]] = []
        taken: set[ChunkKey] = set()
        for i, key in enumerate(keys):
            if stored[i] or key in taken:
                stored[i] = True
                continue
            block_id = self._pool.allocate()
            if block_id is None:
                self.counters.declined += 1
                continue
            writes.append((i, key, block_id))
            taken.add(key)
        blocks = [b for _, _, b in writes]

        def copy() -> None:
            for i, _, block_id in writes:
                _to_device(srcs[i], self.block_view(block_id))

        await self._copy(copy, on_abort=lambda: self._free(blocks))
        for i, key, block_id in writes:
            if key in self._blocks:  # stored by a concurrent put meanwhile
                self._pool.free(block_id)
            else:
                self._commit(key, block_id)
            stored[i] = True
        return stored

    async def copy_views(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run `dst.copy_(src)` for each pair, one side a view of this tier's blocks.

        This is how chunks move between this tier's blocks and other memory without a
        call per chunk on the event loop: a lower tier's pinned blocks or a stage on
        promotion, a stage or a lower tier's reserved blocks on demotion, a caller's
        tensors on load and store. On CUDA the copies are queued on the tier's stream
        from a worker thread, which then synchronises once (pinned host memory moves by
        DMA; pageable memory is staged by the driver); on the CPU seam they run inline.

        The copies are ordered after the work already queued on the calling thread's
        current stream, and have landed when this returns. The views belong to the
        caller's `pinned` or `reserve` context, which must not end under a copy in flight:
        a cancellation that arrives meanwhile is raised once every copy has landed.

        Args:
            pairs: `(dst, src)` tensors of one shape and dtype.

        Raises:
            TierIOError: a copy failed on the device.
        """
        self._ensure_open()
        assert self._stream is not None  # set by _open
        try:
            await copy_pairs(self._stream, pairs, self._host_copy)
        except (RuntimeError, ValueError) as exc:
            raise TierIOError(f"hbm tier {self.name!r}: copy failed: {exc}") from exc

    async def _copy(self, copy: Callable[[], None], on_abort: Callable[[], None]) -> None:
        """Run `copy` (host buffers to or from blocks) without blocking the event loop.

        On CPU it runs inline. On CUDA it runs in a worker thread on the tier's stream,
        which it then synchronises: host buffers may be pageable, and a pageable copy is
        synchronous. If the wait fails or is cancelled, `on_abort` (unpin or free the
        blocks) runs only once the thread's copies have finished.

        Raises:
            TierIOError: the copy failed on the device.
        """
        stream = self._stream
        assert stream is not None  # set by _open; the caller checked that the tier is open
        if not stream.is_cuda:
            copy()
            return
        finished = threading.Event()

        def work() -> None:
            try:
                with stream.use():
                    copy()
                    stream.synchronize()
            finally:
                finished.set()

        try:
            await asyncio.get_running_loop().run_in_executor(None, work)
        except BaseException as exc:
            self._limbo.append((_Finished(finished), on_abort))
            if isinstance(exc, Exception):
                raise TierIOError(f"hbm tier {self.name!r}: copy failed: {exc}") from exc
            raise

    def _reclaim(self) -> None:
        """Release the blocks of aborted copies whose device work has finished."""
        waiting = []
        for event, release in self._limbo:
            if event.query():
                release()
            else:
                waiting.append((event, release))
        self._limbo = waiting


class _Finished:
    """The event of a worker thread's copies: fired once the thread is done."""

    __slots__ = ("_flag",)

    def __init__(self, flag: threading.Event) -> None:
        self._flag = flag

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self._flag.wait()


def _parse_device(value: object, where: str) -> torch.device:
    if not isinstance(value, str):
        raise ConfigError(
            f"{where}.device: expected a device name such as 'cuda:0', got {describe(value)}"
        )
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"{where}.device: {describe(value)} is not a device name ({exc})"
        ) from exc
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(
            f"{where}.device: {describe(value)} is not a CUDA device such as 'cuda:0'"
        )
    return device if device.type == "cpu" or device.index is not None else torch.device("cuda", 0)


def _to_host(block: torch.Tensor, dst: Buffer) -> None:
    host = host_tensor(dst)
    if host is None:
        np.copyto(dst, block.cpu().numpy().reshape(dst.shape))
        return
    pinned = block.is_cuda and host.is_pinned()
    host.copy_(block.view(host.shape), non_blocking=pinned)


def _to_device(src: Buffer, block: torch.Tensor) -> None:
    host = host_tensor(src)
    if host is None:
        host = torch.from_numpy(np.ascontiguousarray(src))
    pinned = block.is_cuda and host.is_pinned()
    block.view(host.shape).copy_(host, non_blocking=pinned)
