"""Fixed-size block accounting over one pre-allocated buffer."""

from __future__ import annotations

__all__ = ["BlockPool"]


class BlockPool:
    """Hand out fixed-size blocks by id from a free list, with pin counts.

    The pool only does the accounting; the tier that owns the buffer maps a block id to
    `buffer[block_id * block_bytes : (block_id + 1) * block_bytes]`. Allocation and free are
    O(1). A pinned block (a copy is reading or writing it) can be neither freed nor reused.

    Invariants: `num_free_blocks + num_used_blocks == num_blocks`; pin counts are >= 0 and only
    used blocks have pins.
    """

    __slots__ = ("_free", "_is_free", "_pins", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # NOTE: a stack, so the most recently freed (cache-warm) block is reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * num_blocks)
        self._pins = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks ready to allocate."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks allocated and not yet freed."""
        return self.num_blocks - len(self._free)

    def allocate(self) -> int | None:
        """Return a free block id, or `None` when none is free."""
        if not self._free:
            return None
        block_id = self._free.pop()
        self._is_free[block_id] = 0
        return block_id

    def allocate_many(self, count: int) -> list[int] | None:
        """Return `count` free block ids, or `None` (allocating nothing) if too few are free."""
        if count > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(count)]
        for block_id in ids:
            self._is_free[block_id] = 0
        return ids

    def free(self, block_id: int) -> None:
        """Return a used, unpinned block to the free list.

        Raises:
            ValueError: the block is already free or is pinned.
        """
        self._check_used(block_id)
        if self._pins[block_id]:
            raise ValueError(f"block {block_id} is pinned ({self._pins[block_id]})")
        self._is_free[block_id] = 1
        self._free.append(block_id)

    def pin(self, block_id: int) -> None:
        """Add one pin to a used block."""
        self._check_used(block_id)
        self._pins[block_id] += 1

    def unpin(self, block_id: int) -> None:
        """Remove one pin from a block.

        Raises:
            ValueError: the block id is out of range or the block has no pin.
        """
        self._check_range(block_id)
        if self._pins[block_id] <= 0:
            raise ValueError(f"block {block_id} is not pinned")
        self._pins[block_id] -= 1

    def pin_count(self, block_id: int) -> int:
        """Return the number of pins on a block."""
        return self._pins[block_id]

    def is_free(self, block_id: int) -> bool:
        """Return whether a block is on the free list."""
        return bool(self._is_free[block_id])

    def total_pins(self) -> int:
        """Return the sum of all pin counts (zero when no copy is in flight)."""
        return sum(self._pins)

    def _check_range(self, block_id: int) -> None:
        # NOTE: without this, a negative id would index another block from the end.
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def _check_used(self, block_id: int) -> None:
        self._check_range(block_id)
        if self._is_free[block_id]:
            raise ValueError(f"block {block_id} is free")
