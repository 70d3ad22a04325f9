"""The run-time planner's guards (issue 52, item 5): a flip is not undone within the hysteresis
window, every move has a timeout, and the planner's health fails when its ticks stall. Plain
asyncio with an injected clock; the router's own state (router.router.Router) gives the loads."""

from __future__ import annotations

import asyncio

import pytest

from cluster.config import AppConfig
from cluster.planner.config import SLO
from cluster.planner.runtime import SplitOptions, SplitPolicy
from cluster.planner.runtime_actor import LOADS_TIMEOUT_S, STALL_SLACK_S, RuntimePlanner
from router.policy import ReplicaLoad

SLO_ = SLO(ttft_s=1.0, tpot_s=0.1)
OPTS = SplitOptions(interval_s=1.0, patience=1, cooldown_s=10.0, hysteresis_s=100.0)


def prefill(rid, queued=0, rate=1000.0, running=0):
    return ReplicaLoad(rid, "prefill", 1000, 1000, running=running, queued_prefill_tokens=queued, tokens_per_s=rate)


def decode(rid, used=0, running=1):
    return ReplicaLoad(rid, "decode", 1000 - used, 1000, running=running)


DECODE_FULL = [prefill("p0", running=1), prefill("p1"), decode("d0", used=950)]  # decode KV over, prefill idle
PREFILL_FULL = [prefill("p0", queued=3000), decode("d0"), decode("d1")]  # prefill queue at 6x, decode idle


def test_a_flip_is_not_undone_within_the_hysteresis_window():
    policy = SplitPolicy(SLO_, OPTS)
    assert (policy.decide(DECODE_FULL, 0.0).action, policy._last_to) == ("flip", "decode")
    held = policy.decide(PREFILL_FULL, 20.0)  # past the cooldown, the load swung the other way
    assert (held.action, held.reason) == ("hold", "would undo the move to decode 20 s ago (hysteresis 100 s)")
    assert policy.decide(DECODE_FULL, 30.0).action == "flip"  # the same way again: the cooldown only
    assert policy.decide(PREFILL_FULL, 129.0).action == "hold"  # 99 s after the last move
    back = policy.decide(PREFILL_FULL, 130.0)
    assert (back.action, back.to, back.replica_id) == ("flip", "prefill", "d0")


def test_a_move_that_did_not_happen_leaves_nothing_to_undo():
    policy = SplitPolicy(SLO_, OPTS)
    assert policy.decide(DECODE_FULL, 0.0).action == "flip"
    policy.not_moved()  # called off: the split is as it was
    d = policy.decide(PREFILL_FULL, 20.0)
    assert (d.action, d.to) == ("flip", "prefill")


def run_planner(move, clock, loads=DECODE_FULL, **kw):
    async def read():
        return list(loads)

    return RuntimePlanner(SLO_, OPTS, [""], read, move, drain_timeout_s=0.05, clock=lambda: clock[0], **kw)


def test_every_move_has_a_timeout_and_one_that_times_out_is_recorded_and_not_counted():
    clock = [0.0]
    called = []

    async def never(group, deployment, replica_id, to, timeout_s):
        called.append((deployment, replica_id, to, timeout_s))
        await asyncio.Event().wait()  # a replica (or Serve's router) that never answers

    planner = run_planner(never, clock, move_timeout_s=0.1)
    [d] = asyncio.run(asyncio.wait_for(planner.tick(), 5.0))  # before: awaited for ever
    assert (d.action, called) == ("flip", [("prefill", "p1", "decode", 0.05)])
    assert planner.history[-1].outcome == "timed out: no answer from p1 within move_timeout_s 0.1"
    assert planner.policies[""]._last_to is None  # no move happened: nothing for the hysteresis to hold
    assert run_planner(never, clock).move_timeout_s == pytest.approx(30.05)  # default: drain + 30 s


def test_the_planners_health_fails_when_its_ticks_stall():
    clock = [0.0]

    async def read():
        await asyncio.Event().wait()  # the router never answers

    async def move(*a):
        raise AssertionError("no move without loads")

    planner = RuntimePlanner(SLO_, OPTS, [""], read, move, drain_timeout_s=60.0, clock=lambda: clock[0])
    limit = OPTS.interval_s + LOADS_TIMEOUT_S + 90.0 + STALL_SLACK_S
    assert planner.stalled() is None

    async def stuck():
        task = asyncio.ensure_future(planner.tick())
        await asyncio.sleep(0)
        clock[0] += limit  # at the limit: not yet
        assert planner.stalled() is None
        clock[0] += 1.0
        assert planner.stalled() == f"no planner tick has ended for {limit + 1:.0f} s (limit {limit:g} s)"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(stuck())
    assert planner.stalled() is None  # the tick ended (cancelled): the clock starts again


def test_the_config_carries_the_hysteresis_and_the_move_timeout():
    planner = AppConfig.model_validate({"planner": {"hysteresis_s": 45, "move_timeout_s": 90}}).planner
    assert (planner.hysteresis_s, planner.move_timeout_s) == (45.0, 90.0)
    assert AppConfig().planner.hysteresis_s == 300.0 and AppConfig().planner.move_timeout_s is None
    with pytest.raises(ValueError, match="planner.move_timeout_s 30 must exceed planner.drain_timeout_s 60"):
        AppConfig.model_validate({"planner": {"move_timeout_s": 30}})
