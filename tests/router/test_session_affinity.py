"""Session affinity without Ray: a soft preference in the cost model (the replicas that served a
session last are preferred by session_bonus tokens), never a pin, and a bounded session table."""

import random

from cluster.engine.kv_cache import hash_request_blocks
from router.index import PrefixIndex
from router.policy import PolicyConfig, ReplicaLoad, RouteDecision, RoutingPolicy, SessionHint
from router.router import Router
from router.sessions import SessionTable

BS = 16
PROMPT = list(range(9000, 9080))  # 80 tokens, cached nowhere


def hashes(tokens):
    return hash_request_blocks(tokens, BS, b"model")


def load(rid, pool, **kw):
    return ReplicaLoad(rid, pool, 1000, 1000, **kw)


def route(session, loads, seed=0, **cfg):
    pol = RoutingPolicy(PolicyConfig(block_size=BS, local_prefill_threshold=0, session_bonus=100.0, **cfg),
                        random.Random(seed))
    return pol.route(hashes(PROMPT), len(PROMPT), PrefixIndex(), loads, session)


POOLS = [load("p-a", "prefill"), load("p-b", "prefill"), load("d-0", "decode"), load("d-1", "decode")]


def test_the_session_replicas_win_ties_that_were_random():
    hint = SessionHint("p-b", "d-1")
    picks = {(d.prefill, d.decode) for d in (route(hint, POOLS, seed) for seed in range(20))}
    assert picks == {("p-b", "d-1")}
    d = route(hint, POOLS)
    assert "session kept on p-b" in d.reason and "session kept on d-1" in d.reason
    assert {(d.prefill, d.decode) for d in (route(None, POOLS, seed) for seed in range(20))} == {
        ("p-a", "d-0"), ("p-a", "d-1"), ("p-b", "d-0"), ("p-b", "d-1")}


def test_load_outweighs_the_bonus_and_the_session_lets_go():
    hint = SessionHint("p-b", "d-0")
    for queued_b, expected in [(99, "p-b"), (101, "p-a")]:  # the others pay 100 tokens
        loads = [load("p-a", "prefill"), load("p-b", "prefill", queued_prefill_tokens=queued_b), *POOLS[2:]]
        d = route(hint, loads)
        assert d.prefill == expected
        assert ("session kept on p-b" if expected == "p-b" else "session moved off p-b") in d.reason
    # decode: 32 tokens a running request; 3 running = 96 < 100 keeps it, 4 = 128 lets go
    for running, expected in [(3, "d-0"), (4, "d-1")]:
        loads = [*POOLS[:2], load("d-0", "decode", running=running), load("d-1", "decode")]
        assert route(hint, loads).decode == expected


def test_no_bonus_past_the_hot_cap_or_for_a_failing_replica():
    hint = SessionHint("p-b", "d-0")
    hot = [load("p-a", "prefill"), load("p-b", "prefill", running=4), *POOLS[2:]]
    assert {route(hint, hot, s, hot_load_cap=4).prefill for s in range(20)} == {"p-a", "p-b"}  # a plain tie
    failing = [load("p-a", "prefill", queued_prefill_tokens=500), load("p-b", "prefill", failing=True), *POOLS[2:]]
    d = route(hint, failing)
    assert d.prefill == "p-a" and "failing replica avoided: p-b" in d.reason
    gone = route(SessionHint("p-z", "d-9"), POOLS, 3)  # replicas that left: the hint matches nothing
    assert "session moved off p-z" in gone.reason and "session moved off d-9" in gone.reason


def decision(prefill, decode):
    return RouteDecision(prefill, decode, "remote" if prefill else "local", 0, "")


def test_session_table_is_bounded_by_count_and_idle_time():
    t = SessionTable(max_sessions=2, ttl_s=10.0)
    t.record("a", decision("p-a", "d-0"), now=0.0)
    t.record("b", decision("p-b", "d-1"), now=1.0)
    t.record("a", decision("p-a", "d-1"), now=2.0)  # a is now the most recent
    t.record("c", decision("p-b", "d-0"), now=3.0)  # over 2: b, the least recently used, goes
    assert (t.get("a", 3.0), t.get("b", 3.0), len(t)) == (SessionHint("p-a", "d-1"), None, 2)
    assert t.get("a", 11.9) == SessionHint("p-a", "d-1") and len(t) == 2
    assert t.get("a", 12.0) is None and len(t) == 1  # idle 10 s
    assert t.get("c", 13.0) is None and len(t) == 0


def test_local_prefill_keeps_the_prefill_hint():
    t = SessionTable(max_sessions=8, ttl_s=60.0)
    t.record("s", decision("p-a", "d-0"), now=0.0)
    t.record("s", decision(None, "d-1"), now=1.0)  # computed on d-1: p-a still holds the older turns
    assert t.get("s", 1.0) == SessionHint("p-a", "d-1")
    t.record("new", decision(None, "d-0"), now=1.0)
    assert t.get("new", 1.0) == SessionHint(None, "d-0")


def test_router_remembers_where_a_session_went():
    now = [0.0]
    router = Router(RoutingPolicy(PolicyConfig(block_size=BS, local_prefill_threshold=0, session_ttl_s=30.0),
                                  random.Random(0)), clock=lambda: now[0])
    for rid, pool in (("p-a", "prefill"), ("p-b", "prefill"), ("d-0", "decode"), ("d-1", "decode")):
        router.report_load(load(rid, pool))
    first = router.route(hashes(PROMPT), len(PROMPT), session="t/s1")
    for rid, pool in (("p-a", "prefill"), ("p-b", "prefill"), ("d-0", "decode"), ("d-1", "decode")):
        router.report_load(load(rid, pool))  # back to idle: without the session, a random tie
    for _ in range(5):
        d = router.route(hashes(PROMPT), len(PROMPT), session="t/s1")
        assert (d.prefill, d.decode) == (first.prefill, first.decode)
        for rid in (d.prefill, d.decode):
            router.report_load(load(rid, "prefill" if rid.startswith("p") else "decode"))
    assert router.stats().sessions == 1
    router.route(hashes(PROMPT), len(PROMPT))  # no session: nothing remembered
    assert router.stats().sessions == 1
    router.configure(PolicyConfig(block_size=BS, local_prefill_threshold=0, session_ttl_s=30.0))
    assert router.stats().sessions == 1  # same bounds: the table stays
    router.configure(PolicyConfig(block_size=BS, max_sessions=10))
    assert router.stats().sessions == 0  # new bounds: a new table


def idle_router(now, **cfg) -> Router:
    config = PolicyConfig(**{"block_size": BS, "local_prefill_threshold": 0, **cfg})
    router = Router(RoutingPolicy(config, random.Random(0)), clock=lambda: now[0])
    for rid, pool in (("p-a", "prefill"), ("p-b", "prefill"), ("d-0", "decode"), ("d-1", "decode")):
        router.report_load(load(rid, pool))
    return router


def test_a_restarted_router_adopts_the_session_the_ingress_carries():
    """A router restarted by Ray starts with an empty table; the ingress's route call carries the
    replicas it last saw chosen for the session (RouteMemory.carried), and the new router keeps the
    session there (on idle pools, without the session, every pair is a random tie) and in its table."""
    now = [100.0]
    for seed in range(8):
        router = idle_router(now)
        router.policy.rng.seed(seed)
        assert router.price(hashes(PROMPT), len(PROMPT), "t/s1", None, carried=("p-b", "d-1", 4.0)) == 80.0
        assert len(router.sessions) == 0  # a price adopts nothing
        d = router.route(hashes(PROMPT), len(PROMPT), "t/s1", None, carried=("p-b", "d-1", 4.0))
        assert (d.prefill, d.decode) == ("p-b", "d-1")
        assert "session kept on p-b" in d.reason and "session kept on d-1" in d.reason
        assert router.sessions.peek("t/s1", now[0]) == SessionHint("p-b", "d-1") and router.stats().sessions == 1
    # its own entry wins over what an ingress carries (another ingress saw an older turn)
    d = router.route(hashes(PROMPT), len(PROMPT), "t/s1", None, carried=("p-a", "d-0", 1.0))
    assert (d.prefill, d.decode) == ("p-b", "d-1")


def test_only_live_replicas_and_a_session_within_its_ttl_are_adopted():
    now = [100.0]
    router = idle_router(now, session_ttl_s=30.0)
    d = router.route(hashes(PROMPT), len(PROMPT), "t/gone", None, carried=("p-z", "d-1", 1.0))  # p-z left
    assert "session kept on d-1" in d.reason and "p-z" not in d.reason
    assert router.sessions.peek("t/gone", now[0]) == SessionHint(d.prefill, "d-1")
    d = router.route(hashes(PROMPT), len(PROMPT), "t/role", None, carried=("d-0", "p-a", 1.0))  # roles swapped: neither
    assert "session" not in d.reason
    router.route(hashes(PROMPT), len(PROMPT), "t/old", None, carried=("p-b", "d-1", 30.0))  # as old as the ttl
    assert "session" not in router.recent_decisions()[-1][0].reason
    router.route(hashes(PROMPT), len(PROMPT), None, None, carried=("p-b", "d-1", 1.0))  # no session: nothing kept
    assert router.stats().sessions == 3  # gone, role, old: recorded from their own decisions


def test_a_local_turn_after_adoption_keeps_the_adopted_prefill():
    now = [0.0]
    router = idle_router(now, local_prefill_threshold=1000)  # every turn local
    d = router.route(hashes(PROMPT), len(PROMPT), "t/s", None, carried=("p-b", "d-0", 2.0))
    assert (d.mode, d.decode) == ("local", "d-0")
    assert router.sessions.peek("t/s", 0.0) == SessionHint("p-b", "d-0")
