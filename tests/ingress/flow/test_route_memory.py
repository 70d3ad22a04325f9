"""The ingress's memory of its router's decisions (issue 50, item 4: while a router restarts, a
prefix goes where it went last, not wherever Serve picks)."""

import pytest

from router.ingress.flow.route_memory import RouteMemory
from router.ingress.gateway.telemetry import route_reason
from router.policy import RouteDecision


def decision(prefill: str, decode: str = "d0", wait: float = 0.7, ahead: int = 3) -> RouteDecision:
    return RouteDecision(prefill, decode, "remote", 64, "cache", queue_wait_s=wait, queue_ahead=ahead,
                         prefill_deployment="prefill")


def test_a_prefix_recalls_the_replicas_last_chosen_for_its_first_block_never_their_stale_queue():
    m = RouteMemory()
    m.remember([b"sys-a", b"x1"], None, decision("p0"), 0.0)
    m.remember([b"sys-b", b"y1"], None, decision("p1"), 0.0)
    m.remember([b"sys-a", b"x2", b"x3"], None, decision("p2", "d1"), 0.0)  # the latest decision for the prefix wins
    got = m.recall([b"sys-a", b"z"], None)
    assert (got.prefill, got.decode, got.mode, got.prefill_deployment) == ("p2", "d1", "remote", "prefill")
    # a choice, not a prediction: admission reads no queue from it; the metric labels it
    assert (got.queue_wait_s, got.queue_ahead, got.reason) == (0.0, 0, "remembered (cache)")
    assert route_reason(got) == "remembered"
    assert m.recall([b"sys-b"], None).prefill == "p1"
    assert m.recall([b"sys-c"], None) is None and m.recall([], None) is None  # never seen; shorter than a block


def test_a_session_recalls_its_own_replicas_before_its_first_block():
    m = RouteMemory()
    m.remember([b"sys-a"], "alice", decision("p0", "d0"), 0.0)
    m.remember([b"sys-a"], None, decision("p1", "d1"), 0.0)  # another client's request on the same prefix
    assert (m.recall([b"sys-a"], "alice").decode, m.recall([b"sys-a"], None).decode) == ("d0", "d1")
    assert m.recall([b"other"], "alice").decode == "d0"  # the session, whatever its prompt begins with
    assert m.recall([b"sys-a"], "bob").decode == "d1"  # an unknown session: its prefix


def test_the_memory_is_bounded_least_recently_used_out():
    m = RouteMemory(capacity=3)
    for i in range(3):
        m.remember([bytes([i])], None, decision(f"p{i}"), 0.0)
    assert m.recall([bytes([0])], None).prefill == "p0"  # used: now the most recent
    m.remember([b"new"], None, decision("p9"), 0.0)
    assert len(m) == 3
    assert [m.recall([bytes([i])], None) is not None for i in range(3)] == [True, False, True]
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        RouteMemory(capacity=0)


def test_a_session_carries_its_last_replicas_and_their_age_to_the_router():
    """What every route call of a session carries, for a restarted router to adopt (its table is
    empty): the replicas last chosen for the session, the prefill kept over a local turn as the
    router's own table keeps it, and seconds since; nothing for a session never routed here."""
    m = RouteMemory()
    assert (m.carried("alice", 5.0), m.carried(None, 5.0)) == (None, None)
    m.remember([b"sys-a"], "alice", decision("p0", "d0"), 10.0)
    assert m.carried("alice", 12.5) == ("p0", "d0", 2.5)
    m.remember([b"sys-a"], "alice", RouteDecision(None, "d1", "local", 64, "local prefill: 16 uncached tokens"), 20.0)
    assert m.carried("alice", 21.0) == ("p0", "d1", 1.0)  # computed on d1: p0 still holds the older turns
    m.remember([b"sys-b"], "bob", RouteDecision(None, "d1", "local", 0, "local prefill"), 20.0)
    assert m.carried("bob", 20.0) == (None, "d1", 0.0)
    for i in range(RouteMemory().capacity):  # first blocks never push a session out: each kind has its own bound
        m.remember([bytes([i % 256, i // 256])], None, decision("p9"), 30.0)
    assert m.carried("alice", 30.0) == ("p0", "d1", 10.0)
