"""Routing around runtime role flips, without Ray: a draining replica is never chosen (by the cost
policy, the baselines or the router), a pool whose replicas all drain is a pool with none, and the
decision names the deployment each chosen replica lives in."""

import random
from dataclasses import replace

import pytest

from cluster.engine.kv_cache import hash_request_blocks
from router.baselines import PowerOfTwoPolicy, RoundRobinPolicy
from router.index import PrefixIndex
from router.policy import NoReplicaError, PolicyConfig, ReplicaLoad, RoutingPolicy
from router.router import Router

BS = 16
PROMPT = list(range(1, 129))  # 128 tokens: remote prefill (past local_prefill_threshold 64)
HASHES = hash_request_blocks(PROMPT, BS, b"model")


def load(rid, pool, deployment=None, draining=False, running=0, queued=0):
    return ReplicaLoad(rid, pool, 1000, 1000, running, 0, queued, 0.01, deployment=deployment, draining=draining)


def index_with(holdings: dict[str, list[int]]) -> PrefixIndex:
    idx = PrefixIndex()
    for rid, tokens in holdings.items():
        idx.resync(rid, "i1", 0, hash_request_blocks(tokens, BS, b"model"))
    return idx


POLICIES = [lambda: RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0)),
            lambda: RoundRobinPolicy(PolicyConfig(block_size=BS), random.Random(0)),
            lambda: PowerOfTwoPolicy(PolicyConfig(block_size=BS), random.Random(0))]


def test_home_defaults_to_the_pool():
    assert load("p-a", "prefill").deployment == "prefill"
    assert load("d-0", "decode").deployment == "decode"
    assert load("p-b", "decode", deployment="prefill").deployment == "prefill"


@pytest.mark.parametrize("make", POLICIES)
def test_a_draining_replica_is_never_chosen_even_when_it_is_cheapest(make):
    # p-a holds the whole prompt and is idle; d-0 holds it too: each is the cheapest of its pool
    idx = index_with({"p-a": PROMPT, "d-0": PROMPT})
    pol = make()
    for _ in range(20):
        d = pol.route(HASHES, len(PROMPT), idx, [
            load("p-a", "prefill", draining=True), load("p-b", "prefill", queued=5000),
            load("d-0", "decode", draining=True), load("d-1", "decode", running=30)])
        assert (d.prefill, d.decode) == ("p-b", "d-1")


@pytest.mark.parametrize("make", POLICIES)
def test_a_pool_of_draining_replicas_only_is_a_pool_with_none(make):
    pol = make()
    d = pol.route(HASHES, len(PROMPT), index_with({}), [
        load("p-a", "prefill", draining=True), load("d-0", "decode")])
    assert (d.prefill, d.decode, d.mode, d.prefill_deployment, d.decode_deployment) == (None, "d-0", "local", None, "decode")
    with pytest.raises(NoReplicaError):
        pol.route(HASHES, len(PROMPT), index_with({}), [load("p-a", "prefill"), load("d-0", "decode", draining=True)])


@pytest.mark.parametrize("make", POLICIES)
def test_decisions_name_the_home_of_each_chosen_replica(make):
    # p-b lives in the prefill deployment and decodes now; d-0 lives in the decode deployment and prefills now
    loads = [load("d-0", "prefill", deployment="decode"), load("p-b", "decode", deployment="prefill")]
    d = make().route(HASHES, len(PROMPT), index_with({}), loads)
    assert (d.prefill, d.prefill_deployment, d.decode, d.decode_deployment, d.mode) == ("d-0", "decode", "p-b", "prefill",
                                                                            "remote")
    local = make().route(HASHES, len(PROMPT), index_with({}), [load("p-b", "decode", deployment="prefill")])
    assert (local.prefill, local.prefill_deployment, local.decode, local.decode_deployment) == (None, None, "p-b", "prefill")


def test_the_router_drops_a_draining_replica_at_its_report_and_takes_it_back_at_the_next():
    t = [0.0]
    router = Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0)), clock=lambda: t[0])
    p_a, p_b, d_0 = load("p-a", "prefill"), load("p-b", "prefill", queued=5000), load("d-0", "decode")
    for r in (p_a, p_b, d_0):
        router.report_load(r)
    router.index.resync("p-a", "i1", 0, HASHES)
    assert router.route(HASHES, len(PROMPT)).prefill == "p-a"  # its cache
    router.report_load(replace(p_a, draining=True))
    assert [router.route(HASHES, len(PROMPT)).prefill for _ in range(5)] == ["p-b"] * 5
    # flipped: p-a decodes now, from the prefill deployment; the index keeps its blocks, so the
    # prompt it holds needs no prefill pool at all
    router.report_load(replace(p_a, role="decode"))
    router.report_load(replace(d_0, running=30))
    d = router.route(HASHES, len(PROMPT))
    assert (d.prefill, d.decode, d.decode_deployment, d.mode, d.predicted_cached_tokens) == (
        None, "p-a", "prefill", "local", len(PROMPT) - 1)
    assert sorted((r.replica_id, r.role, r.deployment) for r in router.live_loads()) == [
        ("d-0", "decode", "decode"), ("p-a", "decode", "prefill"), ("p-b", "prefill", "prefill")]
