"""Tier-aware routing (issue 19), without Ray: replicas publish which tier holds each block (device
pool "+"/"-", host "+1"/"-1", disk "+2"/"-2"); the index finds a prompt's blocks as the replica's
KV cache would (the device prefix, then the blocks after it that a lower tier holds); the cost
model credits a lower-tier block at its tier's weight, so a prefix pushed down to host memory still
draws its requests, after a replica that holds it on the device. And the engine's feed: its host
tier's stores and evictions reach the events and the snapshot."""

import random

from cluster.engine.kv_cache import hash_request_blocks
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from router.index import PrefixIndex
from router.policy import PolicyConfig, ReplicaLoad, RoutingPolicy

BS = 16
SYSTEM = list(range(64))  # 4 blocks
PROMPT = SYSTEM + list(range(500, 516))  # 80 tokens: 64 shared + 16 own


def hashes(tokens):
    return hash_request_blocks(tokens, BS, b"model")


def test_the_index_follows_each_tiers_events_and_snapshots():
    h = hashes(PROMPT)
    idx = PrefixIndex()
    idx.resync("p-a", "i1", 0, h[:1], [h[1:3], h[3:4]])  # device 1 block, host 2, disk 1
    assert idx.prefix_tiers(h, ["p-a", "p-b"]) == {"p-a": (1, (1, 1, 2)), "p-b": (0, ())}
    # the pool evicts block 0 into the host tier; the host tier pushes block 2 down to disk
    assert idx.apply("p-a", "i1", 1, [("-", h[0]), ("+1", h[0]), ("-1", h[2]), ("+2", h[2])])
    assert idx.prefix_tiers(h, ["p-a"]) == {"p-a": (0, (1, 1, 2, 2))}
    assert idx.apply("p-a", "i1", 2, [("-2", h[2])])  # gone from disk: the chain stops before it
    assert idx.prefix_tiers(h, ["p-a"]) == {"p-a": (0, (1, 1))}
    assert idx.num_blocks("p-a") == 0  # device blocks only: what a miss can evict
    idx.check_invariants()
    idx.forget("p-a")
    assert idx.prefix_tiers(h, ["p-a"]) == {"p-a": (0, ())}


def load(rid, pool, queued=0):
    return ReplicaLoad(rid, pool, 1000, 1000, 0, 0, queued, 0.01)


def test_a_prefix_in_a_host_tier_is_credited_at_its_weight():
    h = hashes(PROMPT)
    pol = RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0))
    idx = PrefixIndex()
    idx.resync("p-host", "i", 0, [], [h[:4]])  # the whole prefix in its host tier
    idx.resync("p-none", "i", 0, [])
    idx.resync("d-0", "i", 0, [])
    loads = [load("p-host", "prefill"), load("p-none", "prefill"), load("d-0", "decode")]
    d = pol.route(h, len(PROMPT), idx, loads)
    # cost: p-host 80 - 4 x 0.75 x 16 = 32 tokens of work; p-none 80
    assert (d.prefill, d.predicted_cached_tokens, d.reason.split(";")[0]) == ("p-host", 64, "cache")
    # queued work moves it: 32 + 48 = 80 ties with p-none; 49 more tips it
    d = pol.route(h, len(PROMPT), idx, [load("p-host", "prefill", queued=49), loads[1], loads[2]])
    assert d.prefill == "p-none"
    # a replica holding it on the device beats one holding it in its host tier
    idx.resync("p-dev", "i", 0, h[:4])
    d = pol.route(h, len(PROMPT), idx, [*loads, load("p-dev", "prefill")])
    assert d.prefill == "p-dev"
    # and with host credit off (weight 0) the host tier earns nothing over an empty replica
    off = RoutingPolicy(PolicyConfig(block_size=BS, tier_weights=(0.0, 0.0)), random.Random(0))
    costs = {off.route(h, len(PROMPT), idx, loads).prefill for _ in range(20)}
    assert costs == {"p-host", "p-none"}  # a tie, broken at random


def test_tier_weights_default_to_each_replicas_measured_load_back_cost():
    h = hashes(PROMPT)
    pol = RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0))
    # 2,000 tokens/s: a block of 16 costs 8 ms to compute; loading it back 2 ms (host), 6 ms (disk)
    measured = ReplicaLoad("p-a", "prefill", 1000, 1000, tokens_per_s=2000.0, tier_load_s_per_block=(0.002, 0.006))
    assert pol.tier_weights(measured) == (0.75, 0.25)
    fast = ReplicaLoad("p-a", "prefill", 1000, 1000, tokens_per_s=2000.0, tier_load_s_per_block=(0.0004, 0.0))
    assert pol.tier_weights(fast) == (0.95, 0.25)  # disk not measured yet: its prior
    slow = ReplicaLoad("p-a", "prefill", 1000, 1000, tokens_per_s=2000.0, tier_load_s_per_block=(0.02,))
    assert pol.tier_weights(slow) == (0.0, 0.25)  # slower than computing it: no credit
    assert pol.tier_weights(load("p-a", "prefill")) == (0.75, 0.25)  # nothing measured
    fixed = RoutingPolicy(PolicyConfig(block_size=BS, tier_weights=(0.5, 0.1)), random.Random(0))
    assert fixed.tier_weights(fast) == (0.5, 0.1)
    # the decision follows: the prefix in p-fast's host tier is worth 4 x 0.95 blocks there
    idx = PrefixIndex()
    idx.resync("p-fast", "i", 0, [], [h[:4]])
    idx.resync("p-slow", "i", 0, [], [h[:4]])
    idx.resync("d-0", "i", 0, [])
    loads = [ReplicaLoad("p-fast", "prefill", 1000, 1000, queued_prefill_tokens=10, tokens_per_s=2000.0,
                         tier_load_s_per_block=(0.0004,)),
             ReplicaLoad("p-slow", "prefill", 1000, 1000, tokens_per_s=2000.0, tier_load_s_per_block=(0.02,)),
             load("d-0", "decode")]
    d = pol.route(h, len(PROMPT), idx, loads)  # p-fast: 80 - 60.8 + 10 = 29.2; p-slow: 80
    assert (d.prefill, d.predicted_cached_tokens) == ("p-fast", 64)


def test_colocated_decode_counts_its_own_host_tier():
    h = hashes(PROMPT)
    pol = RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0))
    idx = PrefixIndex()
    idx.resync("d-host", "i", 0, h[:1], [h[1:4]])
    idx.resync("d-none", "i", 0, [])
    d = pol.route(h, len(PROMPT), idx, [load("d-host", "decode"), load("d-none", "decode")])
    assert (d.decode, d.mode, d.predicted_cached_tokens) == ("d-host", "local", 64)


def test_in_pd_mode_a_decode_replica_holding_the_prefix_in_its_host_tier_pulls_less():
    """Imports take their prefix from the decode's own tiers (loaded, not pulled): the decode
    choice credits them at the tier's weight, after a replica holding them on the device."""
    h = hashes(PROMPT)
    pol = RoutingPolicy(PolicyConfig(block_size=BS, pull_block_cost=10.0, local_prefill_threshold=0), random.Random(0))
    idx = PrefixIndex()
    idx.resync("p-0", "i", 0, [])
    idx.resync("d-host", "i", 0, [], [h[:4]])
    idx.resync("d-none", "i", 0, [])
    loads = [load("p-0", "prefill"), load("d-host", "decode"), load("d-none", "decode")]
    d = pol.route(h, len(PROMPT), idx, loads)
    # d-host lacks 5 - 4 x 0.75 = 2 blocks' pull (11 tokens of work each), d-none 5
    assert (d.decode, d.mode, d.decode_cached_tokens) == ("d-host", "remote", 64)
    idx.resync("d-dev", "i", 0, h[:4])
    assert pol.route(h, len(PROMPT), idx, [*loads, load("d-dev", "decode")]).decode == "d-dev"


def test_the_engine_feeds_its_host_tier_to_the_router(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=8, max_num_batched_tokens=64, kv_tiers={"host_blocks": 16})
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    base = [256] + list(range(1, 70))  # 4 full blocks
    engine.generate([base], greedy)
    engine.drain_block_events()
    engine.generate([[256] + list(range(100, 212))], greedy)  # 8 blocks: evicts base's 4 into the host tier
    events = engine.drain_block_events()
    stored_host = [h for kind, h in events if kind == "+1"]
    base_hashes = list(hash_request_blocks(base, engine.config.block_size, engine.kv.salt))[:4]
    assert set(base_hashes) <= set(stored_host)
    assert {kind for kind, _ in events} <= {"+", "-", "+1", "-1"}
    idx = PrefixIndex()
    idx.resync("r", "i", 0, engine.cached_block_hashes(), engine.tier_block_hashes())
    device, lower = idx.prefix_tiers(base_hashes, ["r"])["r"]
    assert device + len(lower) == 4 and set(lower) <= {1}
    assert [set(t) for t in engine.tier_block_hashes()] == [set(engine.kv.host.hashes())]
    engine.reset_prefix_cache()
    gone = {h for kind, h in engine.drain_block_events() if kind == "-1"}
    assert gone == set(stored_host) - {h for kind, h in events if kind == "-1"}
