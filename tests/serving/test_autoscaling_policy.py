"""The pool autoscaling policy (cluster/serving/autoscaling.py) decides exactly, for crafted metrics and
times: sustained pressure scales up at once to what is needed, the hysteresis band holds, slack
scales down one step per delay, bounds clamp. Then Serve's own wrapper around the policy (the one
its controller applies) and the replica-side latency windows. No Ray cluster."""

import pytest

from cluster.config import AutoscalingOptions
from cluster.serving.autoscaling import ReplicaMetrics, ScalingState, decide, pool_load
from cluster.engine.latency import FirstOutputTimer, TokenIntervals

OPTS = AutoscalingOptions(min_replicas=1, max_replicas=4, target_kv_usage=0.8, target_itl_s=0.05,
                          target_queued_prefill_tokens=1000, target_ttft_s=1.0, upscale_delay_s=5,
                          downscale_delay_s=60, downscale_threshold=0.6)


def kv(*usages, itl=0.01):
    return [ReplicaMetrics(kv_usage=u, itl_s=itl) for u in usages]


def run(pool, steps, replicas, opts=OPTS):
    """Feed (time, metrics) in order, carrying the state and applying each decision; returns the
    replica counts after each step."""
    state, counts = ScalingState(), []
    for now, metrics in steps:
        d = decide(pool, metrics, replicas, now, state, opts)
        state, replicas = d.state, d.replicas
        counts.append(replicas)
    return counts


def test_sustained_pressure_scales_up_after_the_delay():
    # 0.96 KV use on one replica = 1.2 replicas' worth at the 0.8 target: 2 are needed
    d0 = decide("decode", kv(0.96), 1, 100.0, ScalingState(), OPTS)
    assert (d0.replicas, d0.state) == (1, ScalingState(pressure_since=100.0))
    assert d0.reason == "kv_usage 0.96 per replica (1.20 replicas' worth): waiting to scale up"
    d1 = decide("decode", kv(0.96), 1, 104.9, d0.state, OPTS)
    assert (d1.replicas, d1.state) == (1, ScalingState(pressure_since=100.0))
    d2 = decide("decode", kv(0.96), 1, 105.0, d1.state, OPTS)
    assert (d2.replicas, d2.state) == (2, ScalingState())
    assert d2.reason == "kv_usage 0.96 per replica (1.20 replicas' worth) for 5.0s: 1 -> 2"


def test_pressure_that_lapses_restarts_the_delay():
    steps = [(0, kv(0.96)), (3, kv(0.70)), (6, kv(0.96)), (10, kv(0.96)), (11, kv(0.96))]
    assert run("decode", steps, 1) == [1, 1, 1, 1, 2]


def test_scale_up_goes_straight_to_what_is_needed_and_stops_at_the_maximum():
    # 2 replicas at 1.0 KV use = 2.5 replicas' worth -> 3 in one step, not 3 then 4 by ones
    assert run("decode", [(0, kv(1.0, 1.0)), (5, kv(1.0, 1.0))], 2) == [2, 3]
    # 8 replicas' worth of inter-token latency (0.2 s vs 0.05 s on two replicas) -> the maximum, 4
    assert run("decode", [(0, kv(0.1, 0.1, itl=0.2)), (5, kv(0.1, 0.1, itl=0.2))], 2) == [2, 4]
    at_max = decide("decode", kv(1, 1, 1, 1), 4, 0.0, ScalingState(pressure_since=-100.0), OPTS)
    assert (at_max.replicas, at_max.state, at_max.reason) == (
        4, ScalingState(), "kv_usage 1 per replica (5.00 replicas' worth): at the maximum")


def test_load_exactly_at_the_target_holds():
    assert run("decode", [(0, kv(0.8, 0.8)), (1000, kv(0.8, 0.8))], 2) == [2, 2]


def test_hysteresis_band_holds_between_target_and_threshold():
    # 2 replicas at 0.44: 1.1 replicas' worth. More than 2 needed? no (ceil = 2). Slack? one
    # replica would carry 1.1 > 0.6 of its target: no. So 2 stays, however long.
    d = decide("decode", kv(0.44, 0.44), 2, 0.0, ScalingState(), OPTS)
    assert (d.replicas, d.state) == (2, ScalingState())
    assert d.reason == "kv_usage 0.44 per replica (1.10 replicas' worth): within the band"
    assert run("decode", [(t, kv(0.44, 0.44)) for t in (0, 100, 1000, 10_000)], 2) == [2, 2, 2, 2]


def test_slack_scales_down_one_step_per_delay():
    idle = kv(0, 0, 0, 0, itl=0.0)
    times = [0, 59.9, 60, 60.1, 119.9, 120.1, 180.1, 240.1, 10_000]
    assert run("decode", [(t, idle) for t in times], 4) == [4, 4, 3, 3, 3, 2, 1, 1, 1]


def test_slack_that_lapses_restarts_the_delay():
    steps = [(0, kv(0.2, 0.2)), (30, kv(0.5, 0.5)), (40, kv(0.2, 0.2)), (99, kv(0.2, 0.2)), (100, kv(0.2, 0.2))]
    assert run("decode", steps, 2) == [2, 2, 2, 2, 1]


def test_a_bigger_step_never_drops_below_what_keeps_the_rest_under_the_threshold():
    opts = OPTS.model_copy(update={"downscale_step": 3})
    # 4 replicas at 0.3 = 1.5 replicas' worth; below 0.6 on every replica needs 3 (1.5/3 = 0.5)
    d = decide("decode", kv(0.3, 0.3, 0.3, 0.3), 4, 60.0, ScalingState(slack_since=0.0), opts)
    assert (d.replicas, d.state) == (3, ScalingState(slack_since=60.0))
    # idle: the whole step (4 - 3 = 1), which is also the minimum
    assert decide("decode", kv(0, 0, 0, 0, itl=0), 4, 60.0, ScalingState(slack_since=0.0), opts).replicas == 1


def test_bounds_clamp_at_once():
    below = decide("decode", [], 0, 0.0, ScalingState(pressure_since=1.0), OPTS)
    assert (below.replicas, below.state, below.reason) == (1, ScalingState(), "0 replicas is below the minimum: 0 -> 1")
    above = decide("decode", kv(1.0), 6, 0.0, ScalingState(), OPTS)
    assert (above.replicas, above.reason) == (4, "6 replicas is above the maximum: 6 -> 4")
    # Serve's capacity-adjusted bounds override the options'
    narrowed = decide("decode", kv(1, 1), 2, 5.0, ScalingState(pressure_since=0.0), OPTS, 1, 2)
    assert (narrowed.replicas, narrowed.reason.endswith("at the maximum")) == (2, True)
    assert decide("decode", kv(0, 0), 3, 0.0, ScalingState(), OPTS, 1, 2).replicas == 2


def test_no_report_yet_holds_and_starting_replicas_do_not_count():
    d = decide("decode", [], 2, 50.0, ScalingState(pressure_since=0.0), OPTS)
    assert (d.replicas, d.state, d.reason) == (2, ScalingState(), "no replica has reported yet")
    # target 2, one replica reporting 1.2 replicas' worth (the other is starting): 2 is enough
    assert run("decode", [(0, kv(0.96)), (10, kv(0.96))], 2) == [2, 2]


def test_each_pool_reads_only_its_own_signals():
    prefill = [ReplicaMetrics(queued_prefill_tokens=1500, ttft_s=0.5, kv_usage=1.0, itl_s=9.0),
               ReplicaMetrics(queued_prefill_tokens=900, ttft_s=0.7, kv_usage=1.0, itl_s=9.0)]
    p = pool_load("prefill", prefill, OPTS)
    assert (p.signal, round(p.load, 6), round(p.mean, 6)) == ("queued_prefill_tokens", 2.4, 1200)
    assert run("prefill", [(0, prefill), (5, prefill)], 2) == [2, 3]
    slow_first_token = pool_load("prefill", [ReplicaMetrics(ttft_s=3.0, kv_usage=1.0)], OPTS)
    assert (slow_first_token.signal, slow_first_token.load) == ("ttft_s", 3.0)
    # a decode replica with a long prompt queue but idle KV and fast steps has no pressure
    busy_queue = [ReplicaMetrics(queued_prefill_tokens=50_000, ttft_s=9.0, kv_usage=0.1, itl_s=0.01)]
    assert run("decode", [(0, busy_queue), (100, busy_queue)], 1) == [1, 1]


def test_state_round_trips_through_serves_policy_state_and_ignores_its_keys():
    state = ScalingState(pressure_since=12.5)
    serve_state = {**state.as_dict(), "__decision_counters": 3, "__decision_timestamp": 1.0}
    assert ScalingState.from_dict(serve_state) == state
    assert ScalingState.from_dict({}) == ScalingState()


def test_options_reject_inconsistent_knobs():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match=r"max_replicas \(1\) must be >= min_replicas \(2\)"):
        AutoscalingOptions(min_replicas=2, max_replicas=1)
    with pytest.raises(pydantic.ValidationError, match="look_back_period_s must be longer than metrics_interval_s"):
        AutoscalingOptions(look_back_period_s=1.0, metrics_interval_s=1.0)
    with pytest.raises(pydantic.ValidationError, match="min_replicas"):
        AutoscalingOptions(min_replicas=-1)


SLEEPY = OPTS.model_copy(update={"min_replicas": 0, "idle_timeout_s": 30})


def test_a_pool_that_may_sleep_sleeps_after_its_idle_timeout_and_wakes_on_a_request():
    idle = [ReplicaMetrics()]
    d = decide("decode", idle, 1, 100.0, ScalingState(), SLEEPY, requests=0)
    assert (d.replicas, d.state) == (1, ScalingState(idle_since=100.0))
    d = decide("decode", idle, 1, 120.0, d.state, SLEEPY, requests=2)  # a request: the idle clock restarts
    assert (d.replicas, d.state) == (1, ScalingState())
    d = decide("decode", idle, 1, 121.0, d.state, SLEEPY, requests=0)
    d = decide("decode", idle, 1, 150.9, d.state, SLEEPY, requests=0)
    assert (d.replicas, d.state.idle_since) == (1, 121.0)
    d = decide("decode", idle, 1, 151.0, d.state, SLEEPY, requests=0)
    assert (d.replicas, d.reason) == (0, "no request for 30.0s: 1 -> 0 (asleep)")
    assert decide("decode", [], 0, 160.0, d.state, SLEEPY, requests=0).replicas == 0
    woke = decide("decode", [], 0, 170.0, d.state, SLEEPY, requests=1)
    assert (woke.replicas, woke.reason) == (1, "1 requests wait: waking, 0 -> 1")
    # load alone never takes it to zero, and a pool with min_replicas 1 never sleeps
    assert decide("decode", idle * 2, 2, 400.0, ScalingState(slack_since=300.0), SLEEPY, requests=3).replicas == 1
    assert decide("decode", idle, 1, 1e6, ScalingState(), OPTS, requests=0).replicas == 1


# ---- Serve's side: the wrapper its controller puts around a custom policy ----------------------

def serve_context(policy_state, target, metrics_by_replica, now):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from cluster.serving.autoscaling_policy import serve_autoscaling_config

    dep = DeploymentID(name="decode", app_name="pdserve")
    ids = [ReplicaID(unique_id=name, deployment_id=dep) for name in metrics_by_replica]
    aggregated: dict = {}
    for rid, metrics in zip(ids, metrics_by_replica.values()):
        for name, value in (metrics.as_dict() if metrics else {}).items():
            aggregated.setdefault(name, {})[rid] = value
    config = AutoscalingConfig(**serve_autoscaling_config("decode", OPTS))
    return config, AutoscalingContext(
        deployment_id=dep, deployment_name="decode", app_name="pdserve", current_num_replicas=len(ids),
        target_num_replicas=target, running_replicas=ids, total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=aggregated, raw_metrics={}, capacity_adjusted_min_replicas=OPTS.min_replicas,
        capacity_adjusted_max_replicas=OPTS.max_replicas, policy_state=policy_state, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now, config=config)


def test_serves_wrapper_adds_no_delay_of_its_own_to_the_policys_decisions():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    config, _ = serve_context({}, 1, {}, 0.0)
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))  # as the controller does
    state, decisions = {}, []
    for now in (0.0, 4.0, 5.0):  # 0.96 KV use on one replica: 2 needed, after 5 s of it
        _, ctx = serve_context(state, 1, {"a": ReplicaMetrics(kv_usage=0.96)}, now)
        replicas, state = policy(ctx)
        decisions.append(replicas)
    # then idle; "b" runs but has not reported yet at t=6; down after 60 s of slack
    for now, b in [(6.0, None), (65.9, ReplicaMetrics()), (66.0, ReplicaMetrics())]:
        _, ctx = serve_context(state, 2, {"a": ReplicaMetrics(), "b": b}, now)
        replicas, state = policy(ctx)
        decisions.append(replicas)
    assert decisions == [1, 1, 2, 2, 2, 1]


# ---- replica side: the latency windows ------------------------------------------------------

def test_first_output_timer_reports_the_mean_or_the_oldest_wait():
    t = FirstOutputTimer()
    t.start("a", 0.0)
    t.start("b", 1.0)
    t.output("a", 2.0)  # a: 2.0 s
    t.output("a", 2.5)  # a's later outputs are not first outputs
    assert t.drain(2.5) == 2.0  # mean 2.0 beats b's 1.5 s wait
    assert t.drain(6.0) == 5.0  # nothing finished; b has waited 5 s
    t.forget("b")
    assert t.drain(7.0) == 0.0


def test_token_intervals_count_only_consecutive_token_steps():
    t = TokenIntervals()
    t.after_step(1, 0.00)  # first token step: nothing to measure yet
    t.after_step(3, 0.05)  # 0.05
    t.after_step(3, 0.20)  # no tokens (waiting on a pull): the chain breaks
    t.after_step(5, 0.30)
    t.after_step(7, 0.34)  # 0.04
    assert t.drain() == pytest.approx(0.045)
    t.idle()
    t.after_step(9, 5.0)  # after idling: not an interval
    assert t.drain() == 0.0
