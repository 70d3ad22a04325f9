"""The KV tiers below the device pool (host, then disk): exact slots and LRU order, blocks evicted
from the pool and loaded back with their bytes, exact counts on every tier after each lifecycle
(abort right after a load included), and engine output with tiers equal to transformers' and to
the engine's without them, for prefixes that came back from host and from disk."""

import asyncio
import os
import threading

import pytest
import torch
from pydantic import ValidationError

from cluster.engine.config import EngineOptions
from cluster.engine.kv_cache import BlockTier, KVCacheManager, TierLoader
from cluster.engine.tier_arenas import DiskArena, HostArena, disk_blocks
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler
from tests.reference import hf_greedy
from tests.engine.test_block_pool import Req  # the manager's view of a request

H = [bytes([i]) * 16 for i in range(20)]  # stand-in hashes for the tier's own tests


def arena(device_blocks: int, host_blocks: int) -> HostArena:
    """A real arena over a small device tensor; block i of the device holds the value i + 1."""
    device = torch.arange(1, device_blocks + 1, dtype=torch.float32).view(device_blocks, 1).repeat(1, 4).contiguous()
    return HostArena(device, host_blocks)


def held(tier: BlockTier) -> list[tuple[bytes, int]]:
    return [(h, tier.slot_of(h)) for h in tier.hashes()]


def test_stores_take_slots_in_order_and_evict_the_least_recently_used():
    a = arena(8, 3)
    tier = BlockTier("host", 3, a)
    tier.store([(5, H[0]), (6, H[1])])
    assert held(tier) == [(H[0], 0), (H[1], 1)]
    assert a.host[:2, 0].tolist() == [6.0, 7.0]  # device blocks 5, 6
    tier.store([(2, H[0])])  # already held: refreshed, no copy
    assert held(tier) == [(H[1], 1), (H[0], 0)]
    assert (tier.stats.stored, tier.stats.refreshed) == (2, 1)
    tier.store([(3, H[2]), (4, H[3])])  # full after H[2]: H[3] takes the LRU slot (H[1]'s)
    assert held(tier) == [(H[0], 0), (H[2], 2), (H[3], 1)]
    assert a.host[:, 0].tolist() == [6.0, 5.0, 4.0]
    assert (tier.num_used, tier.num_free, tier.stats.evicted) == (3, 0, 1)
    tier.check_invariants()


def test_pinned_hashes_are_never_evicted_and_a_store_with_every_slot_pinned_is_dropped():
    tier = BlockTier("host", 2, arena(4, 2))
    tier.store([(0, H[0]), (1, H[1])])
    with tier.pinned([H[0]]):
        tier.store([(2, H[2])])  # H[0] is the LRU but pinned: H[1] goes
        assert held(tier) == [(H[0], 0), (H[2], 1)]
        with tier.pinned([H[2]]):
            tier.store([(3, H[3])])
            assert tier.stats.dropped == 1 and H[3] not in tier
    tier.check_invariants()
    with pytest.raises(KeyError, match="does not hold"):
        with tier.pinned([H[9]]):
            pass


def test_load_copies_slots_into_device_blocks_and_refreshes_them():
    a = arena(6, 4)
    tier = BlockTier("host", 4, a)
    tier.store([(0, H[0]), (1, H[1]), (2, H[2])])
    a.device_cache[4:6] = 0.0
    tier.load([H[0], H[2]], [4, 5])
    assert a.device_cache[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 1.0, 3.0]
    assert held(tier) == [(H[1], 1), (H[0], 0), (H[2], 2)]
    assert tier.stats.loaded == 2
    assert tier.reset() == 3 and tier.num_free == 4
    tier.check_invariants()


def run(kv: KVCacheManager, req: Req) -> list[int]:
    """Admit, 'compute' every token, cache the full blocks, free: a request's whole life."""
    cached = kv.find_cached_prefix(req)
    n = len(req.all_token_ids) - len(cached) * kv.block_size
    assert kv.allocate_slots(req, n, cached)
    ids = kv.block_ids(req.request_id)
    req.num_computed_tokens = len(req.all_token_ids)
    kv.cache_blocks(req, req.num_computed_tokens)
    kv.free(req.request_id)
    return ids


def tiered(device_blocks=4, host_blocks=8, block_size=4):
    a = arena(device_blocks, host_blocks)
    return KVCacheManager(device_blocks, block_size, tiers=[BlockTier("host", host_blocks, a)]), a


def test_a_prefix_evicted_from_the_pool_comes_back_from_the_host_tier_with_its_bytes():
    kv, a = tiered()
    first = Req("a", range(13))  # 3 full blocks + 1 token
    assert run(kv, first) == [0, 1, 2, 3]
    assert run(kv, Req("b", range(100, 116))) == [3, 2, 1, 0]  # free queue: 3, then a's tail first
    # b evicted a's blocks 2, 1, 0 (3 had no hash): the host tier holds them in that order
    assert [kv.host.slot_of(h) for h in first.block_hashes] == [2, 1, 0]
    assert a.host[:3, 0].tolist() == [3.0, 2.0, 1.0]
    assert (kv.host.num_used, kv.host.num_free) == (3, 5)
    a.device_cache[:] = -1.0  # b's compute overwrote the pool
    again = Req("a2", range(13))
    prefix = kv.find_cached_prefix(again)
    assert prefix.blocks == () and prefix.loads == tuple((0, h) for h in first.block_hashes)
    assert kv.allocate_slots(again, 1, prefix)
    # loads took the free queue's head (b's tail first: 0, 1, 2 evicted to host), the new token 3
    assert kv.block_ids("a2") == [0, 1, 2, 3]
    assert a.device_cache[:3, 0].tolist() == [1.0, 2.0, 3.0]  # a's bytes, back in place
    # this manager has no loader thread: copied and indexed before allocate_slots returned
    assert not kv.is_loading("a2") and kv.poll_loads() == []
    assert [kv.pool.lookup(h).block_id for h in first.block_hashes] == [0, 1, 2]
    assert kv.host.stats.loaded == 3
    assert (kv.host.num_used, kv.num_free_blocks) == (7, 0)  # + b's 4 full blocks, evicted now
    kv.free("a2")
    kv.check_invariants()
    assert (kv.num_free_blocks, kv.host.num_used, kv.host.num_free) == (4, 7, 1)


def test_a_prefix_half_in_the_pool_loads_only_the_rest():
    kv, a = tiered(device_blocks=6)
    first = Req("a", range(17))
    run(kv, first)  # blocks 0-4, 0-3 cached
    kv.allocate_slots(Req("x", range(200, 204)), 4)  # takes block 5
    assert kv.allocate_slots(Req("y", range(300, 308)), 8)  # evicts a's tail: 4 (uncached), 3
    assert [kv.host.slot_of(h) for h in first.block_hashes] == [None, None, None, 0]
    kv.free("y")
    prefix = kv.find_cached_prefix(Req("a2", range(17)))
    assert [b.block_id for b in prefix.blocks] == [0, 1, 2] and prefix.loads == ((0, first.block_hashes[3]),)
    assert kv.cached_prefix_tokens(Req("a3", range(17))) == 16
    kv.free("x")
    kv.check_invariants()


def test_allocation_that_fails_loads_nothing_and_changes_nothing():
    kv, a = tiered(device_blocks=4)
    first = Req("a", range(13))
    run(kv, first)
    run(kv, Req("b", range(100, 116)))
    hold = Req("h", range(500, 508))
    assert kv.allocate_slots(hold, 8)  # 2 of 4 blocks held: 3 loads + 1 do not fit
    before = (kv.num_free_blocks, kv.host.hashes(), kv.host.stats.loaded)
    again = Req("a2", range(13))
    assert not kv.allocate_slots(again, 1, kv.find_cached_prefix(again))
    assert (kv.num_free_blocks, kv.host.hashes(), kv.host.stats.loaded) == before
    kv.free("h")
    kv.check_invariants()
    assert kv.num_free_blocks == 4


def test_blocks_reused_store_threshold_times_are_written_through_before_any_eviction():
    a = arena(4, 8)
    kv = KVCacheManager(4, 4, tiers=[BlockTier("host", 8, a)], store_threshold=2)
    first = Req("a", range(13))  # 3 full blocks
    run(kv, first)
    run(kv, Req("a2", range(13)))  # hit once each: below the threshold
    assert kv.host.num_used == 0
    a.device_cache[:3] = torch.tensor([[10.0], [20.0], [30.0]])  # the pool's bytes for a's 3 blocks
    run(kv, Req("a3", range(13)))  # hit twice: copied to the host tier now, still in the pool
    assert [kv.host.slot_of(h) for h in first.block_hashes] == [0, 1, 2]
    assert a.host[:3, 0].tolist() == [10.0, 20.0, 30.0]
    assert (kv.host.stats.written_through, kv.host.stats.stored) == (3, 3)
    assert all(kv.pool.lookup(h) is not None for h in first.block_hashes)
    run(kv, Req("a4", range(13)))  # hit again: already in the host tier, no copy
    run(kv, Req("b", range(100, 116)))  # evicts a's 3: already held, refreshed without a copy
    assert (kv.host.stats.stored, kv.host.stats.refreshed, kv.host.stats.written_through) == (3, 3, 3)
    kv.check_invariants()
    assert (kv.num_free_blocks, kv.host.num_used) == (4, 3)
    with pytest.raises(ValueError, match="store_threshold must be >= 0"):
        KVCacheManager(4, 4, store_threshold=-1)


class GatedArena(HostArena):
    """A real host arena whose copies back wait for the test to open the gate (a slow load)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate = threading.Event()
        self.started = threading.Event()

    def load(self, pairs):
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        super().load(pairs)


def evicted_session(threaded: bool):
    """A scheduler over 8 device blocks and 8 host slots where request a's 4 prompt blocks were
    evicted to the host tier by b's 8."""
    a = GatedArena(torch.zeros(8, 4), 8)
    kv = KVCacheManager(8, 4, tiers=[BlockTier("host", 8, a)], loader=TierLoader(threaded=threaded))
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    s.add(Request("a", list(range(17)), SP1))
    s.update(s.schedule(), {"a": 7})  # a: 17 prompt tokens, 4 blocks cached, finished (max_tokens 1)
    s.add(Request("b", list(range(100, 132)), SP1))  # 8 blocks: evicts all of a's
    s.update(s.schedule(), {"b": 7})
    assert (kv.num_free_blocks, kv.host.num_used) == (8, 4)
    return s, kv, a


SP1 = SamplingParams(max_tokens=1, temperature=0)


def test_a_prefix_from_the_host_tier_loads_while_other_requests_step_then_computes_the_rest():
    s, kv, a = evicted_session(threaded=True)
    s.add(Request("a2", list(range(17)) + [9, 9], SP1))
    s.add(Request("c", list(range(300, 306)), SamplingParams(max_tokens=3, temperature=0)))
    out = s.schedule()  # a2 starts loading a's 4 blocks; c (no cached prefix) is computed
    assert [(ch.request.request_id, ch.start, ch.num_tokens) for ch in out.chunks] == [("c", 0, 6)]
    assert list(s.loading) == ["a2"] and s.requests["a2"].status == RequestStatus.WAITING_FOR_KV
    assert a.started.wait(10)
    s.update(out, {"c": 1})
    s.add(Request("a3", list(range(17)), SP1))  # needs the blocks a2 is loading: waits for them
    for _ in range(2):  # the copy is held: c decodes, a2 and a3 wait
        out = s.schedule()
        assert [(ch.request.request_id, ch.num_tokens) for ch in out.chunks] == [("c", 1)]
        s.update(out, {"c": 1})
        s.check_invariants()
    assert "c" not in s.requests and list(s.waiting) == [s.requests["a3"]]
    a.gate.set()
    while kv.is_loading("a2"):
        kv.wait_loads(1.0)
        out = s.schedule()
    # loaded: a2 computes its last 3 tokens from position 16; a3 finds a's 4 blocks in the pool
    assert [(ch.request.request_id, ch.start, ch.num_tokens) for ch in out.chunks] == [("a2", 16, 3), ("a3", 16, 1)]
    assert kv.host.stats.loaded == 4 and kv.pool.stats.hit_blocks == 4
    s.update(out, {"a2": 7, "a3": 7})
    s.check_invariants()
    assert (kv.num_free_blocks, kv.num_requests(), kv.num_loading) == (8, 0, 0)


@pytest.mark.parametrize("budget_s, inline", [(0.0005, True), (0.0003, False)])
def test_a_copy_that_fits_the_inline_budget_runs_at_admission_and_computes_in_the_same_step(budget_s, inline):
    s, kv, a = evicted_session(threaded=True)
    a.gate.set()
    host = kv.tiers[0]
    host.stats.load_s, host.stats.loaded = 0.001, 10  # as measured: 100 us a block
    kv.inline_load_s = budget_s  # a's 4 blocks take ~400 us
    s.add(Request("a2", list(range(17)) + [9, 9], SP1))
    out = s.schedule()
    if inline:  # copied at admission: a2 computes its last 3 tokens in this step
        assert [(ch.request.request_id, ch.start, ch.num_tokens) for ch in out.chunks] == [("a2", 16, 3)]
        assert not s.loading and host.stats.loaded == 14 and host.num_pinned == 0
    else:  # on the loader thread: a2 computes in a later step
        assert out.is_empty and list(s.loading) == ["a2"]
        while kv.is_loading("a2"):
            kv.wait_loads(1.0)
            out = s.schedule()
        assert [(ch.request.request_id, ch.start, ch.num_tokens) for ch in out.chunks] == [("a2", 16, 3)]
    s.update(out, {"a2": 7})
    s.check_invariants()
    assert (kv.num_free_blocks, kv.num_requests(), kv.num_loading) == (8, 0, 0)


def test_abort_during_a_load_quarantines_its_blocks_until_the_copy_ends_then_caches_them():
    s, kv, a = evicted_session(threaded=True)
    s.add(Request("a2", list(range(17)) + [9, 9], SP1))
    assert s.schedule().is_empty and a.started.wait(10)
    s.finish("a2", RequestStatus.FINISHED_ABORTED)  # the copy is still writing its 4 blocks
    s.check_invariants()
    assert (kv.num_quarantined_blocks, kv.num_free_blocks, kv.num_loading, kv.num_requests()) == (4, 4, 1, 0)
    assert s.schedule().is_empty  # nothing runs; the quarantine holds until the copy ends
    assert kv.num_quarantined_blocks == 4
    a.gate.set()
    while kv.num_loading:
        kv.wait_loads(1.0)
        s.schedule()
    s.check_invariants()
    # the copy finished for nobody: its 4 blocks are cached and free (a later request hits them)
    assert (kv.num_quarantined_blocks, kv.num_free_blocks, kv.host.stats.loaded) == (0, 8, 4)
    again = Request("a3", list(range(17)), SP1)
    assert len(kv.find_cached_prefix(again).blocks) == 4


def test_a_failed_load_forgets_the_blocks_and_the_request_recomputes_its_prompt(tmp_path):
    host = arena(4, 2)
    disk = DiskArena(host, str(tmp_path))
    kv = KVCacheManager(4, 4, tiers=[BlockTier("host", 2, host), BlockTier("disk", 8, disk)])
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    s.add(Request("a", list(range(13)), SP1))
    s.update(s.schedule(), {"a": 7})
    s.add(Request("b", list(range(100, 116)), SP1))
    s.update(s.schedule(), {"b": 7})  # a's blocks: 2 on the host, 1 on disk
    assert kv.tiers[1].num_used == 1
    for f in disk.dir.iterdir():
        f.write_bytes(b"")  # a truncated block file: the read fails
    s.add(Request("a2", list(range(13)), SP1))
    assert s.schedule().is_empty and list(s.loading) == ["a2"]
    out = s.schedule()  # the copy failed: a2 went back to the queue and is computed from scratch
    assert [(ch.request.request_id, ch.start, ch.num_tokens) for ch in out.chunks] == [("a2", 0, 13)]
    assert (kv.tiers[0].stats.load_failed, kv.tiers[1].stats.load_failed, kv.tiers[1].num_used) == (2, 1, 0)
    s.update(out, {"a2": 7})
    s.check_invariants()
    assert (kv.num_free_blocks, kv.num_requests(), kv.num_loading) == (4, 0, 0)
    disk.close()


def test_config_is_validated():
    assert not EngineOptions().kv_tiers.enabled
    assert EngineOptions(kv_tiers={"host_blocks": 64}).kv_tiers.host_blocks == 64
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        EngineOptions(kv_tiers={"host_blocks": -1})
    with pytest.raises(ValidationError, match="needs enable_prefix_caching"):
        EngineOptions(kv_tiers={"host_blocks": 8}, enable_prefix_caching=False)
    with pytest.raises(ValidationError, match="Extra inputs"):
        EngineOptions(kv_tiers={"host_blocks": 8, "disk_blocks": 8})
    with pytest.raises(ValueError, match="host memory"):
        HostArena(torch.zeros(2, 1024), 2**40 // 4096)
    with pytest.raises(ValidationError, match="lease_from_host needs kv_tiers.host_blocks > 0"):
        EngineOptions(kv_tiers={"lease_from_host": True})
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        EngineOptions(kv_tiers={"host_blocks": 8, "store_threshold": -1})


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_engine_output_with_the_host_tier_equals_transformers_and_the_engine_without(tiny_model):
    """Multi-turn sessions whose KV is more than the pool: turns come back from the host tier."""
    import random

    rng = random.Random(7)
    sessions = [[256] + [rng.randrange(256) for _ in range(40)] for _ in range(3)]
    turns = []
    for _ in range(3):  # each turn: the session's history and 18 new tokens
        for s in range(3):
            turns.append((s, list(sessions[s])))
            sessions[s] = sessions[s] + [rng.randrange(256) for _ in range(18)]
    plain = LLMEngine.from_model(tiny_model, num_blocks=12, max_num_batched_tokens=64)
    tier = LLMEngine.from_model(tiny_model, num_blocks=12, max_num_batched_tokens=64,
                                kv_tiers={"host_blocks": 32})
    for s, prompt in turns:  # one at a time, so turns evict the others' sessions
        p, t = plain.generate([prompt], GREEDY)[0], tier.generate([prompt], GREEDY)[0]
        assert t.token_ids == p.token_ids == hf_greedy(tiny_model, prompt, 8), (s, len(prompt))
    host = tier.kv.host
    # 6 blocks came back from the host tier: 96 more prompt tokens not computed than without it
    assert (host.stats.loaded, tier.stats.cached_prompt_tokens, plain.stats.cached_prompt_tokens) == (6, 240, 144)
    for e in (plain, tier):
        e.check_invariants()
        assert e.kv.num_free_blocks == e.kv.num_blocks and e.kv.num_requests() == 0
    assert (host.num_used, host.num_free) == (16, 16)


def test_a_prompt_reloaded_from_the_host_tier_gives_the_same_tokens(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=8, max_num_batched_tokens=64,
                                  kv_tiers={"host_blocks": 16})
    base = [256] + list(range(1, 70))  # 70 tokens: 4 full blocks
    first = engine.generate([base], GREEDY)[0]
    engine.generate([[256] + list(range(100, 212))], GREEDY)  # 8 blocks: evicts base's 4
    assert engine.kv.find_cached_prefix(engine.make_request("probe", prompt_token_ids=base)).blocks == ()
    again = engine.generate([base], GREEDY)[0]
    assert again.num_cached_tokens == 64
    assert engine.kv.host.stats.loaded == 4
    assert again.token_ids == first.token_ids == hf_greedy(tiny_model, base, 8)
    engine.check_invariants()
    assert engine.kv.num_free_blocks == 8 and engine.kv.num_requests() == 0
    # host: base's 4, then 4 of the long prompt's 7 full blocks, evicted by the reload's 5 blocks
    # (its uncached last block went first)
    assert (engine.kv.host.num_used, engine.kv.host.num_free) == (8, 8)


# ---- the disk tier, below the host tier ---------------------------------------------------------


def test_host_evictions_go_to_disk_and_a_prefix_comes_back_from_both_tiers(tmp_path):
    host = arena(4, 2)
    disk = DiskArena(host, str(tmp_path))
    kv = KVCacheManager(4, 4, tiers=[BlockTier("host", 2, host), BlockTier("disk", 8, disk)])
    h_tier, d_tier = kv.tiers
    first = Req("a", range(13))
    assert run(kv, first) == [0, 1, 2, 3]
    b = Req("b", range(100, 116))
    run(kv, b)  # evicts a's blocks 2, 1, 0: the host keeps 2, hands 1 down
    b_first = b.block_hashes[0]
    h0, h1, h2 = first.block_hashes
    assert held(h_tier) == [(h1, 1), (h0, 0)] and held(d_tier) == [(h2, 0)]
    assert [p.name for p in disk.dir.iterdir()] == ["0.kv"]
    host.device_cache[:] = -1.0
    again = Req("a2", range(13))
    prefix = kv.find_cached_prefix(again)
    assert prefix.loads == ((0, h0), (0, h1), (1, h2))
    assert kv.allocate_slots(again, 1, prefix)
    assert kv.block_ids("a2") == [0, 1, 2, 3]
    assert host.device_cache[:3, 0].tolist() == [1.0, 2.0, 3.0]  # a's bytes, from host and disk
    # the loads' own allocation evicted 3 of b's blocks while both host slots were pinned: dropped;
    # the new token's block (after the inline copy) evicted b's 4th, which pushed h0 (the host's
    # LRU) down to disk
    assert (h_tier.stats.loaded, d_tier.stats.loaded, h_tier.stats.dropped) == (2, 1, 3)
    assert held(h_tier) == [(h1, 1), (b_first, 0)] and held(d_tier) == [(h2, 0), (h0, 1)]
    kv.free("a2")
    kv.check_invariants()
    assert (kv.num_free_blocks, h_tier.num_used, h_tier.num_free, d_tier.num_used, d_tier.num_free) == (4, 2, 0, 2, 6)
    disk.close()
    assert not disk.dir.exists()


def test_disk_tier_config_is_validated(tmp_path):
    with pytest.raises(ValidationError, match="disk_dir needs kv_tiers.host_blocks > 0"):
        EngineOptions(kv_tiers={"disk_dir": str(tmp_path)})
    with pytest.raises(ValidationError, match="greater than 0"):
        EngineOptions(kv_tiers={"host_blocks": 4, "disk_dir": str(tmp_path), "disk_gb": 0})
    assert disk_blocks(str(tmp_path), 1.0, 2**20) == 1024
    with pytest.raises(ValueError, match="is not an existing directory"):
        disk_blocks(str(tmp_path / "missing"), 1.0, 4096)
    with pytest.raises(ValueError, match="holds no block of 4096 bytes"):
        disk_blocks(str(tmp_path), 1e-9, 4096)
    with pytest.raises(ValueError, match="GiB free in kv_tiers.disk_dir"):
        disk_blocks(str(tmp_path), 65536, 4096)


def test_a_prompt_reloaded_from_the_disk_tier_gives_the_same_tokens(tiny_model, tmp_path):
    plain = LLMEngine.from_model(tiny_model, num_blocks=8, max_num_batched_tokens=64)
    engine = LLMEngine.from_model(tiny_model, num_blocks=8, max_num_batched_tokens=64, kv_tiers={
        "host_blocks": 2, "disk_dir": str(tmp_path), "disk_gb": 64 * 8192 / 2**30})
    host, disk = engine.kv.tiers
    assert (host.num_blocks, disk.num_blocks, engine.block_bytes) == (2, 64, 8192)
    base = [256] + list(range(1, 70))  # 4 full blocks
    first = engine.generate([base], GREEDY)[0]
    engine.generate([[256] + list(range(100, 212))], GREEDY)  # evicts base's 4: 2 reach the disk
    again = engine.generate([base], GREEDY)[0]
    assert again.num_cached_tokens == 64
    assert (host.stats.loaded, disk.stats.loaded) == (2, 2)
    assert again.token_ids == first.token_ids == plain.generate([base], GREEDY)[0].token_ids \
        == hf_greedy(tiny_model, base, 8)
    engine.check_invariants()
    assert engine.kv.num_free_blocks == 8 and engine.kv.num_requests() == 0
    assert (host.num_used + host.num_free, disk.num_used + disk.num_free) == (2, 64)


# ---- a tier whose saves fail (a full disk) -------------------------------------------------------


def fill_disk(disk: DiskArena, slots: int) -> None:
    """Every slot file of the arena is /dev/full: each block written there fails with ENOSPC, as on
    a full file system (the arena's real write path, the kernel's real error)."""
    for slot in range(slots):
        os.symlink("/dev/full", disk.dir / f"{slot}.kv")


def test_a_failed_save_is_skipped_the_slot_stays_free_and_the_allocation_gets_its_blocks(tmp_path):
    host = arena(4, 2)
    disk = DiskArena(host, str(tmp_path))
    fill_disk(disk, 8)
    kv = KVCacheManager(4, 4, tiers=[BlockTier("host", 2, host), BlockTier("disk", 8, disk)])
    h_tier, d_tier = kv.tiers
    first = Req("a", range(13))
    assert run(kv, first) == [0, 1, 2, 3]
    h_tier.drain_events(), d_tier.drain_events()
    free_before = kv.num_free_blocks
    b = Req("b", range(100, 116))
    assert run(kv, b) == [3, 2, 1, 0]  # evicts a's 3 cached blocks: the host keeps 2, the disk fails 1
    assert kv.num_free_blocks == free_before == 4
    h0, h1, h2 = first.block_hashes
    assert held(h_tier) == [(h1, 1), (h0, 0)] and held(d_tier) == []
    assert (d_tier.stats.save_failed, d_tier.stats.stored, d_tier.num_free, kv.save_failures) == (1, 0, 8, 1)
    assert d_tier.drain_events() == []  # the router never hears of a block the disk does not hold
    kv.check_invariants()
    again = Req("a2", range(13))  # a's prefix: 2 blocks from the host, the third is recomputed
    assert kv.find_cached_prefix(again).loads == ((0, h0), (0, h1))
    disk.close()


def test_a_full_disk_fails_no_request_leaks_no_block_and_trips_health_after_n_steps(tiny_model, tmp_path):
    from tests.serving.test_replica_health import replica_around

    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = [[256] + [i + 1] * 47 for i in range(8)]  # 3 full blocks each, nothing shared
    expected = [o.token_ids for o in LLMEngine.from_model(tiny_model, num_blocks=8).generate(prompts, sp)]
    engine = LLMEngine.from_model(tiny_model, num_blocks=8, kv_tiers={
        "host_blocks": 2, "disk_dir": str(tmp_path), "disk_gb": 16 * 8192 / 2**30})
    host, disk = engine.kv.tiers
    fill_disk(disk.copier, 16)
    replica = replica_around(engine, max_errors=3)
    errors_in_a_row, healthy, tokens = [], [], []

    async def one(i: int) -> None:
        outs = [o async for o in replica.loop.generate(f"r{i}", prompt_token_ids=prompts[i], sampling=sp)]
        tokens.append(outs[-1].token_ids)
        assert outs[-1].finish_reason == "length"  # a failed save fails no request

    try:
        for i in range(7):
            asyncio.run(one(i))  # one step each: the prompt, then its one token
            errors_in_a_row.append(engine.stats.consecutive_step_errors)
            try:
                replica.check_health()
                healthy.append("ok")
            except RuntimeError as e:
                healthy.append(str(e))
        # 8 blocks: the first two requests take fresh ones, the third evicts 1 block into the host
        # tier, the fourth 3 (the host's 2nd slot takes one, then its LRU goes down to the disk,
        # which fails: 2), each later one 3 more failures: 2 + 3 * 3
        assert errors_in_a_row == [0, 0, 0, 1, 2, 3, 4]
        assert healthy == ["ok"] * 5 + [f"decode engine: the last {n} steps failed (max_consecutive_step_errors 3)"
                                        for n in (3, 4)]
        assert tokens == expected[:7]
        assert (disk.stats.save_failed, disk.num_used, disk.stats.stored, host.num_used) == (11, 0, 0, 2)
        assert (engine.stats.step_errors, engine.kv.num_free_blocks, engine.kv.num_requests()) == (4, 8, 0)
        asyncio.run(replica.loop.call(engine.check_invariants))
        for f in disk.copier.dir.iterdir():  # room on the disk again: the next save succeeds
            f.unlink()
        asyncio.run(one(7))
        assert (engine.stats.consecutive_step_errors, disk.stats.stored, tokens[7]) == (0, 3, expected[7])
        replica.check_health()
    finally:
        replica.loop.shutdown(timeout=5)
        disk.copier.close()
