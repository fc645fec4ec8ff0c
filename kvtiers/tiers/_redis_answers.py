"""The answers of a redis tier's read pipeline: values, and what a bad key answers.

A pipeline runs with `raise_on_error=False`, so one command's error does not hide the
others' answers. A plain `ResponseError` to a GET, GETEX or GETRANGE is the server's
WRONGTYPE: a key of another type (a list, a hash) where a value belongs, written behind
kvtiers' back. It is read as garbage, which the tier judges corrupt and deletes like any
bad value; one such key must not fail the whole request and open the breaker. A server
out of memory (past `maxmemory`, with a policy that does not evict) refuses the recency
touch after the reads (its ZADD): the reads stand, and the touch answers `None`. Any other
error (a subclass such as `BusyLoadingError`, or one in a command that is not a read)
fails the request, as it would have raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import OutOfMemoryError, ResponseError

__all__ = ["GARBAGE", "read_answers"]

GARBAGE = b"\x00"
"""What a wrong-typed key reads as: no valid value, nor a missing one."""


def read_answers(results: Sequence[Any], num_reads: int) -> tuple[list[Any], list[Any]]:
    """Return the first `num_reads` answers (wrong types as `GARBAGE`), and the rest.

    Of the rest, a command refused for lack of memory answers `None`.

    Raises:
        RedisError: any other error a command answered.
    """
    for i, answer in enumerate(results):
        if not isinstance(answer, Exception):
            continue
        if i < num_reads and type(answer) is not ResponseError:
            raise answer
        if i >= num_reads and not isinstance(answer, OutOfMemoryError):
            raise answer
    reads = [GARBAGE if isinstance(a, Exception) else a for a in results[:num_reads]]
    rest = [None if isinstance(a, Exception) else a for a in results[num_reads:]]
    return reads, rest
