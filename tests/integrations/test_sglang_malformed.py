"""Malformed arguments to the SGLang backend are misses, on SGLang's real host pools.

SGLang calls its storage backend from its prefetch and backup threads, where an exception
ends the thread for good. `sglang_malformed_scenarios.py` makes one malformed call per
case on real KV, Mamba and SWA host pools (in SGLang's own virtualenv). Each must give
the miss pinned here, counted under its reason, with every host pool's memory untouched,
none of its new keys stored, and valid calls working after it.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.test_sglang import run

pytestmark = pytest.mark.slow

NO_PREFIX: list[Any] = [0, {}, []]  # batch_exists_v2's miss: no usable prefix

# case -> (the call's result, the reason counted in `rejected`)
CASES: dict[str, tuple[Any, str]] = {
    "get_v1-keys-none": ([], "keys"),
    "get_v1-keys-a-str": ([], "keys"),
    "get_v1-keys-ints": ([False, False], "keys"),
    "get_v1-keys-bytes": ([False, False], "keys"),
    "get_v1-key-empty": ([False, False], "keys"),
    "get_v1-key-none": ([False, False], "keys"),
    "set_v1-keys-ints": ([False, False], "keys"),
    "set_v1-keys-none": ([], "keys"),
    "get_v1-indices-none": ([False, False], "host_indices"),
    "get_v1-indices-a-list": ([False, False], "host_indices"),
    "get_v1-indices-numpy": ([False, False], "host_indices"),
    "get_v1-indices-float": ([False, False], "host_indices"),
    "get_v1-indices-bool": ([False, False], "host_indices"),
    "get_v1-indices-negative": ([False, False], "host_indices"),
    "get_v1-indices-past-the-pool": ([False, False], "host_indices"),
    "get_v1-indices-unaligned": ([False, False], "host_indices"),
    "get_v1-indices-not-consecutive": ([False, False], "host_indices"),
    "get_v1-indices-short": ([False, False], "host_indices"),
    "get_v1-indices-long": ([False, False], "host_indices"),
    "get_v1-indices-2d": ([False, False], "host_indices"),
    "get_v1-indices-one-page-twice": ([False, False], "host_indices"),
    "set_v1-indices-negative": ([False, False], "host_indices"),
    "set_v1-indices-past-the-pool": ([False, False], "host_indices"),
    "set_v1-indices-float": ([False, False], "host_indices"),
    "set_v1-indices-short": ([False, False], "host_indices"),
    "set_v1-indices-unaligned": ([False, False], "host_indices"),
    "get_v1-extra-info-a-str": ([False, False], "extra_info"),
    "get_v1-prefix-keys-a-str": ([False, False], "extra_info"),
    "set_v1-prefix-keys-ints": ([False, False], "extra_info"),
    "exists-keys-none": (0, "keys"),
    "exists-keys-an-int": (0, "keys"),
    "exists-a-key-not-str": (0, "keys"),
    "exists-extra-info-a-str": (0, "extra_info"),
    "exists_one-key-an-int": (False, "keys"),
    "exists_v2-keys-none": (NO_PREFIX, "keys"),
    "exists_v2-transfers-a-str": (NO_PREFIX, "transfers"),
    "exists_v2-transfer-none": (NO_PREFIX, "transfers"),
    "exists_v2-transfer-no-fields": (NO_PREFIX, "transfers"),
    "exists_v2-transfer-keys-an-int": (NO_PREFIX, "keys"),
    "exists_v2-transfer-name-an-int": (NO_PREFIX, "transfers"),
    "get_v2-transfers-none": ({}, "transfers"),
    "get_v2-transfers-not-a-list": ({}, "transfers"),
    "get_v2-transfer-none": ({}, "transfers"),
    "get_v2-transfer-no-fields": ({}, "transfers"),
    "get_v2-name-an-int": ({}, "transfers"),
    "get_v2-name-unhashable": ({}, "transfers"),
    "get_v2-pool-not-registered": ({"indexer": [False]}, "pool"),
    "get_v2-extra-info-a-str": ({"mamba": [False]}, "extra_info"),
    "set_v2-pool-named-twice": ({"kv": [True, True]}, "transfers"),  # the first one runs
    "get_v2-kv-keys-an-int": ({"kv": []}, "keys"),
    "get_v2-kv-indices-negative": ({"kv": [False, False]}, "host_indices"),
    "get_v2-mamba-keys-ints": ({"mamba": [False]}, "keys"),
    "get_v2-mamba-keys-a-str": ({"mamba": []}, "keys"),
    "get_v2-mamba-indices-none": ({"mamba": [False]}, "host_indices"),
    "get_v2-mamba-indices-a-list": ({"mamba": [False]}, "host_indices"),
    "get_v2-mamba-indices-negative": ({"mamba": [False]}, "host_indices"),
    "get_v2-mamba-indices-past-the-pool": ({"mamba": [False]}, "host_indices"),
    "get_v2-mamba-indices-float": ({"mamba": [False]}, "host_indices"),
    "get_v2-mamba-indices-long": ({"mamba": [False]}, "host_indices"),
    "get_v2-swa-indices-unaligned": ({"swa": [False, False]}, "host_indices"),
    "get_v2-swa-one-page-twice": ({"swa": [False, False]}, "host_indices"),
    "set_v2-mamba-indices-negative": ({"mamba": [False]}, "host_indices"),
    "set_v2-mamba-indices-uint8-past-the-pool": ({"mamba": [False]}, "host_indices"),
    "set_v2-kv-indices-float": ({"kv": [False, False]}, "host_indices"),
    "batch_get-keys-none": ([], "keys"),
    "batch_get-targets-none": ([None], "targets"),
    "batch_get-targets-too-few": ([None, None], "targets"),
    "batch_get-target-not-a-tensor": ([None], "targets"),
    "batch_get-target-another-dtype": ([None], "targets"),
    "batch_get-target-another-size": ([None], "targets"),
    "batch_get-target-strided": ([None], "targets"),
    "get-key-an-int": (None, "keys"),
    "batch_set-keys-none": (False, "keys"),
    "batch_set-values-none": (False, "values"),
    "batch_set-value-none": (False, "values"),
    "batch_set-value-another-dtype": (False, "values"),
    "batch_set-value-another-size": (False, "values"),
    "batch_set-values-a-tensor": (False, "values"),
    "set-key-an-int": (False, "keys"),
}

REGISTRATIONS = [
    "register-pool-none",
    "register-pool-not-a-pool",
    "register_v2-name-none",
    "register_v2-name-an-int",
    "register_v2-kv-pool-none",
    "register_v2-extra-pool-none",
]


@pytest.fixture(scope="module")
def malformed(sglang_python, tmp_path_factory) -> dict[str, Any]:
    """Every case, one after another on one bench, in one SGLang process."""
    return run(sglang_python, "cases", str(tmp_path_factory.mktemp("malformed")),
               script="sglang_malformed_scenarios.py")  # fmt: skip


def test_the_table_covers_every_case_the_scenario_runs(malformed):
    assert sorted(malformed["cases"]) == sorted(CASES)
    assert sorted(malformed["registrations"]) == sorted(REGISTRATIONS)


@pytest.mark.parametrize(("case", "miss", "reason"), [(c, *v) for c, v in CASES.items()],
                         ids=list(CASES))  # fmt: skip
def test_a_malformed_argument_is_a_counted_miss_that_harms_nothing(malformed, case, miss, reason):
    out = malformed["cases"][case]
    assert out["raised"] is None, out.get("error")
    assert out["result"] == miss
    assert out["rejected"] == {reason: 1}
    assert sum(out["failures"].values()) == 1  # one miss, under the method SGLang called
    assert out["memory_unchanged"]  # no host slot read into
    assert out["new_keys_stored"] == 0  # no page stored from a slot the call did not mean
    assert out["valid_after"]  # the stored pages still come back exact


@pytest.mark.parametrize("case", REGISTRATIONS)
def test_a_pool_kvtiers_cannot_use_fails_registration_and_changes_nothing(malformed, case):
    out = malformed["registrations"][case]
    assert out["raised"] == "ConfigError", out.get("error")
    assert out["rejected"] == {} and out["failures"] == {}
    assert out["memory_unchanged"] and out["valid_after"]


def test_each_reason_is_logged_and_the_backend_works_on(malformed):
    reasons = {reason for _, reason in CASES.values()}
    assert set(malformed["rejected"]) == reasons
    for reason in reasons:
        assert any(f"served as a miss: {reason}:" in line for line in malformed["logged"])
    assert malformed["metrics_ok"] and malformed["cleared"]
