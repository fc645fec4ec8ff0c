"""Get files out of the OS page cache and say how much of them stayed (`kvtiers bench --cold`).

`drop` needs no root: it `fsync`s each file, since `POSIX_FADV_DONTNEED` drops only clean
pages (a tier with `sync = false` leaves written pages dirty), then asks the kernel to drop
the file's pages. Pages that a process maps stay resident, so a caller closes its own maps
first; another process's maps keep theirs, which `resident_fraction` shows. It asks
`mincore` about a map of its own that touches no page, so checking loads nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable, Iterator

import numpy as np

__all__ = ["can_drop", "drop", "resident_fraction"]

_WINDOW_PAGES = 1 << 16  # pages asked about per mincore call: a 64 KiB vector, however big


def can_drop() -> bool:
    """Return whether this platform can drop a file's pages (`posix_fadvise`)."""
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def drop(paths: Iterable[str]) -> None:
    """Write back, then drop from the page cache, every file of `paths` that exists.

    Side effects: other processes reading these files read them from the disk again.

    Raises:
        OSError: a file cannot be opened, synced or advised.
    """
    for _, fd in _opened(paths):
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def resident_fraction(paths: Iterable[str]) -> float | None:
    """Return the fraction of the pages of `paths` in the page cache; `None` without mincore.

    Raises:
        OSError: a file cannot be opened or mapped, or `mincore` fails.
    """
    libc = _libc()
    if libc is None:
        return None
    resident = total = 0
    for path, fd in _opened(paths):
        found, pages = _resident_pages(libc, fd, path)
        resident += found
        total += pages
    return resident / total if total else 0.0


def _opened(paths: Iterable[str]) -> Iterator[tuple[str, int]]:
    """Yield each file of `paths` that exists with a read-only descriptor, closed after."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            yield path, fd
        finally:
            os.close(fd)


def _libc() -> ctypes.CDLL | None:
    """Return the C library with `mmap`, `munmap` and `mincore` typed; `None` if absent."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        *(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int),
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def _resident_pages(libc: ctypes.CDLL, fd: int, path: str) -> tuple[int, int]:
    """Return how many of the pages of the open file `fd` are resident, and its pages."""
    size = os.fstat(fd).st_size
    if not size:
        return 0, 0
    pages = -(-size // mmap.PAGESIZE)
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), f"cannot map {path}")
    try:
        vec = (ctypes.c_ubyte * min(pages, _WINDOW_PAGES))()
        resident = 0
        for first in range(0, pages, _WINDOW_PAGES):
            num_pages = min(_WINDOW_PAGES, pages - first)
            start = addr + first * mmap.PAGESIZE
            length = min(size - first * mmap.PAGESIZE, num_pages * mmap.PAGESIZE)
            if libc.mincore(start, length, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
            # NOTE: bit 0 of each byte is the page's residency; the other bits are reserved.
            resident += int(
                (np.frombuffer(memoryview(vec).cast("B"), np.uint8, num_pages) & 1).sum()
            )
    finally:
        libc.munmap(addr, size)
    return resident, pages
