"""The run-time planner's decision (cluster/planner/runtime.py) on loads built by hand, then the
simulator moving a replica between pools with it (drain first, exact blocks after)."""

from __future__ import annotations

import pytest

from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.runtime import SplitOptions, SplitPolicy, decode_pressure, prefill_pressure
from cluster.planner.simulator import Simulator
from cluster.planner.workload import RequestSpec
from tests.planner.conftest import prefill_s
from router.policy import ReplicaLoad

SLO_ = SLO(ttft_s=1.0, tpot_s=0.1)
OPTS = SplitOptions(interval_s=1.0, patience=2, cooldown_s=10.0)


def prefill(rid, queued=0, rate=1000.0, running=0):
    return ReplicaLoad(rid, "prefill", 1000, 1000, running=running, queued_prefill_tokens=queued, tokens_per_s=rate)


def decode(rid, used=0, total=1000, step=0.0, running=1):
    return ReplicaLoad(rid, "decode", total - used, total, running=running, step_time_s=step)


def test_pressures_are_measured_over_their_bounds():
    p = prefill_pressure([prefill("p0", queued=600), prefill("p1", queued=400)], SLO_, OPTS)
    assert (p.value, p.binding) == (pytest.approx(1000 / 2000 / 0.5), "prefill queue")  # 0.5 s of a 0.5 s bound
    assert p.without_one() == pytest.approx(2.0)
    d = decode_pressure([decode("d0", used=450, step=0.02), decode("d1", used=450, step=0.04)], SLO_, OPTS)
    assert (d.value, d.binding) == (pytest.approx(0.45 / 0.9), "decode KV")  # KV 45% of 90%; steps 0.3 of TPOT
    d = decode_pressure([decode("d0", used=100, step=0.12), decode("d1", used=100, step=0.14)], SLO_, OPTS)
    assert (d.value, d.binding) == (pytest.approx(1.3), "decode step time")
    assert prefill_pressure([prefill("p0", queued=500, rate=0.0)], SLO_, OPTS).value == 0.0  # no pace yet: no evidence


def test_a_replica_moves_after_patience_and_not_again_within_the_cooldown():
    policy = SplitPolicy(SLO_, OPTS)
    # decode KV at 1.02x its bound (91.8% of 90%); the prefill pool idle: one replica can go
    loads = [prefill("p0", running=1), prefill("p1"), decode("d0", used=918)]
    first = policy.decide(loads, now=0.0)
    assert (first.action, first.reason) == ("hold", "decode KV over for 1 of 2 decisions")
    second = policy.decide(loads, now=1.0)
    assert (second.action, second.replica_id, second.to) == ("flip", "p1", "decode")  # the idle one
    assert second.reason == "decode KV at 1.02x; the prefill pool one smaller would be at 0.00x"
    assert second.log_line().startswith("planner: flip p1 to decode: decode KV at 1.02x")
    for t in (2.0, 3.0):
        assert policy.decide(loads, now=t).reason.startswith(("decode KV over", "cooling down"))
    assert policy.decide(loads, now=11.0).action == "flip"


def test_nothing_moves_when_the_other_pool_cannot_spare_one_or_both_are_over():
    policy = SplitPolicy(SLO_, OPTS)
    busy_prefill = [prefill("p0", queued=200), prefill("p1", queued=200)]  # 0.4 each... 0.8 one smaller
    d_over = [decode("d0", used=950)]
    for t in range(4):
        d = policy.decide(busy_prefill + d_over, now=float(t))
        assert (d.action, d.reason) == ("hold", "the other pool cannot spare a replica")
    jammed = [prefill("p0", queued=2000), prefill("p1", queued=2000)]
    d = policy.decide(jammed + d_over, now=5.0)
    assert (d.action, d.reason) == ("scale", "prefill queue and decode KV both at or over 1x")
    lone = [prefill("p0"), decode("d0", used=950)]  # a pool never goes below one replica
    assert {policy.decide(lone, now=float(t)).action for t in range(6, 10)} == {"hold"}


def test_a_streak_is_broken_by_a_calm_decision():
    policy = SplitPolicy(SLO_, OPTS)
    over = [prefill("p0"), prefill("p1"), decode("d0", used=950)]
    calm = [prefill("p0"), prefill("p1"), decode("d0", used=100)]
    assert [policy.decide(x, now=float(t)).action for t, x in enumerate([over, calm, over, over])] == [
        "hold", "hold", "hold", "flip"]


def test_the_simulator_drains_a_replica_then_moves_it_and_every_pool_is_whole(profile):
    """2P+1D under decode-heavy traffic: the planner moves a prefill replica to decode; it changes
    pool once it holds nothing (its step in flight ends first), then takes decode work."""
    specs = [RequestSpec(i * 0.05, 32, 100) for i in range(300)]  # remote prefill, decode-bound
    cfg = ClusterConfig(2, 1, chunk_tokens=512, skip_prefill_tokens=0, decode_blocks=256, max_num_seqs=64)
    slo = SLO(ttft_s=5.0, tpot_s=0.05)
    sim = Simulator(profile, cfg, slo, split=SplitPolicy(slo, OPTS), flip_s=0.5)
    r = sim.run(specs)
    assert r.completed == 300
    assert [(rid, to) for _, rid, to, _ in r.flips] == [("prefill-0", "decode")]
    when, _, _, why = r.flips[0]
    assert [(t, d.action) for t, d in sim.decisions] == [(4.0, "flip")]  # decisions at 1, 2, 3 s held
    assert 0 <= when - 0.5 - 4.0 <= prefill_s(512)  # drained when its step in flight ended, moved 0.5 s later
    # (2.70x while a step mixing decodes and preempted requests' recompute was priced as two steps)
    assert why == "decode step time at 2.09x; the prefill pool one smaller would be at 0.07x"
    assert [x.replica_id for x in sim.decodes] == ["decode-0", "prefill-0"]
    assert all(x.free_blocks == x.total_blocks == 256 for x in sim.decodes)  # whole after the run
    assert all(x.assigned == 0 and not x.running and not x.waiting for x in sim.decodes + sim.prefills)
    assert sim._by_id["prefill-0"].tokens > 0  # it decoded after the move (its count restarts there)
    sim.check_invariants()


def test_a_draining_decode_replica_finishes_its_streams_before_it_moves(profile):
    """A decode replica chosen to move takes no new work, keeps its streams and those routed to
    it that are still on prefill, and moves only after the last of them ends."""
    specs = [RequestSpec(0.0, 600, 400)] + [RequestSpec(0.1 + 0.02 * i, 900, 2) for i in range(300)]
    cfg = ClusterConfig(1, 2, chunk_tokens=512, skip_prefill_tokens=0, decode_blocks=512, max_num_seqs=64)
    slo = SLO(ttft_s=1.0, tpot_s=1.0)
    sim = Simulator(profile, cfg, slo, split=SplitPolicy(slo, OPTS), flip_s=0.5)
    r = sim.run(specs)
    assert (r.completed, r.preemptions) == (301, 0)  # no request failed or restarted by the move
    assert [(t, d.action, d.replica_id, d.to) for t, d in sim.decisions] == [(2.0, "flip", "decode-0", "prefill")]
    [(when, rid, to, _)] = r.flips
    moved = sim._by_id[rid]
    mine = [q for q in sim.requests if q.decode is moved]
    assert sum(q.done_s > 2.0 for q in mine) == 51  # routed to it before the move, ended after: the drain waited
    assert max(q.done_s for q in mine) == when - 0.5  # it moved right after the last of its requests ended
    assert all(q.spec.arrival_s <= 2.0 for q in mine)  # nothing was routed to it once it drained
    sim.check_invariants()


# ---- the planner's loop on a live cluster's feed (cluster/planner/runtime_actor.py) ----------


def test_the_planner_moves_through_its_mover_keeps_history_and_leaves_draining_replicas_out():
    """RuntimePlanner over the router's own state (router.router.Router, fed the loads a replica
    reports): a decision to move calls the mover with the replica's deployment; a move called
    off past its drain timeout is recorded as such; a draining replica counts in neither pool."""
    import asyncio

    from cluster.errors import DrainTimeoutError
    from cluster.planner.runtime_actor import RuntimePlanner
    from router.router import Router

    clock = [100.0]
    router = Router(clock=lambda: clock[0])

    def report():
        for load in (prefill("p0", running=1), prefill("p1"), decode("d0", used=950)):
            router.report_load(load)

    report()
    calls, answers = [], []

    async def loads():
        return router.live_loads()

    async def move(group, deployment, replica_id, to, timeout_s):
        calls.append((group, deployment, replica_id, to, timeout_s))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    planner = RuntimePlanner(SLO_, OPTS, [""], loads, move, drain_timeout_s=7.0, clock=lambda: clock[0])
    answers += [DrainTimeoutError("p1 still held 2 leases after 7 s"),
                {"replica_id": "p1", "from": "prefill", "to": "decode", "drained_s": 0.25, "drained_requests": 0}]

    async def ticks(n):
        out = []
        for _ in range(n):
            out += await planner.tick()
            clock[0] += 1.0
        return out

    first = asyncio.run(ticks(2))
    assert [d.action for d in first] == ["hold", "flip"]
    assert calls == [("", "prefill", "p1", "decode", 7.0)]
    clock[0] += OPTS.cooldown_s  # a move called off counts for the cooldown too
    report()  # (the router forgets replicas silent for 3 s)
    asyncio.run(ticks(2))
    assert calls[1] == ("", "prefill", "p1", "decode", 7.0)
    hist = [(h.decision.action, h.outcome) for h in planner.history]
    assert hist == [("hold", ""), ("flip", "called off: p1 still held 2 leases after 7 s"),
                    ("hold", ""), ("flip", "moved in 0.25 s (0 requests drained)")]
    assert planner.history[1].as_dict()["binding"] == "decode KV"
    # p1 now reports as decode (deployment prefill) and p0 drains: the prefill pool is empty to the planner
    router.report_load(ReplicaLoad("p1", "decode", 1000, 1000, deployment="prefill"))
    router.report_load(ReplicaLoad("p0", "prefill", 1000, 1000, draining=True))
    [d] = asyncio.run(ticks(1))
    assert (d.action, d.reason, d.decode.replicas) == ("hold", "no prefill pool", 2)
