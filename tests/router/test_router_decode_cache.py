"""The cost model's cache terms without Ray: the decode replica's own cached prefix (it pulls and
allocates only the blocks it lacks) and the prefill replicas' capacity (a miss that would push a
cached prefix out pays for it). Exact decisions for crafted states."""

import random
from cluster.engine.kv_cache import hash_request_blocks
from router.index import PrefixIndex
from router.policy import PolicyConfig, ReplicaLoad, RoutingPolicy

BS = 16
SYSTEM = list(range(64))  # 4 full blocks
PROMPT = SYSTEM + list(range(500, 516))  # 80 tokens, 5 blocks: 4 shared + 1 own


def hashes(tokens):
    return hash_request_blocks(tokens, BS, b"model")


def load(rid, pool, free=1000, total=1000, **kw):
    return ReplicaLoad(rid, pool, free, total, **kw)


def index_with(holdings):
    idx = PrefixIndex()
    for rid, tokens in holdings.items():
        idx.resync(rid, "i1", 0, hashes(tokens))
    return idx


def policy(**kw):
    return RoutingPolicy(PolicyConfig(block_size=BS, local_prefill_threshold=0, **kw), random.Random(0))


def test_decode_choice_credits_the_blocks_decode_already_holds():
    # Each block a decode replica lacks costs decode_block_cost (1, the block it allocates) +
    # pull_block_cost (0.5): d-0 lacks 5 blocks = 7.5; d-1 holds 4 and lacks 1 = 1.5 + its used blocks.
    pol = policy(pull_block_cost=0.5)
    idx = index_with({"d-1": SYSTEM})
    for d1_free, expected in [(995, "d-1"), (993, "d-0")]:  # d-1: 5 used + 1.5 = 6.5 < 7.5; 7 + 1.5 = 8.5
        loads = [load("p-a", "prefill"), load("d-0", "decode"), load("d-1", "decode", free=d1_free)]
        d = pol.route(hashes(PROMPT), len(PROMPT), idx, loads)
        assert (d.prefill, d.decode, d.mode) == ("p-a", expected, "remote")
        assert d.decode_cached_tokens == (64 if expected == "d-1" else 0)
    # Before this term the decode pool was chosen by load alone: the same state with d-1 holding
    # nothing sends the request to the idle d-0 either way.
    loads = [load("p-a", "prefill"), load("d-0", "decode"), load("d-1", "decode", free=995)]
    assert pol.route(hashes(PROMPT), len(PROMPT), index_with({}), loads).decode == "d-0"


def test_measured_pull_cost_weighs_a_missing_block_by_its_pull_time_at_the_prefill_pace():
    # Measured (pull_block_cost None): 0.002 s per pulled block x the prefill pool's median pace
    # (800 and 1200 tokens/s: 1000) = 2 tokens, + 1 for the block: 3 per missing block.
    # d-0 lacks 5 blocks: 15; d-1 lacks 1: 3 + its used blocks.
    pol = policy()
    idx = index_with({"d-1": SYSTEM})
    prefills = [load("p-a", "prefill", tokens_per_s=800.0), load("p-b", "prefill", tokens_per_s=1200.0)]
    for d1_free, expected in [(989, "d-1"), (987, "d-0")]:  # 11 + 3 = 14 < 15; 13 + 3 = 16 > 15
        decodes = [load("d-0", "decode", pull_s_per_block=0.002),
                   load("d-1", "decode", free=d1_free, pull_s_per_block=0.002)]
        assert pol.route(hashes(PROMPT), len(PROMPT), idx, prefills + decodes).decode == expected
    # No pull measured yet: a missing block costs only the block it takes (1): 5 against 1 + used.
    for d1_free, expected in [(997, "d-1"), (995, "d-0")]:  # 3 + 1 = 4 < 5; 5 + 1 = 6 > 5
        decodes = [load("d-0", "decode"), load("d-1", "decode", free=d1_free)]
        assert pol.route(hashes(PROMPT), len(PROMPT), idx, prefills + decodes).decode == expected


def test_the_pull_price_is_the_pools_so_a_slow_replica_stays_avoided():
    # d-slow has never pulled (0) and d-fast's average carries a stalled pull (1 s per block): with
    # a per-replica price the slow, unmeasured one looked cheap (1 + 0) against d-fast (1 + 1000).
    # One price for the pool (the median of the measured: 1 s x 1000 tokens/s) makes both 1001 for
    # the missing block, and the slow penalty decides.
    pol = policy()
    short = list(range(700, 708))  # one block, nobody holds it
    loads = [load("p-a", "prefill", tokens_per_s=1000.0),
             load("d-fast", "decode", pull_s_per_block=1.0, step_time_s=0.01),
             load("d-slow", "decode", step_time_s=0.05)]
    for seed in range(10):  # not a tie won by chance: d-slow pays 1001 x slow_penalty + 1
        pol.rng = random.Random(seed)
        assert pol.route(hashes(short), len(short), index_with({}), loads).decode == "d-fast"


def test_local_prefill_decision_uses_the_decode_replica_chosen_for_its_cache():
    pol = RoutingPolicy(PolicyConfig(block_size=BS, local_prefill_threshold=64, pull_block_cost=0.5), random.Random(0))
    idx = index_with({"d-1": SYSTEM})
    loads = [load("p-a", "prefill"), load("d-0", "decode"), load("d-1", "decode")]
    d = pol.route(hashes(PROMPT), len(PROMPT), idx, loads)  # d-1 holds 64 of 80: 16 left, prefilled there
    assert (d.prefill, d.decode, d.mode, d.predicted_cached_tokens, d.decode_cached_tokens) == (
        None, "d-1", "local", 64, 64)


def test_a_miss_goes_where_it_evicts_nothing():
    # Both prefill replicas miss PROMPT (5 blocks). p-a's 16 blocks are all free but 12 hold cached
    # blocks of other prompts: only 4 never-cached ones, so the miss pushes one cached block out
    # (evict_block_cost 4): 80 + 4 against p-b's 80. Every seed picks p-b; without the term, a tie.
    idx = index_with({"p-a": list(range(1000, 1192))})  # 12 blocks
    loads = [load("p-a", "prefill", free=16, total=16), load("p-b", "prefill", free=16, total=16),
             load("d-0", "decode")]
    picks = {RoutingPolicy(PolicyConfig(block_size=BS, local_prefill_threshold=0), random.Random(s)).route(
        hashes(PROMPT), len(PROMPT), idx, loads).prefill for s in range(20)}
    assert picks == {"p-b"}
    ties = {RoutingPolicy(PolicyConfig(block_size=BS, local_prefill_threshold=0, evict_block_cost=0),
                          random.Random(s)).route(hashes(PROMPT), len(PROMPT), idx, loads).prefill for s in range(20)}
    assert ties == {"p-a", "p-b"}
    # The replica holding the prompt's prefix still wins when full: 16 + 1 evicted block (4) < 80.
    full = index_with({"p-a": SYSTEM + list(range(1000, 1192))})  # 16 blocks cached, 16 free
    d = policy().route(hashes(PROMPT), len(PROMPT), full, loads)
    assert (d.prefill, d.predicted_cached_tokens) == ("p-a", 64)


def test_prefixes_spread_over_the_pool_when_one_replica_holds_half():
    """The routing benchmark's capacity-bound shape: 8 prefixes of 64 blocks (+4 own blocks per
    request), 2 prefill replicas of 320 blocks (a replica holds 4 such prompts: 272 blocks).
    Sent one after another, each cold prefix goes where it evicts nothing: 4 and 4, every seed."""
    rng = random.Random(7)
    prompts = [[rng.randrange(32000) for _ in range(1088)] for _ in range(8)]
    for seed in range(10):
        pol = RoutingPolicy(PolicyConfig(block_size=BS, local_prefill_threshold=0), random.Random(seed))
        idx = PrefixIndex()
        held = {"p-a": [], "p-b": []}
        for rid in held:
            idx.resync(rid, "i1", 0, [])
        loads = [load("p-a", "prefill", free=320, total=320), load("p-b", "prefill", free=320, total=320),
                 load("d-0", "decode", free=9000, total=9000)]
        for p in prompts:
            d = pol.route(hashes(p), len(p), idx, loads)
            assert d.predicted_cached_tokens == 0
            held[d.prefill] += hashes(p)
            idx.resync(d.prefill, "i1", 0, held[d.prefill])  # what the replica's events would say
        assert (len(held["p-a"]), len(held["p-b"])) == (4 * 68, 4 * 68), seed
        # and every prefix is then found where it went: all 8 hit
        for p in prompts:
            assert pol.route(hashes(p[:1024] + [1, 2, 3]), 1027, idx, loads).predicted_cached_tokens == 1024
