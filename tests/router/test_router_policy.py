"""Router index and policy without Ray: exact decisions for crafted states."""

import random

import pytest

from cluster.engine.kv_cache import hash_request_blocks
from router.index import PrefixIndex
from router.policy import NoReplicaError, PolicyConfig, ReplicaLoad, RoutingPolicy

BS = 16
SYSTEM = list(range(64))  # a 4-block shared prefix


def hashes(tokens):
    return hash_request_blocks(tokens, BS, b"model")


def load(rid, pool, free=1000, total=1000, running=0, waiting=0, queued=0, step=0.01):
    return ReplicaLoad(rid, pool, free, total, running, waiting, queued, step)


def index_with(holdings: dict[str, list[int]], inc="i1"):
    idx = PrefixIndex()
    for rid, tokens in holdings.items():
        idx.resync(rid, inc, 0, hashes(tokens))
    return idx


def policy(**kw):
    return RoutingPolicy(PolicyConfig(block_size=BS, **kw), random.Random(0))


PROMPT = SYSTEM + list(range(500, 516))  # 80 tokens: 64 shared + 16 own


def test_cache_beats_load_until_the_load_gap_crosses_the_cost():
    idx = index_with({"p-a": SYSTEM, "d-0": []})
    h = hashes(PROMPT)
    pol = policy()
    # p-a holds 64 of 80 tokens: its cost is 16 + queue; p-b computes all 80.
    for queued_a, expected in [(0, "p-a"), (63, "p-a"), (64, None), (65, "p-b")]:
        loads = [load("p-a", "prefill", queued=queued_a), load("p-b", "prefill"), load("d-0", "decode")]
        d = pol.route(h, len(PROMPT), idx, loads)
        if expected is None:  # 16 + 64 == 80: a tie, broken at random but only between the two
            assert d.prefill in {"p-a", "p-b"}
            continue
        assert (d.prefill, d.decode, d.mode) == (expected, "d-0", "remote")
        assert d.predicted_cached_tokens == (64 if expected == "p-a" else 0)
        assert d.reason.startswith("cache" if expected == "p-a" else "load")


def test_local_prefill_when_the_decode_replica_lacks_few_tokens():
    pol = policy(local_prefill_threshold=64)
    loads = [load("p-a", "prefill"), load("d-0", "decode")]
    idx = index_with({"d-0": SYSTEM})
    d = pol.route(hashes(PROMPT), len(PROMPT), idx, loads)  # 16 uncached on d-0
    assert (d.prefill, d.decode, d.mode, d.predicted_cached_tokens) == (None, "d-0", "local", 64)
    assert d.reason == "local prefill: 16 uncached tokens"
    cold = pol.route(hashes(PROMPT), len(PROMPT), index_with({}), loads)  # 80 uncached: remote
    assert (cold.prefill, cold.mode, cold.predicted_cached_tokens) == ("p-a", "remote", 0)


def test_no_prefill_pool_means_local_and_no_decode_pool_is_an_error():
    d = policy().route(hashes(PROMPT), len(PROMPT), PrefixIndex(), [load("d-0", "decode")])
    assert (d.prefill, d.mode, d.reason) == (None, "local", "no prefill pool")
    with pytest.raises(NoReplicaError):
        policy().route(hashes(PROMPT), len(PROMPT), PrefixIndex(), [load("p-a", "prefill")])


def test_decode_cost_grows_with_requests_and_blocks():
    pol = policy()
    loads = [load("p-a", "prefill"), load("d-0", "decode", running=2), load("d-1", "decode", free=900)]
    # d-0: 2 * 32 = 64 tokens of work; d-1: 100 blocks in use = 100
    assert pol.route(hashes(PROMPT), 200, PrefixIndex(), loads).decode == "d-0"
    loads[1] = load("d-0", "decode", running=4)  # 128 > 100
    assert pol.route(hashes(PROMPT), 200, PrefixIndex(), loads).decode == "d-1"


def test_slow_replica_is_avoided():
    idx = index_with({"p-a": SYSTEM})
    # p-a has the cache (cost 16) but steps 3x slower than the pool median: 16 * 4 = 64 > ...
    loads = [load("p-a", "prefill", step=0.09), load("p-b", "prefill", step=0.03), load("p-c", "prefill", step=0.03),
             load("d-0", "decode")]
    d = policy(slow_penalty=8.0).route(hashes(PROMPT), len(PROMPT), idx, loads)
    assert d.prefill in {"p-b", "p-c"} and d.predicted_cached_tokens == 0
    assert "slow replica avoided: p-a" in d.reason
    fast = [load("p-a", "prefill", step=0.05), *loads[1:]]  # 1.67x the median: not slow
    assert policy(slow_penalty=8.0).route(hashes(PROMPT), len(PROMPT), idx, fast).prefill == "p-a"


def test_one_slow_replica_of_two_is_found_and_loses_even_at_zero_load():
    loads = [load("p-a", "prefill"), load("d-fast", "decode", step=0.01), load("d-slow", "decode", step=0.03)]
    for _ in range(10):  # idle: both decode costs are 0, the slow one's is 0 * 4 + 1
        assert policy().route(hashes(PROMPT), len(PROMPT), index_with({}), loads).decode == "d-fast"
    busy = [loads[0], load("d-fast", "decode", running=1, step=0.01), loads[2]]  # 32 vs 1
    assert policy().route(hashes(PROMPT), len(PROMPT), index_with({}), busy).decode == "d-slow"


def test_hot_prefix_spreads_past_the_load_cap():
    idx = index_with({"p-a": SYSTEM})
    pol = policy(hot_load_cap=8)
    under = [load("p-a", "prefill", running=7), load("p-b", "prefill"), load("d-0", "decode")]
    assert pol.route(hashes(PROMPT), len(PROMPT), idx, under).prefill == "p-a"
    at_cap = [load("p-a", "prefill", running=8, queued=1), load("p-b", "prefill"), load("d-0", "decode")]
    d = pol.route(hashes(PROMPT), len(PROMPT), idx, at_cap)
    assert (d.prefill, d.predicted_cached_tokens) == ("p-b", 0)
    assert "hot prefix spread past cap on ['p-a']" in d.reason
    # once p-b has cached the prefix too, both serve it
    idx.resync("p-b", "i1", 0, hashes(SYSTEM))
    assert pol.route(hashes(PROMPT), len(PROMPT), idx, at_cap).predicted_cached_tokens == 64


def test_index_resync_after_a_sequence_gap_or_new_incarnation():
    idx = PrefixIndex()
    h = hashes(list(range(48)))
    assert not idx.apply("p-a", "i1", 1, [("+", x) for x in h])  # unknown replica: resync first
    idx.resync("p-a", "i1", 0, [])
    assert idx.apply("p-a", "i1", 1, [("+", x) for x in h[:2]])
    assert idx.apply("p-a", "i1", 2, [("+", x) for x in h[2:]])
    assert idx.prefix_blocks(h, ["p-a"]) == {"p-a": 3}
    assert not idx.apply("p-a", "i1", 4, [("-", h[0])])  # seq 3 was lost
    assert idx.prefix_blocks(h, ["p-a"]) == {"p-a": 3}  # nothing applied
    idx.resync("p-a", "i1", 4, h[1:])  # the replica's snapshot: block 0 was evicted
    assert idx.prefix_blocks(h, ["p-a"]) == {"p-a": 0}  # chained: nothing useful without block 0
    assert not idx.apply("p-a", "i2", 5, [("+", h[0])])  # restarted replica: resync
    idx.check_invariants()


def test_index_prefix_counts_and_forget():
    idx = PrefixIndex()
    h = hashes(list(range(64)))
    idx.resync("a", "i", 0, h)
    idx.resync("b", "i", 0, h[:2])
    idx.resync("c", "i", 0, h[1:])
    assert idx.prefix_blocks(h, ["a", "b", "c", "d"]) == {"a": 4, "b": 2, "c": 0, "d": 0}
    assert idx.apply("a", "i", 1, [("-", h[2])])
    assert idx.prefix_blocks(h, ["a", "b"]) == {"a": 2, "b": 2}
    idx.forget("a")
    assert idx.replicas() == ["b", "c"] and idx.num_blocks("a") == 0
    assert idx.prefix_blocks(h, ["a", "b"]) == {"a": 0, "b": 2}
    idx.check_invariants()


def test_events_apply_in_order():
    idx = PrefixIndex()
    h = hashes(list(range(32)))
    idx.resync("a", "i", 0, [])
    assert idx.apply("a", "i", 1, [("+", h[0]), ("-", h[0]), ("+", h[1])])
    assert idx.hashes("a") == {h[1]}
    assert idx.apply("a", "i", 2, [("-", h[1]), ("+", h[1])])  # evicted, then cached again
    assert idx.hashes("a") == {h[1]}
    idx.check_invariants()


def test_ties_are_broken_at_random_between_equals_only():
    loads = [load("p-a", "prefill"), load("p-b", "prefill"), load("p-c", "prefill", queued=1), load("d-0", "decode")]
    seen = {RoutingPolicy(PolicyConfig(block_size=BS), random.Random(seed)).route(
        hashes(PROMPT), len(PROMPT), PrefixIndex(), loads).prefill for seed in range(20)}
    assert seen == {"p-a", "p-b"}


def test_baselines_ignore_the_cache():
    from router.baselines import PowerOfTwoPolicy, RoundRobinPolicy

    idx = index_with({"p-a": SYSTEM})
    loads = [load("p-a", "prefill", queued=50), load("p-b", "prefill"), load("d-0", "decode")]
    rr = RoundRobinPolicy(PolicyConfig(block_size=BS))
    picks = [rr.route(hashes(PROMPT), len(PROMPT), idx, loads) for _ in range(4)]
    assert [d.prefill for d in picks] == ["p-a", "p-b", "p-a", "p-b"]
    assert [d.predicted_cached_tokens for d in picks] == [64, 0, 64, 0]
    p2 = PowerOfTwoPolicy(PolicyConfig(block_size=BS), random.Random(0))
    assert p2.route(hashes(PROMPT), len(PROMPT), idx, loads).prefill == "p-b"  # shorter queue wins


def test_router_counts_its_own_assignments_until_the_next_report():
    from router.router import Router

    router = Router(RoutingPolicy(PolicyConfig(block_size=BS, local_prefill_threshold=0), random.Random(0)),
                    clock=lambda: 0.0)
    for rid, pool in (("p-a", "prefill"), ("p-b", "prefill"), ("d-0", "decode")):
        router.report_load(load(rid, pool))
    cold = [9000 + i for i in range(80)]
    first = router.route(hashes(cold), 80, )
    second = router.route(hashes(cold), 80)  # p-(first) now has 80 pending tokens: the other wins
    assert {first.prefill, second.prefill} == {"p-a", "p-b"}
    router.report_load(load(first.prefill, "prefill"))  # a fresh report supersedes the pending work
    assert router.route(hashes(cold), 80).prefill == first.prefill



def test_decision_predicts_the_queue_wait_on_the_replica_computing_the_prompt():
    from dataclasses import replace

    pol = policy(local_prefill_threshold=64)
    pre = replace(load("p-a", "prefill", queued=3000), tokens_per_s=1500.0)
    dec = replace(load("d-0", "decode", queued=200), tokens_per_s=400.0)
    remote = pol.route(hashes(PROMPT), len(PROMPT), index_with({}), [pre, dec])
    assert (remote.mode, remote.queue_wait_s) == ("remote", 2.0)  # 3000 tokens at 1500/s
    local = pol.route(hashes(PROMPT), len(PROMPT), index_with({"d-0": SYSTEM}), [pre, dec])
    assert (local.mode, local.queue_wait_s) == ("local", 0.5)  # 200 tokens at 400/s
    unmeasured = pol.route(hashes(PROMPT), len(PROMPT), index_with({}), [load("p-a", "prefill", queued=9999), dec])
    assert unmeasured.queue_wait_s == 0.0  # no throughput measured yet: no prediction


def test_colocated_decode_choice_counts_the_prompt_work_and_the_cache():
    pol = policy()
    idx = index_with({"d-1": SYSTEM})
    # no prefill pool: d-0 would compute all 80 prompt tokens, d-1 only the 16 past its cached prefix
    d = pol.route(hashes(PROMPT), len(PROMPT), idx, [load("d-0", "decode"), load("d-1", "decode")])
    assert (d.decode, d.mode, d.predicted_cached_tokens, d.reason) == ("d-1", "local", 64, "no prefill pool")
    # 100 prompt tokens queued on d-1: 16 + 100 > 80
    d = pol.route(hashes(PROMPT), len(PROMPT), idx, [load("d-0", "decode"), load("d-1", "decode", queued=100)])
    assert (d.decode, d.predicted_cached_tokens) == ("d-0", 0)


def test_a_failing_replica_is_avoided_unless_its_whole_pool_fails():
    failing = ReplicaLoad("d-broken", "decode", 1000, 1000, failing=True)  # idle: the cheapest by cost
    busy = load("d-busy", "decode", running=5)
    d = policy().route(hashes(PROMPT), len(PROMPT), index_with({}), [load("p-a", "prefill"), failing, busy])
    assert d.decode == "d-busy" and "failing replica avoided: d-broken" in d.reason
    alone = policy().route(hashes(PROMPT), len(PROMPT), index_with({}), [load("p-a", "prefill"), failing])
    assert alone.decode == "d-broken"  # better a replica that may recover than no answer


def test_slow_replicas_are_those_of_the_leave_one_out_median_definition():
    """_slow (sorted once) against its definition, a median of the others per replica, on random
    pools of 0 to 40 replicas with ties, unmeasured replicas (step 0) and outliers."""
    import statistics

    def by_definition(pool, factor):
        measured = [r for r in pool if r.step_time_s > 0]
        if len(measured) < 2:
            return set()
        return {r.replica_id for r in measured
                if r.step_time_s >= factor * statistics.median(o.step_time_s for o in measured if o is not r)}

    rng = random.Random(5)
    policy = RoutingPolicy(PolicyConfig())
    found = 0
    for trial in range(400):
        n = rng.randrange(0, 41)
        steps = [rng.choice([0.0, 0.01, 0.02, 0.02, rng.uniform(0.005, 0.05), rng.uniform(0.05, 0.5)])
                 for _ in range(n)]
        pool = [load(f"d{i}", "decode", step=t) for i, t in enumerate(steps)]
        want = by_definition(pool, policy.config.slow_factor)
        assert policy._slow(pool) == want, (trial, steps)
        found += len(want)
    assert found > 100  # the pools had slow replicas to find
