"""Tell the kernel which local files a batch of reads will want next.

A cold object read from a local or mounted filesystem waits for the disk, and with few reads
in flight the disk sees a shallow queue: one file per object gets no readahead across
files. Asking the kernel (`POSIX_FADV_WILLNEED`) to start reading the next few objects of
the batch while this one is read keeps more requests in flight. Measured on a 2-vCPU VM's
virtio disk, 64 cold 8 MiB files read one at a time: 599 MiB/s plain, 694 / 781 / 877 /
823 MiB/s with 1 / 2 / 4 / 8 files hinted ahead (medians of 3, a flat file 1,328). Through
the remote tier, in-process A/B, cold: one read in flight 412-445 -> 588-723 MiB/s; four
in flight 728-797 -> 662-795 (no gain: the reads already keep the disk busy, and deeper
queues were slower on this disk), so the tier hints only below `HINT_AHEAD` reads in
flight. Warm loads were unchanged (1,619 vs 1,747 MiB/s at one in flight).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["HINT_AHEAD", "HINT_MIN_BYTES", "ahead_of", "will_need"]

HINT_AHEAD = 4  # objects hinted ahead of the one being read
HINT_MIN_BYTES = 1 << 20  # smaller objects: a hint's three syscalls cost more than it saves


def ahead_of(paths: Sequence[str], i: int) -> Sequence[str]:
    """Return the paths to hint when read `i` of a batch starts: each once, ahead of it.

    The first read hints the next `HINT_AHEAD` objects; read `i` then hints the one
    `HINT_AHEAD` places after it.
    """
    if i == 0:
        return paths[1 : 1 + HINT_AHEAD]
    return paths[i + HINT_AHEAD : i + HINT_AHEAD + 1]


def will_need(paths: Sequence[str]) -> None:
    """Ask the kernel to start reading `paths` into the page cache (blocking, quick).

    A path that cannot be opened (gone, never written) or hinted (not a regular file) is
    skipped: the read itself will say.
    Nothing happens where the platform has no `posix_fadvise`.
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for path in paths:
        try:
            # NOTE: O_NONBLOCK, so a named pipe in the way opens at once instead of waiting
            # for a writer; it changes nothing for a regular file.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
