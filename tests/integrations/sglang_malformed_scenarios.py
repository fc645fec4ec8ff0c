"""Malformed arguments to the SGLang backend, on real host pools (SGLang's virtualenv).

A bad argument must be a miss: no exception into SGLang's thread, no page read into a host
slot or stored from one that the call did not mean, and the backend as good as before. The
bench builds real host pools (`sglang_scenarios.make_host`, `make_mamba_host`): a KV pool,
a Mamba state pool and an SWA pool, registered as HiCache does, with known pages stored.
Each case then makes one malformed call and reports:

- its result, or the exception it raised;
- what it added to `failures` and `rejected`;
- whether every host pool's memory is byte for byte as before the call;
- how many of the new keys it was given are stored (must be none);
- whether valid calls still work after it (the stored pages come back exact).

    python sglang_malformed_scenarios.py cases WORKDIR
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import sglang_scenarios as sc
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

KV, MB, SW, IX = PoolName.KV, PoolName.MAMBA, PoolName.SWA, PoolName.INDEXER


class Bench:
    """A backend (`be`) on real KV, Mamba and SWA host pools, with known pages stored."""

    def __init__(self, workdir: Path) -> None:
        self.kv, self.swa = sc.make_host("mha", "layer_first"), sc.make_host("mha", "page_first")
        self.mamba = sc.make_mamba_host()
        sc.fill_random(self.kv, 21)
        sc.fill_random(self.swa, 22)
        self.be = sc.make_backend(self.kv, sc.lmdb_tiers(workdir), kind="mha")
        for name, pool in ((KV, self.kv), (MB, self.mamba), (SW, self.swa)):
            self.be.register_mem_host_pool_v2(pool, name)
        self.s = sc.keys_for(4, "s")  # stored: KV pages 0-3, the window 0-1, a state at 4
        assert self.be.batch_set_v1(self.s, self.src(4)) == [True] * 4
        extra = [self.one(MB, self.s[3:], 1), self.tr(SW, self.s[:2], self.win(2, 0))]
        assert self.be.batch_set_v2(extra) == {MB: [True], SW: [True, True]}
        self.want_kv = sc.page_bytes(self.kv, self.src(4), 4)
        self.want_swa = sc.page_bytes(self.swa, self.win(2, 0), 2)
        self.want_mamba = sc.state_bytes(self.mamba, 1)
        self.last = self.kv.size // sc.PAGE - 1  # the KV pool's last page
        self.fresh: list[tuple[str, list[str]]] = []

    def new(self, n: int, pool: str = "kv") -> list[str]:
        """Return `n` keys never stored; the case must not store them either."""
        keys = sc.keys_for(n, f"n{len(self.fresh)}x")
        self.fresh.append((pool, keys))
        return keys

    def src(self, n: int = 2, page: int = 0) -> torch.Tensor:
        """KV host indices of `n` pages from `page` (the stored pages' own)."""
        return sc.slots(self.kv, page, n)

    def dst(self, n: int = 2, page: int = 40) -> torch.Tensor:
        """KV host indices of `n` pages from `page` (slots to read into)."""
        return sc.slots(self.kv, page, n)

    def win(self, n: int, page: int) -> torch.Tensor:
        """SWA host indices of `n` pages from `page`."""
        return sc.slots(self.swa, page, n)

    def info(self, prefix_keys: Any) -> HiCacheStorageExtraInfo:
        return HiCacheStorageExtraInfo(prefix_keys=prefix_keys)

    def get2(self, *transfers: Any) -> Any:
        return self.be.batch_get_v2(list(transfers))

    def set2(self, *transfers: Any) -> Any:
        return self.be.batch_set_v2(list(transfers))

    def tr(self, name: Any, keys: Any, indices: Any = None) -> PoolTransfer:
        return PoolTransfer(name=name, keys=keys, host_indices=indices)

    def one(self, name: Any, keys: Any, slot: Any) -> PoolTransfer:
        """A transfer of one state per key (`slot`: an int, or host indices as they are)."""
        indices = torch.tensor([slot], dtype=torch.int64) if isinstance(slot, int) else slot
        return self.tr(name, keys, indices)

    def flat(self, page: int = 0) -> torch.Tensor:
        return self.kv.get_data_page(page * sc.PAGE, flat=True)

    def dummy(self) -> torch.Tensor:
        return self.kv.get_dummy_flat_data_page()

    def memory(self) -> list[torch.Tensor]:
        buffers = [self.kv.kv_buffer, self.swa.kv_buffer, self.mamba.temporal_buffer]
        return [b.clone() for b in [*buffers, *self.mamba.conv_buffer]]

    def stored_of(self, pool: str, keys: list[str]) -> int:
        if pool == "kv":
            return sum(self.be.exists(key) for key in keys)
        return sum(self.be._extras.present(pool, keys))

    def valid_after(self) -> bool:
        """Whether valid calls still find, read and place the stored pages exactly."""
        be, kv = self.be, self.kv
        got = be.batch_get_v1(self.s, self.dst(4, 60))
        exact = sc.page_bytes(kv, self.dst(4, 60), 4) == self.want_kv
        extra = be.batch_get_v2(
            [self.one(MB, self.s[3:], 6), self.tr(SW, self.s[:2], self.win(2, 60))]
        )
        extra_exact = sc.state_bytes(self.mamba, 6) == self.want_mamba and (
            sc.page_bytes(self.swa, self.win(2, 60), 2) == self.want_swa
        )
        flat = [self.dummy()]
        generic = be.batch_get(self.s[:1], flat)[0] is not None
        generic_exact = flat[0].view(torch.uint8).numpy().tobytes() == self.want_kv[0]
        return (
            got == [True] * 4
            and exact
            and extra == {MB: [True], SW: [True, True]}
            and extra_exact
            and generic
            and generic_exact
            and be.batch_exists(self.s) == 4
        )


def _swap_within_page(b: Bench) -> torch.Tensor:
    idx = b.dst().clone()
    idx[[0, 1]] = idx[[1, 0]]  # the first page's first two slots swapped
    return idx


def _zeros(b: Bench, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
    return torch.zeros(b.flat().numel() if numel is None else numel, dtype=dtype)


P = sc.PAGE
U8, F16, T = torch.uint8, torch.float16, torch.tensor

# Each case: one malformed call on the bench. Get cases read stored keys (so a wrong read
# would change host memory); set cases store new keys (so a wrong write would store them).
CASES: dict[str, Callable[[Bench], Any]] = {
    # -- batch_get_v1 / batch_set_v1: keys
    "get_v1-keys-none": lambda b: b.be.batch_get_v1(None, b.dst()),
    "get_v1-keys-a-str": lambda b: b.be.batch_get_v1(b.s[0], b.dst()),
    "get_v1-keys-ints": lambda b: b.be.batch_get_v1([1, 2], b.dst()),
    "get_v1-keys-bytes": lambda b: b.be.batch_get_v1([k.encode() for k in b.s[:2]], b.dst()),
    "get_v1-key-empty": lambda b: b.be.batch_get_v1(["", b.s[1]], b.dst()),
    "get_v1-key-none": lambda b: b.be.batch_get_v1([b.s[0], None], b.dst()),
    "set_v1-keys-ints": lambda b: b.be.batch_set_v1([1, 2], b.src()),
    "set_v1-keys-none": lambda b: b.be.batch_set_v1(None, b.src()),
    # -- batch_get_v1 / batch_set_v1: host indices
    "get_v1-indices-none": lambda b: b.be.batch_get_v1(b.s[:2], None),
    "get_v1-indices-a-list": lambda b: b.be.batch_get_v1(b.s[:2], b.dst().tolist()),
    "get_v1-indices-numpy": lambda b: b.be.batch_get_v1(b.s[:2], b.dst().numpy()),
    "get_v1-indices-float": lambda b: b.be.batch_get_v1(b.s[:2], b.dst().float()),
    "get_v1-indices-bool": lambda b: b.be.batch_get_v1(b.s[:2], b.dst() > 0),
    "get_v1-indices-negative": lambda b: b.be.batch_get_v1(b.s[:2], b.dst() - 44 * P),
    "get_v1-indices-past-the-pool": lambda b: b.be.batch_get_v1(b.s[:2], b.dst(page=b.last)),
    "get_v1-indices-unaligned": lambda b: b.be.batch_get_v1(b.s[:2], b.dst() + 3),
    "get_v1-indices-not-consecutive": lambda b: b.be.batch_get_v1(b.s[:2], _swap_within_page(b)),
    "get_v1-indices-short": lambda b: b.be.batch_get_v1(b.s[:2], b.dst(1)),
    "get_v1-indices-long": lambda b: b.be.batch_get_v1(b.s[:2], b.dst(3)),
    "get_v1-indices-2d": lambda b: b.be.batch_get_v1(b.s[:2], b.dst().view(2, P)),
    "get_v1-indices-one-page-twice": lambda b: b.be.batch_get_v1(b.s[:2], b.dst(1).repeat(2)),
    "set_v1-indices-negative": lambda b: b.be.batch_set_v1(b.new(2), b.src() - 4 * P),
    "set_v1-indices-past-the-pool": lambda b: b.be.batch_set_v1(b.new(2), b.src() + b.kv.size),
    "set_v1-indices-float": lambda b: b.be.batch_set_v1(b.new(2), b.src().double()),
    "set_v1-indices-short": lambda b: b.be.batch_set_v1(b.new(2), b.src(1)),
    "set_v1-indices-unaligned": lambda b: b.be.batch_set_v1(b.new(2), b.src() + 5),
    # -- extra_info
    "get_v1-extra-info-a-str": lambda b: b.be.batch_get_v1(b.s[:2], b.dst(), "info"),
    "get_v1-prefix-keys-a-str": lambda b: b.be.batch_get_v1(b.s[:2], b.dst(), b.info("abc")),
    "set_v1-prefix-keys-ints": lambda b: b.be.batch_set_v1(b.new(2), b.src(), b.info([1, 2])),
    # -- batch_exists / exists
    "exists-keys-none": lambda b: b.be.batch_exists(None),
    "exists-keys-an-int": lambda b: b.be.batch_exists(5),
    "exists-a-key-not-str": lambda b: b.be.batch_exists([b.s[0], 5]),
    "exists-extra-info-a-str": lambda b: b.be.batch_exists(b.s, "info"),
    "exists_one-key-an-int": lambda b: b.be.exists(5),
    # -- batch_exists_v2
    "exists_v2-keys-none": lambda b: b.be.batch_exists_v2(None),
    "exists_v2-transfers-a-str": lambda b: b.be.batch_exists_v2(b.s, "mamba"),
    "exists_v2-transfer-none": lambda b: b.be.batch_exists_v2(b.s, [None]),
    "exists_v2-transfer-no-fields": lambda b: b.be.batch_exists_v2(b.s, [object()]),
    "exists_v2-transfer-keys-an-int": lambda b: b.be.batch_exists_v2(b.s, [b.tr(MB, 3)]),
    "exists_v2-transfer-name-an-int": lambda b: b.be.batch_exists_v2(b.s, [b.tr(5, b.s[3:])]),
    # -- batch_get_v2 / batch_set_v2: the transfers themselves
    "get_v2-transfers-none": lambda b: b.be.batch_get_v2(None),
    "get_v2-transfers-not-a-list": lambda b: b.be.batch_get_v2(b.one(MB, b.s[3:], 6)),
    "get_v2-transfer-none": lambda b: b.get2(None),
    "get_v2-transfer-no-fields": lambda b: b.get2(SimpleNamespace()),
    "get_v2-name-an-int": lambda b: b.get2(b.one(5, b.s[3:], 6)),
    "get_v2-name-unhashable": lambda b: b.get2(b.one([MB], b.s[3:], 6)),
    "get_v2-pool-not-registered": lambda b: b.get2(b.one(IX, b.s[3:], 6)),
    "get_v2-extra-info-a-str": lambda b: b.be.batch_get_v2([b.one(MB, b.s[3:], 6)], "info"),
    "set_v2-pool-named-twice": lambda b: b.set2(
        b.tr(KV, b.s[:2], b.src()), b.tr(KV, b.new(2), b.src())
    ),
    # -- batch_get_v2 / batch_set_v2: one pool's fields
    "get_v2-kv-keys-an-int": lambda b: b.get2(b.tr(KV, 5, b.dst())),
    "get_v2-kv-indices-negative": lambda b: b.get2(b.tr(KV, b.s[:2], b.dst() - 44 * P)),
    "get_v2-mamba-keys-ints": lambda b: b.get2(b.one(MB, [5], 6)),
    "get_v2-mamba-keys-a-str": lambda b: b.get2(b.one(MB, b.s[3], 6)),
    "get_v2-mamba-indices-none": lambda b: b.get2(b.one(MB, b.s[3:], None)),
    "get_v2-mamba-indices-a-list": lambda b: b.get2(b.one(MB, b.s[3:], [6])),
    "get_v2-mamba-indices-negative": lambda b: b.get2(b.one(MB, b.s[3:], -1)),
    "get_v2-mamba-indices-past-the-pool": lambda b: b.get2(b.one(MB, b.s[3:], b.mamba.size)),
    "get_v2-mamba-indices-float": lambda b: b.get2(b.one(MB, b.s[3:], T([6.0]))),
    "get_v2-mamba-indices-long": lambda b: b.get2(b.one(MB, b.s[3:], T([6, 7]))),
    "get_v2-swa-indices-unaligned": lambda b: b.get2(b.tr(SW, b.s[:2], b.win(2, 40) + 1)),
    "get_v2-swa-one-page-twice": lambda b: b.get2(b.tr(SW, b.s[:2], b.win(1, 40).repeat(2))),
    "set_v2-mamba-indices-negative": lambda b: b.set2(b.one(MB, b.new(1, MB), -1)),
    "set_v2-mamba-indices-uint8-past-the-pool": lambda b: b.set2(
        b.one(MB, b.new(1, MB), T([99], dtype=U8))
    ),
    "set_v2-kv-indices-float": lambda b: b.set2(b.tr(KV, b.new(2), b.src().float())),
    # -- the generic path: flat pages
    "batch_get-keys-none": lambda b: b.be.batch_get(None, [b.dummy()]),
    "batch_get-targets-none": lambda b: b.be.batch_get(b.s[:1], None),
    "batch_get-targets-too-few": lambda b: b.be.batch_get(b.s[:2], [b.dummy()]),
    "batch_get-target-not-a-tensor": lambda b: b.be.batch_get(b.s[:1], [5]),
    "batch_get-target-another-dtype": lambda b: b.be.batch_get(b.s[:1], [_zeros(b, F16)]),
    "batch_get-target-another-size": lambda b: b.be.batch_get(b.s[:1], [_zeros(b, b.kv.dtype, 3)]),
    "batch_get-target-strided": lambda b: b.be.batch_get(b.s[:1], [b.dummy().repeat(2)[::2]]),
    "get-key-an-int": lambda b: b.be.get(5, b.dummy()),
    "batch_set-keys-none": lambda b: b.be.batch_set(None, [b.flat()]),
    "batch_set-values-none": lambda b: b.be.batch_set(b.new(1), None),
    "batch_set-value-none": lambda b: b.be.batch_set(b.new(1), [None]),
    "batch_set-value-another-dtype": lambda b: b.be.batch_set(b.new(1), [b.flat().view(F16)]),
    "batch_set-value-another-size": lambda b: b.be.batch_set(b.new(1), [b.flat()[:-1]]),
    "batch_set-values-a-tensor": lambda b: b.be.batch_set(b.new(1), b.flat()),
    "set-key-an-int": lambda b: b.be.set(5, b.flat()),
}  # fmt: skip

# Registration is the control path: a pool or a name kvtiers cannot use fails the attach
# with a ConfigError (and changes nothing), as documented.
REGISTRATIONS: dict[str, Callable[[Bench], Any]] = {
    "register-pool-none": lambda b: b.be.register_mem_pool_host(None),
    "register-pool-not-a-pool": lambda b: b.be.register_mem_pool_host(object()),
    "register_v2-name-none": lambda b: b.be.register_mem_host_pool_v2(b.swa, None),
    "register_v2-name-an-int": lambda b: b.be.register_mem_host_pool_v2(b.swa, 5),
    "register_v2-kv-pool-none": lambda b: b.be.register_mem_host_pool_v2(None, KV),
    "register_v2-extra-pool-none": lambda b: b.be.register_mem_host_pool_v2(None, IX),
}


def plain(result: Any) -> Any:
    """Return a call's result as JSON: pools by name, tensors as "tensor"."""
    if isinstance(result, PoolTransferResult):
        hits = {str(k): v for k, v in result.extra_pool_hit_pages.items()}
        return [result.kv_hit_pages, hits, result.restorable_prefix_pages]
    if isinstance(result, dict):
        return {str(k): plain(v) for k, v in result.items()}
    if isinstance(result, list):
        return [plain(v) for v in result]
    if isinstance(result, torch.Tensor | np.ndarray):
        return "tensor"
    return result


def run_case(b: Bench, call: Callable[[Bench], Any]) -> dict[str, Any]:
    failures, rejected = Counter(b.be.failures), Counter(b.be.rejected)
    before = b.memory()
    fresh_from = len(b.fresh)
    out: dict[str, Any] = {"raised": None}
    try:
        out["result"] = plain(call(b))
    except Exception as exc:
        out["raised"] = type(exc).__name__
        out["error"] = str(exc)
    out["failures"] = dict(Counter(b.be.failures) - failures)
    out["rejected"] = dict(Counter(b.be.rejected) - rejected)
    after = b.memory()
    out["memory_unchanged"] = all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(before, after, strict=True)
    )
    out["new_keys_stored"] = sum(b.stored_of(pool, keys) for pool, keys in b.fresh[fresh_from:])
    out["valid_after"] = b.valid_after()
    return out


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def cases(workdir: Path) -> dict[str, Any]:
    """Every malformed call of `CASES` and `REGISTRATIONS`, one after another."""
    lines = Lines()
    logging.getLogger("kvtiers.sglang").addHandler(lines)
    logging.getLogger("kvtiers.sglang").setLevel(logging.WARNING)
    b = Bench(workdir)
    out: dict[str, Any] = {"cases": {}, "registrations": {}}
    for name, call in CASES.items():
        out["cases"][name] = run_case(b, call)
    for name, call in REGISTRATIONS.items():
        out["registrations"][name] = run_case(b, call)
    out["rejected"] = dict(b.be.rejected)
    out["logged"] = lines.lines
    stats = b.be.get_stats()
    out["metrics_ok"] = len(stats.prefetch_pgs) > 0
    out["cleared"] = b.be.clear() and b.be.batch_exists(b.s) == 0
    b.be.close()
    return out


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    name, workdir = sys.argv[1], Path(sys.argv[2])
    if name != "cases":
        raise SystemExit(f"unknown scenario {name!r}")
    print("RESULT " + json.dumps(cases(workdir), default=str))


if __name__ == "__main__":
    main()
