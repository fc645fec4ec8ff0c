import pytest

from kvtiers import TieredCache
from kvtiers.eviction import EvictionPolicy, LRUPolicy, TwoQPolicy, make_policy
from kvtiers.eviction.twoq import TwoQListSizes
from kvtiers.testing.eviction import EvictionPolicyTests
from tests.conftest import make_config, make_kv, same_bytes
from tests.eviction.test_arc import _hit_ratio, _hot_set_with_scans


class TestTwoQPolicy(EvictionPolicyTests):
    policy_cls = TwoQPolicy

    def check_invariants(self, policy: EvictionPolicy) -> None:
        assert isinstance(policy, TwoQPolicy)
        a1in, am, a1out = policy.list_sizes()
        assert a1in + am == len(policy)
        assert a1out <= policy.max_ghosts
        ghosts = list(policy.ghosts())
        assert len(set(ghosts)) == len(ghosts) == a1out
        assert not any(key in policy for key in ghosts)
        assert set(ghosts).isdisjoint(policy.candidates())


def _filled(capacity: int, keys: str) -> TwoQPolicy:
    policy = TwoQPolicy(capacity)
    for key in keys:
        policy.insert(key)
    return policy


def test_shares_size_the_lists():
    policy = TwoQPolicy(10)
    assert (policy.max_in, policy.max_ghosts) == (5, 10)
    policy = TwoQPolicy(10, in_share=0.25, ghost_share=0.5)
    assert (policy.max_in, policy.max_ghosts) == (2, 5)
    assert TwoQPolicy(1, in_share=0.1, ghost_share=0.0).max_ghosts == 1


@pytest.mark.parametrize(("kwargs", "match"), [({"in_share": 0.0}, "in_share"),
                                               ({"in_share": 1.5}, "in_share"),
                                               ({"ghost_share": -1.0}, "ghost_share")])  # fmt: skip
def test_bad_shares_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TwoQPolicy(4, **kwargs)


def test_first_sight_is_probation_and_a_hit_admits():
    policy = _filled(4, "abc")
    assert policy.list_sizes() == TwoQListSizes(a1in=3, am=0, a1out=0)
    policy.touch("b")
    assert policy.list_sizes() == TwoQListSizes(a1in=2, am=1, a1out=0)
    policy.insert("c")  # a resident key: a hit, admitted too
    assert policy.list_sizes() == TwoQListSizes(a1in=1, am=2, a1out=0)


def test_probation_victims_become_ghosts_and_a_ghost_hit_admits():
    policy = _filled(4, "abcd")
    policy.evicted("a")
    assert list(policy.ghosts()) == ["a"]
    policy.insert("a")  # the second sight
    assert list(policy.ghosts()) == []
    assert policy.list_sizes() == TwoQListSizes(a1in=3, am=1, a1out=0)
    policy.evicted("a")  # evicted from Am: no ghost
    assert list(policy.ghosts()) == []


def test_probation_goes_first_only_above_its_share():
    policy = _filled(4, "abcd")  # A1in = [a, b, c, d], share 2
    policy.touch("c")  # A1in = [a, b, d], Am = [c]
    # One of A1in is over the share, then Am, then the rest of A1in.
    assert list(policy.candidates()) == ["a", "c", "b", "d"]
    policy.touch("a")  # A1in = [b, d], Am = [c, a]: within the share, Am goes first
    assert list(policy.candidates()) == ["c", "a", "b", "d"]


def test_ghost_history_is_bounded_oldest_first():
    policy = TwoQPolicy(2, ghost_share=1.0)  # two ghosts
    for key in "abc":
        policy.insert(key)
        policy.evicted(key)
    assert list(policy.ghosts()) == ["b", "c"]


def test_remove_forgets_ghosts():
    policy = _filled(4, "ab")
    policy.evicted("a")
    policy.remove("a")
    policy.insert("a")
    assert policy.list_sizes() == TwoQListSizes(a1in=2, am=0, a1out=0)


def test_twoq_resists_scans_better_than_lru():
    capacity = 64
    trace = _hot_set_with_scans(capacity)
    twoq = _hit_ratio(TwoQPolicy(capacity), trace)
    lru = _hit_ratio(LRUPolicy(capacity), trace)
    assert twoq > lru + 0.05


def test_make_policy_builds_twoq():
    policy = make_policy("2q", 8)
    assert isinstance(policy, TwoQPolicy)
    assert policy.capacity == 8
    assert policy.name == "2q"


async def test_the_cache_evicts_leaves_first_with_twoq(layout):
    async with TieredCache.from_config(make_config(dram_chunks=8, eviction="2q")) as cache:
        dram = cache.tiers[0]
        for conv in range(10):
            tokens = [conv * 1000 + t for t in range(80)]  # 5 chunks each
            kv = make_kv(layout, 80, seed=conv)
            await cache.store(tokens, kv)
            assert dram.usage().num_entries <= 8
            resident = await dram.contains(cache.keys(tokens))
            assert resident == sorted(resident, reverse=True)  # no suffix without its prefix
            num_tokens = await cache.lookup(tokens)
            assert same_bytes(await cache.load(tokens[:num_tokens]), kv[:, :, :num_tokens])
        assert dram.stats().evictions > 0
        assert cache.pin_count() == 0
