"""The arguments SGLang hands the HiCache storage backend, checked before any page moves.

A bad argument is a miss, never an exception into SGLang's threads and never a page read
into, or stored from, a slot the call did not mean: each check here raises
`BadArgumentError` with a short `reason` (the argument at fault), which the backend turns
into a miss, logs and counts (`KVTiersStorage.rejected`).

What SGLang passes, and so what is accepted:

- page hashes: a list (or tuple) of non-empty strings;
- host indices: one integer tensor index per token, `num_pages * page_size` of them in one
  dimension, each page's run consecutive from a multiple of the page size, inside the
  pool (`page_starts`);
- `extra_info`: `None` or an object whose `prefix_keys` is `None` or a list of hashes;
- v2 transfers: a list of `PoolTransfer`-like objects, each with a string `name` (SGLang's
  `PoolName` is a `str`), `keys` a list of hashes or `None`, and `host_indices`;
- flat pages (the generic path): tensors of the pool's dtype, one page each.

Imports no SGLang module: it reads the arguments' attributes only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtiers.core.errors import InvalidInputError

__all__ = [
    "BadArgumentError",
    "Transfer",
    "capacity_of",
    "checked_transfers",
    "count_of",
    "flat_pages",
    "missed_transfers",
    "page_keys",
    "page_starts",
    "parent_hash",
    "pool_name",
    "transfer_list",
    "transfer_of",
]

_INDEX_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


class BadArgumentError(InvalidInputError):
    """An argument the backend cannot use; the call is served as a miss.

    Args:
        reason: the argument at fault (`"keys"`, `"host_indices"`, ...), the key under
            which the backend counts it.
        detail: what is wrong with it.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _kind(value: Any) -> str:
    return type(value).__name__


def count_of(keys: Any) -> int:
    """Return the length of an aligned answer to `keys`: 0 unless they are a list."""
    return len(keys) if isinstance(keys, list | tuple) else 0


def page_keys(keys: Any, reason: str = "keys") -> list[str]:
    """Return `keys` as a list of page hashes.

    Raises:
        BadArgumentError: not a list or tuple, or a hash that is not a non-empty string.
    """
    if not isinstance(keys, list | tuple):
        raise BadArgumentError(reason, f"expected a list of page hashes, got {_kind(keys)}")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            raise BadArgumentError(reason, f"[{i}]: expected a non-empty str, got {key!r:.40}")
    return list(keys)


def parent_hash(extra_info: Any) -> str | None:
    """Return the page hash just before a call's keys (`extra_info.prefix_keys[-1]`).

    Only the last prefix hash is read (it links the call's pages to their prefix), so
    only it is checked.

    Raises:
        BadArgumentError: `extra_info` has no `prefix_keys`, or they are not page hashes.
    """
    if extra_info is None:
        return None
    if not hasattr(extra_info, "prefix_keys"):
        raise BadArgumentError("extra_info", f"expected prefix_keys, got {_kind(extra_info)}")
    prefix = extra_info.prefix_keys
    if prefix is None:
        return None
    if not isinstance(prefix, list | tuple):
        raise BadArgumentError("extra_info", f"prefix_keys: expected a list, got {_kind(prefix)}")
    return page_keys(prefix[-1:], "extra_info")[0] if prefix else None


def capacity_of(pool: Any) -> int | None:
    """Return how many tokens (slots) a host pool holds, when it says (`size`)."""
    size = getattr(pool, "size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def page_starts(
    host_indices: Any, num_pages: int, page_size: int, capacity: int | None, *, write: bool
) -> list[int]:
    """Return the first host slot of each of `num_pages` pages at `host_indices`.

    A read may not name one page twice: both keys would report a hit, and the page would
    hold only one of them.

    Raises:
        BadArgumentError: not a 1-D integer tensor of `num_pages * page_size` indices,
            a page whose run is not consecutive from a multiple of `page_size`, a page
            outside `[0, capacity)`, or a page read twice.
    """
    if not isinstance(host_indices, torch.Tensor):
        raise BadArgumentError("host_indices", f"expected a tensor, got {_kind(host_indices)}")
    if host_indices.dtype not in _INDEX_DTYPES:
        raise BadArgumentError("host_indices", f"expected integers, got {host_indices.dtype}")
    if host_indices.dim() != 1 or host_indices.numel() != num_pages * page_size:
        raise BadArgumentError(
            "host_indices",
            f"expected {num_pages} pages of {page_size} in one dimension, "
            f"got shape {tuple(host_indices.shape)}",
        )
    if not num_pages:
        return []
    runs = host_indices.to("cpu", torch.int64).reshape(num_pages, page_size)
    starts = runs[:, 0]
    if page_size > 1 and not torch.equal(
        runs - starts[:, None], torch.arange(page_size).expand_as(runs)
    ):
        raise BadArgumentError("host_indices", "a page's indices are not consecutive")
    if bool((starts % page_size).any()):
        raise BadArgumentError(
            "host_indices", f"a page does not start at a multiple of {page_size}"
        )
    low, high = int(starts.min()), int(starts.max()) + page_size
    if low < 0 or (capacity is not None and high > capacity):
        raise BadArgumentError(
            "host_indices", f"pages span [{low}, {high}), outside the pool's {capacity} slots"
        )
    first = [int(start) for start in starts.tolist()]
    if not write and len(set(first)) != num_pages:
        raise BadArgumentError("host_indices", "a read names one page twice")
    return first


def flat_pages(
    pages: Any, num_pages: int, dtype: torch.dtype, shape: Sequence[int], *, write: bool
) -> list[torch.Tensor]:
    """Return the flat pages of a generic call (SGLang's `get_data_page(i, flat=True)`).

    A page to read into must be contiguous: the read goes into a view of it.

    Raises:
        BadArgumentError: not a list of `num_pages` tensors of `dtype`, each of one page's
            size (`shape`), or a page to read into that is not contiguous.
    """
    what = "values" if write else "targets"
    if not isinstance(pages, list | tuple) or len(pages) != num_pages:
        count = len(pages) if isinstance(pages, list | tuple) else _kind(pages)
        raise BadArgumentError(what, f"expected a list of {num_pages} pages, got {count}")
    size = math.prod(shape)
    for i, page in enumerate(pages):
        if not isinstance(page, torch.Tensor):
            raise BadArgumentError(what, f"[{i}]: expected a tensor, got {_kind(page)}")
        if page.dtype != dtype or page.numel() != size:
            raise BadArgumentError(
                what, f"[{i}]: expected {size} {dtype}, got {page.numel()} {page.dtype}"
            )
        if not write and not page.is_contiguous():
            raise BadArgumentError(what, f"[{i}]: a page to read into must be contiguous")
    return list(pages)


def transfer_list(transfers: Any, *, optional: bool) -> list[Any]:
    """Return a v2 call's transfers as a list (`None` is none where they are optional).

    Raises:
        BadArgumentError: not a list or tuple.
    """
    if transfers is None and optional:
        return []
    if not isinstance(transfers, list | tuple):
        raise BadArgumentError("transfers", f"expected a list, got {_kind(transfers)}")
    return list(transfers)


def missed_transfers(transfers: Any) -> dict[str, list[bool]]:
    """Return a v2 call's all-miss answer: `False` per key of each pool it names."""
    answer: dict[str, list[bool]] = {}
    for transfer in transfers if isinstance(transfers, list | tuple) else ():
        name = getattr(transfer, "name", None)
        if isinstance(name, str) and name:
            answer[name] = [False] * count_of(getattr(transfer, "keys", None))
    return answer


def pool_name(transfer: Any) -> str:
    """Return the pool a transfer names (a `PoolName`, itself a `str`), as it was passed.

    Raises:
        BadArgumentError: no `name`, or one that is not a non-empty string.
    """
    if not hasattr(transfer, "name"):
        raise BadArgumentError("transfers", f"expected a PoolTransfer, got {_kind(transfer)}")
    name = transfer.name
    if not isinstance(name, str) or not name:
        raise BadArgumentError("transfers", f"name: expected a pool name, got {name!r:.40}")
    return name


@dataclass(frozen=True, slots=True)
class Transfer:
    """One pool's part of a v2 call, its fields checked (`transfer_of`)."""

    name: str
    """The pool's name as SGLang passed it (the key of its answer)."""
    keys: list[str]
    """The page hashes (`None` in the `PoolTransfer` is none)."""
    host_indices: Any
    """Unchecked here: what they must be depends on the pool (`page_starts`)."""
    hit_policy: str
    """The hit policy's value (`"all_pages"`, `"trailing_pages"`, ...)."""


def transfer_of(transfer: Any) -> Transfer:
    """Return a transfer's fields, checked.

    Raises:
        BadArgumentError: a field is missing or of the wrong type.
    """
    name = pool_name(transfer)
    keys = getattr(transfer, "keys", None)
    policy = getattr(transfer, "hit_policy", "all_pages")
    return Transfer(
        name,
        [] if keys is None else page_keys(keys),
        getattr(transfer, "host_indices", None),
        str(getattr(policy, "value", policy)),
    )


def checked_transfers(
    transfers: Any, *, optional: bool = False
) -> tuple[list[Transfer], list[BadArgumentError]]:
    """Return a v2 call's well-formed transfers, and what is wrong with the others.

    `None` is no transfers where they are `optional` (`batch_exists_v2`'s).

    A pool named twice keeps its first transfer: one answer per pool could not say which
    of the two it is about.

    Raises:
        BadArgumentError: `transfers` is not a list.
    """
    good: list[Transfer] = []
    bad: list[BadArgumentError] = []
    for item in transfer_list(transfers, optional=optional):
        try:
            transfer = transfer_of(item)
            if any(str(other.name) == str(transfer.name) for other in good):
                raise BadArgumentError("transfers", f"pool {transfer.name!s} named twice")
            good.append(transfer)
        except BadArgumentError as exc:
            bad.append(exc)
    return good, bad
