"""Quarantine: blocks an unsettled transfer holds are neither free nor used, never allocated, and
come back exactly when released. Exact block ids and counts at every step (no torch)."""

import pytest

from cluster.engine.kv_cache import KVCacheManager
from tests.engine.test_block_pool import Req  # the manager's view of a request


def counts(kv: KVCacheManager) -> tuple[int, int, int]:
    """(free, used, quarantined); their sum is the total."""
    kv.check_invariants()
    free, q = kv.num_free_blocks, kv.num_quarantined_blocks
    return free, kv.num_blocks - free - q, q


def test_quarantined_blocks_are_not_allocated_until_released():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    victim = Req("victim", range(16))  # 4 blocks
    assert kv.allocate_slots(victim, 16)
    assert kv.block_ids("victim") == [0, 1, 2, 3]
    token = kv.quarantine("victim", {2, 3})  # a READ still writes blocks 2 and 3
    kv.free("victim")  # the request ends: 0 and 1 go back, 2 and 3 do not
    assert counts(kv) == (6, 0, 2)
    assert kv.pool.quarantined_block_ids() == [2, 3]

    neighbour = Req("neighbour", range(100, 124))  # 6 blocks: exactly what is free
    assert kv.allocate_slots(neighbour, 24)
    assert sorted(kv.block_ids("neighbour")) == [0, 1, 4, 5, 6, 7]
    assert counts(kv) == (0, 6, 2)
    assert not kv.allocate_slots(Req("third", range(4)), 4)  # nothing free: quarantine is not free

    assert kv.release_quarantine(token) == 2
    assert kv.release_quarantine(token) == 0  # a token is released once
    assert counts(kv) == (2, 6, 0)
    kv.free("neighbour")
    assert counts(kv) == (8, 0, 0)


def test_a_quarantined_cached_block_stays_a_prefix_hit_and_is_counted_once():
    # Prefill's grace: the lease's blocks are quarantined but keep their hashes; a new request
    # with the same prefix shares them (a hit only reads). The block is used while it does.
    kv = KVCacheManager(num_blocks=6, block_size=4)
    first = Req("first", range(9))  # 2 full blocks + 1
    assert kv.allocate_slots(first, 9)
    kv.cache_blocks(first, 9)
    token = kv.quarantine("first")
    kv.free("first")
    assert counts(kv) == (3, 0, 3)

    second = Req("second", list(range(8)) + [50, 51])
    cached = kv.find_cached_prefix(second)
    assert [b.block_id for b in cached.blocks] == [0, 1]
    assert kv.allocate_slots(second, 2, cached)
    assert kv.block_ids("second") == [0, 1, 3]
    assert counts(kv) == (2, 3, 1)  # blocks 0, 1 used (shared), block 2 only quarantined

    assert kv.release_quarantine(token) == 3
    assert counts(kv) == (3, 3, 0)
    kv.free("second")
    assert counts(kv) == (6, 0, 0)


def test_quarantine_of_nothing_and_unknown_tokens():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.quarantine("nobody") == 0
    assert kv.release_quarantine(12345) == 0
    assert kv.allocate_slots(Req("r", range(4)), 4)
    assert kv.quarantine("r", {3}) == 0  # not one of its blocks
    kv.free("r")
    assert counts(kv) == (4, 0, 0)


def test_unquarantine_of_a_block_not_quarantined_is_refused():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.allocate_slots(Req("r", range(4)), 4)
    with pytest.raises(RuntimeError, match="not quarantined"):
        kv.pool.unquarantine(kv.pool.blocks[:1])
