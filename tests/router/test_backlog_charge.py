"""The policy's backlog charge (router/policy.py): once every replica of the pool computing a
prompt has requests waiting, the prompt's work beyond the least any replica needs for it is
charged (1 + the fewest waiting) times. Exact decisions and prices on constructed loads; each
case's "today" line is the decision without the charge."""

import random

from cluster.engine.kv_cache import hash_request_blocks
from router.index import PrefixIndex
from router.policy import PolicyConfig, ReplicaLoad, RoutingPolicy

BS = 16
SYSTEM = list(range(64))  # 4 blocks, held by one replica
PROMPT = SYSTEM + list(range(500, 516))  # 80 tokens: 64 cached on the holder, 16 its own


def hashes(tokens):
    return hash_request_blocks(tokens, BS, b"model")


def load(rid, role, waiting=0, queued=0, free=1000, total=1000, running=0, failing=False):
    return ReplicaLoad(rid, role, free, total, running, waiting, queued, 0.01, failing=failing)


def route(loads, holdings=None, **config):
    idx = PrefixIndex()
    for rid, tokens in (holdings or {"p-a": SYSTEM}).items():
        idx.resync(rid, "i1", 0, hashes(tokens))
    pol = RoutingPolicy(PolicyConfig(block_size=BS, **config), random.Random(0))
    return pol.route(hashes(PROMPT), len(PROMPT), idx, loads)


def test_a_backlogged_pool_keeps_a_prefix_on_its_holder_longer():
    # p-a: 16 uncached + its queue. p-b: 80 uncached + 50 ahead, and with 2 waiting on every
    # replica its 64 tokens beyond p-a's 16 are charged twice more: 80 + 50 + 2 * 64 = 258.
    # prompt_cost: the chosen replica's cost without the charge (the holder's is its own least)
    for queued_a, expected, price, own in [(241, "p-a", 257.0, 257.0), (243, "p-b", 258.0, 130.0)]:
        d = route([load("p-a", "prefill", 2, queued_a), load("p-b", "prefill", 2, 50), load("d-0", "decode")])
        assert (d.prefill, d.predicted_cached_tokens, d.compute_cost, d.prompt_cost) == (
            expected, 64 if expected == "p-a" else 0, price, own)
        assert "pool backlogged: 2 waiting on each replica" in d.reason
    # Today (no charge) p-a at 241 ahead costs 257 against p-b's 130: the miss won. Here too,
    # while p-b has nothing waiting (spare capacity): no charge, and nothing said of it.
    d = route([load("p-a", "prefill", 2, 241), load("p-b", "prefill", 0, 50), load("d-0", "decode")])
    assert (d.prefill, d.compute_cost) == ("p-b", 130.0) and "backlogged" not in d.reason


def test_the_charge_counts_the_blocks_a_miss_evicts():
    # p-b is full of another prompt's 10 blocks: its 5 new ones evict 5 (4 tokens each): work
    # 80 + 20, charged 1 x (100 - 16) more with 1 waiting everywhere: 100 + 10 + 84 = 194.
    holdings = {"p-a": SYSTEM, "p-b": list(range(1000, 1160))}
    loads = [load("p-a", "prefill", 1, 177), load("p-b", "prefill", 1, 10, free=10, total=10), load("d-0", "decode")]
    d = route(loads, holdings)
    assert (d.prefill, d.compute_cost) == ("p-a", 193.0)
    loads[0] = load("p-a", "prefill", 1, 179)
    d = route(loads, holdings)
    assert (d.prefill, d.compute_cost, d.prompt_cost) == ("p-b", 194.0, 110.0)


def test_a_failing_idle_replica_is_not_spare_capacity():
    # p-c has nothing waiting but its steps fail: the pool's backlog is the working replicas' (3).
    loads = [load("p-a", "prefill", 3, 200), load("p-b", "prefill", 3, 0), load("p-c", "prefill", 0, failing=True),
             load("d-0", "decode")]
    d = route(loads)  # p-a: 16 + 200; p-b: 80 + 3 * 64 = 272 (uncharged, 80: p-b)
    assert (d.prefill, d.compute_cost) == ("p-a", 216.0)
    assert "pool backlogged: 3 waiting on each replica" in d.reason


def test_a_holder_past_the_hot_load_cap_earns_no_charge_on_the_others():
    # p-a holds the prefix but is at the cap: no replica is credited the prefix, so the least
    # uncached is the whole prompt and p-b's miss is charged nothing: 80 + 30 against p-a's
    # 80 + 60 (with p-a's 16 as the least, p-b would cost 110 + 64 and lose). A guard on the
    # charge: today's decision is the same.
    loads = [load("p-a", "prefill", 4, 60, running=4), load("p-b", "prefill", 1, 30), load("d-0", "decode")]
    d = route(loads, hot_load_cap=8)
    assert (d.prefill, d.predicted_cached_tokens, d.compute_cost) == ("p-b", 0, 110.0)
    assert "hot prefix spread past cap on ['p-a']" in d.reason


def test_colocated_decode_replicas_are_charged_over_their_own_pool():
    # No prefill pool: each decode replica computes the prompt. Both have 1 waiting (32 tokens of
    # decode cost each): d-a 32 + 16 + 100 = 148, d-b 32 + 80 + 1 * 64 = 176 (uncharged, 112: d-b).
    loads = [load("d-a", "decode", 1, 100), load("d-b", "decode", 1, 0)]
    d = route(loads, {"d-a": SYSTEM})
    assert (d.decode, d.mode, d.predicted_cached_tokens, d.compute_cost, d.prompt_cost) == (
        "d-a", "local", 64, 116.0, 116.0)
    assert d.reason == "no prefill pool; pool backlogged: 1 waiting on each replica"
