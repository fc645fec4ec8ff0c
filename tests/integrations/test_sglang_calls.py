"""How the SGLang backend serves its calls: a failure is a miss, counted and logged."""

from __future__ import annotations

import logging

from kvtiers.integrations._sglang_args import BadArgumentError
from kvtiers.integrations._sglang_calls import Calls


def test_calls_count_misses_by_method_and_bad_arguments_by_reason(caplog):
    calls = Calls(logging.getLogger("kvtiers.sglang"), timeout=1.0)

    def refuse() -> int:
        raise BadArgumentError("keys", "expected a list")

    def fail() -> int:
        raise OSError("disk gone")

    with caplog.at_level(logging.WARNING, logger="kvtiers.sglang"):
        assert calls.guarded("batch_exists", 0, refuse) == 0
        assert calls.guarded("batch_exists", 0, fail) == 0
        for _ in range(99):
            calls.guarded("batch_exists", 0, refuse)
        assert calls.guarded("batch_exists", 7, lambda: 3) == 3
        assert calls.run("batch_get_v1", None, [False], None) == [False]
    assert calls.failures == {"batch_exists": 101, "batch_get_v1": 1}
    assert calls.rejected == {"keys": 100}
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "kvtiers: batch_exists refused a bad argument (1 so far), served as a miss: "
        "keys: expected a list",
        "kvtiers: batch_exists failed (1 so far), served as a miss: disk gone",
        "kvtiers: batch_exists refused a bad argument (100 so far), served as a miss: "
        "keys: expected a list",
        "kvtiers: batch_get_v1 failed (1 so far), served as a miss: no host pool registered yet",
    ]
    # a failure's first line carries its traceback; a bad argument's never does
    assert [bool(r.exc_info) for r in caplog.records] == [False, True, False, False]
