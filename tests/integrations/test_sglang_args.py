"""The SGLang backend's argument checks, without SGLang installed.

The checks run on plain values and stand-in transfers here; the same cases against the
real backend and host pools run in `test_sglang_malformed.py` (SGLang's virtualenv).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvtiers import InvalidInputError
from kvtiers.integrations._sglang_args import (
    BadArgumentError,
    Transfer,
    capacity_of,
    checked_transfers,
    count_of,
    flat_pages,
    missed_transfers,
    page_keys,
    page_starts,
    parent_hash,
    transfer_of,
)


@dataclass
class StandInTransfer:
    name: Any
    keys: Any = None
    host_indices: Any = None
    hit_policy: Any = "all_pages"


def idx(*values: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def pages(*starts: int, size: int = 4) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + size) for s in starts])


@pytest.mark.parametrize(
    ("keys", "count"), [(["a", "b"], 2), (("a",), 1), ([], 0), (None, 0), ("ab", 0), (3, 0)]
)
def test_an_aligned_answer_has_a_slot_per_key_of_a_list(keys, count):
    assert count_of(keys) == count


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        (None, "keys: expected a list of page hashes, got NoneType"),
        ("ab", "keys: expected a list of page hashes, got str"),
        ({"a": 1}, "got dict"),
        (["a", 1], r"keys: \[1\]: expected a non-empty str, got 1"),
        (["a", ""], r"\[1\]: expected a non-empty str"),
        ([b"a"], r"\[0\]: expected a non-empty str, got b'a'"),
        ([None], r"\[0\]"),
    ],
)
def test_page_keys_refuse_anything_but_a_list_of_strings(keys, match):
    with pytest.raises(BadArgumentError, match=match) as info:
        page_keys(keys)
    assert info.value.reason == "keys"
    assert isinstance(info.value, InvalidInputError)  # rooted at KVTiersError


def test_page_keys_take_lists_and_tuples():
    assert page_keys(("a", "b")) == ["a", "b"] and page_keys([]) == []


@pytest.mark.parametrize(
    ("extra_info", "parent"),
    [
        (None, None),
        (SimpleNamespace(prefix_keys=None), None),
        (SimpleNamespace(prefix_keys=[]), None),
        (SimpleNamespace(prefix_keys=["a", "b"]), "b"),
        (SimpleNamespace(prefix_keys=(1, "b")), "b"),  # only the last one is read
    ],
)
def test_parent_hash_is_the_last_prefix_key(extra_info, parent):
    assert parent_hash(extra_info) == parent


@pytest.mark.parametrize(
    ("extra_info", "match"),
    [
        ("info", "extra_info: expected prefix_keys, got str"),
        (SimpleNamespace(prefix_keys="abc"), "prefix_keys: expected a list, got str"),
        (SimpleNamespace(prefix_keys=["a", 2]), r"extra_info: \[0\]: expected a non-empty str"),
    ],
)
def test_parent_hash_refuses_malformed_extra_info(extra_info, match):
    with pytest.raises(BadArgumentError, match=match) as info:
        parent_hash(extra_info)
    assert info.value.reason == "extra_info"


@pytest.mark.parametrize(
    ("host_indices", "num_pages", "starts"),
    [
        (pages(8, 0), 2, [8, 0]),
        (pages(8, 4).to(torch.int32), 2, [8, 4]),
        (pages(4).to(torch.uint8), 1, [4]),
        (torch.empty(0, dtype=torch.int64), 0, []),
    ],
)
def test_page_starts_give_each_pages_first_slot(host_indices, num_pages, starts):
    assert page_starts(host_indices, num_pages, 4, 16, write=False) == starts


@pytest.mark.parametrize(
    ("host_indices", "num_pages", "match"),
    [
        (None, 1, "expected a tensor, got NoneType"),
        ([0, 1, 2, 3], 1, "expected a tensor, got list"),
        (np.arange(4), 1, "expected a tensor, got ndarray"),
        (pages(0).float(), 1, "expected integers, got torch.float32"),
        (pages(0) > -1, 1, "expected integers, got torch.bool"),
        (pages(0), 2, r"expected 2 pages of 4 in one dimension, got shape \(4,\)"),
        (pages(0, 4, 8), 2, r"got shape \(12,\)"),
        (pages(0, 4).view(2, 4), 2, r"got shape \(2, 4\)"),
        (idx(0, 2, 1, 3), 1, "not consecutive"),
        (pages(2), 1, "does not start at a multiple of 4"),
        (pages(-4), 1, r"pages span \[-4, 0\), outside the pool's 16 slots"),
        (pages(12, 16), 2, r"pages span \[12, 20\), outside"),
        (pages(4, 4), 2, "a read names one page twice"),
    ],
)
def test_page_starts_refuse_indices_that_are_not_one_page_per_key(host_indices, num_pages, match):
    with pytest.raises(BadArgumentError, match=match) as info:
        page_starts(host_indices, num_pages, 4, 16, write=False)
    assert info.value.reason == "host_indices"


def test_page_starts_let_a_write_store_one_page_twice_and_a_pool_without_size_grow():
    assert page_starts(pages(4, 4), 2, 4, 16, write=True) == [4, 4]
    assert page_starts(pages(400), 1, 4, None, write=False) == [400]
    with pytest.raises(BadArgumentError, match="outside"):
        page_starts(pages(-4), 1, 4, None, write=False)


@pytest.mark.parametrize(
    ("pool", "capacity"),
    [
        (SimpleNamespace(size=64), 64),
        (SimpleNamespace(size=0), None),
        (SimpleNamespace(size=True), None),
        (SimpleNamespace(size="64"), None),
        (object(), None),
    ],
)
def test_capacity_is_a_pools_positive_int_size(pool, capacity):
    assert capacity_of(pool) == capacity


PAGE = (2, 3)  # a page of 6 elements


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (None, "expected a list of 1 pages, got NoneType"),
        (torch.zeros(6), "expected a list of 1 pages, got Tensor"),
        ([], "expected a list of 1 pages, got 0"),
        ([None], r"\[0\]: expected a tensor, got NoneType"),
        ([torch.zeros(6, dtype=torch.float16)], r"\[0\]: expected 6 torch.bfloat16, got 6 torch.f"),
        ([torch.zeros(5, dtype=torch.bfloat16)], "got 5 torch.bfloat16"),
    ],
)
def test_flat_pages_refuse_anything_but_one_page_per_key(values, match):
    with pytest.raises(BadArgumentError, match=match) as info:
        flat_pages(values, 1, torch.bfloat16, PAGE, write=True)
    assert info.value.reason == "values"


def test_flat_pages_to_read_into_must_be_contiguous():
    strided = torch.zeros(12, dtype=torch.bfloat16)[::2]
    assert flat_pages([strided], 1, torch.bfloat16, PAGE, write=True) == [strided]
    with pytest.raises(BadArgumentError, match="must be contiguous") as info:
        flat_pages([strided], 1, torch.bfloat16, PAGE, write=False)
    assert info.value.reason == "targets"


def test_transfer_fields_are_checked():
    t = transfer_of(StandInTransfer("mamba", ("k",), idx(1), SimpleNamespace(value="trailing")))
    assert t == Transfer("mamba", ["k"], t.host_indices, "trailing")
    assert transfer_of(StandInTransfer("kv")).keys == []  # None keys: none
    for bad, match in [
        (None, "transfers: expected a PoolTransfer, got NoneType"),
        (StandInTransfer(5), "name: expected a pool name, got 5"),
        (StandInTransfer(""), "name: expected a pool name"),
        (StandInTransfer(["kv"]), "name: expected a pool name"),
        (StandInTransfer("kv", keys=3), "keys: expected a list"),
        (StandInTransfer("kv", keys=[3]), r"keys: \[0\]"),
    ]:
        with pytest.raises(BadArgumentError, match=match):
            transfer_of(bad)


def test_checked_transfers_split_the_good_from_the_bad_and_keep_a_pools_first():
    kv, again = StandInTransfer("kv", ["a"]), StandInTransfer("kv", ["b"])
    good, bad = checked_transfers([kv, None, StandInTransfer("swa", 3), again])
    assert [t.keys for t in good] == [["a"]]
    assert [e.reason for e in bad] == ["transfers", "keys", "transfers"]
    assert "pool kv named twice" in str(bad[2])
    assert checked_transfers(None, optional=True) == ([], [])
    with pytest.raises(BadArgumentError, match="transfers: expected a list, got NoneType"):
        checked_transfers(None)
    with pytest.raises(BadArgumentError, match="got StandInTransfer"):
        checked_transfers(kv)


def test_a_v2_calls_miss_has_a_false_per_key_of_each_named_pool():
    transfers = [StandInTransfer("kv", ["a", "b"]), StandInTransfer("mamba", 3), None]
    assert missed_transfers(transfers) == {"kv": [False, False], "mamba": []}
    assert missed_transfers(None) == {} and missed_transfers(transfers[0]) == {}
