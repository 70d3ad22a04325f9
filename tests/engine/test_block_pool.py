"""Block pool and KV manager: exact block ids, eviction order, hashes, leak checks."""

import subprocess
import sys

import pytest

from cluster.engine.kv_cache import BlockPool, KVCacheManager, hash_block_tokens, hash_request_blocks


class Req:
    def __init__(self, rid, tokens):
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_computed_tokens = 0
        self.block_hashes = []
        self.cache_salt = ""


def test_allocate_takes_the_free_queue_head_in_order():
    pool = BlockPool(8)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]
    assert pool.num_free == 3
    pool.check_invariants()


def test_freed_blocks_are_evicted_in_lru_order_and_keep_their_hash_until_reused():
    pool = BlockPool(6)
    a = pool.allocate(3)  # 0 1 2
    b = pool.allocate(2)  # 3 4
    for i, blk in enumerate(a + b):
        assert pool.cache(blk, bytes([i]) * 16)
    pool.free(reversed(a))  # request a finished: tail first -> 2 1 0
    pool.free(reversed(b))  # then b -> 4 3
    assert pool.free_block_ids() == [5, 2, 1, 0, 4, 3]
    assert pool.lookup(bytes([0]) * 16).block_id == 0  # still cached while free
    got = pool.allocate(3)
    assert [x.block_id for x in got] == [5, 2, 1]
    assert pool.lookup(bytes([2]) * 16) is None  # evicted on reuse
    assert pool.lookup(bytes([1]) * 16) is None
    assert pool.lookup(bytes([0]) * 16).block_id == 0
    assert pool.stats.evicted == 2
    pool.free(got)
    pool.check_invariants()
    assert pool.num_free == 6


def test_touching_a_cached_free_block_takes_it_off_the_free_queue():
    pool = BlockPool(4)
    blk = pool.allocate(1)[0]
    pool.cache(blk, b"h" * 16)
    pool.free([blk])
    assert pool.num_free == 4
    pool.touch([pool.lookup(b"h" * 16)])
    assert pool.num_free == 3 and blk.ref_cnt == 1
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free([blk, blk])
    assert pool.free_block_ids() == [1, 2, 3, 0]
    pool.check_invariants()


def test_double_free_is_an_error():
    pool = BlockPool(2)
    blk = pool.allocate(1)[0]
    pool.free([blk])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([blk])


def test_chained_hash_depends_on_the_whole_prefix_and_salt():
    h1 = hash_request_blocks(list(range(48)), 16, b"s")
    assert len(h1) == 3
    h2 = hash_request_blocks([99] + list(range(1, 48)), 16, b"s")
    assert all(a != b for a, b in zip(h1, h2))  # a change in block 0 changes every later hash
    assert hash_request_blocks(list(range(48)), 16, b"t")[0] != h1[0]
    assert hash_request_blocks(list(range(40)), 16, b"s") == h1[:2]  # partial block not hashed
    assert hash_request_blocks(list(range(48)), 16, b"s", known=h1[:1]) == h1


def test_hashes_are_identical_across_processes():
    code = (
        "from cluster.engine.kv_cache import hash_request_blocks;"
        "print(','.join(h.hex() for h in hash_request_blocks(list(range(64)), 16, b'model|tenant')))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = ",".join(h.hex() for h in hash_request_blocks(list(range(64)), 16, b"model|tenant"))
    assert other.stdout.strip() == here
    assert hash_block_tokens(None, [1, 2, 3], b"x").hex() == hash_block_tokens(None, [1, 2, 3], b"x").hex()


def test_manager_prefix_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = Req("a", range(12))  # exactly 3 blocks
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_blocks(a, 12)
    assert kv.block_ids("a") == [0, 1, 2]
    b = Req("b", range(12))
    hits = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hits.blocks] == [0, 1]  # the last block is recomputed
    c = Req("c", list(range(8)) + [50, 51, 52, 53, 54])
    assert [blk.block_id for blk in kv.find_cached_prefix(c).blocks] == [0, 1]
    assert kv.allocate_slots(c, 5, hits)
    assert kv.block_ids("c") == [0, 1, 3, 4]
    kv.free("a")
    kv.free("c")
    kv.check_invariants()
    assert kv.num_free_blocks == 10


def test_manager_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = Req("a", range(8))
    assert kv.allocate_slots(a, 8)
    b = Req("b", range(100, 108))
    assert not kv.allocate_slots(b, 8)
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1
    kv.free("a")
    kv.check_invariants()
    assert kv.num_free_blocks == 3


def test_a_prefix_hit_on_free_cached_blocks_allocates_only_the_tail():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = Req("a", range(10))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_blocks(a, 10)
    kv.free("a")  # blocks 0, 1 cached and free; 2 free
    b = Req("b", list(range(8)) + [77, 78])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits.blocks] == [0, 1]
    assert kv.allocate_slots(b, 2, hits)
    assert kv.block_ids("b") == [0, 1, 3]  # exactly 3 blocks for 10 tokens
    assert kv.num_free_blocks == 5
    kv.free("b")
    kv.check_invariants()


def test_an_allocation_whose_eviction_hook_raises_takes_no_block():
    def failing_tier(evicted):
        raise OSError(28, "No space left on device")

    pool = BlockPool(4, on_evict=failing_tier)
    a = pool.allocate(2)  # 0 1
    for i, blk in enumerate(a):
        assert pool.cache(blk, bytes([i]) * 16)
    pool.free(reversed(a))  # free queue: 2 3 1 0
    with pytest.raises(OSError, match="No space left"):
        pool.allocate(3)  # 2, 3, then 1 (cached: evicted, the hook raises)
    assert (pool.num_free, pool.stats.allocated) == (4, 2)
    assert pool.free_block_ids() == [2, 3, 1, 0]  # taken back to the head, in their order
    pool.check_invariants()
