"""The one load model (router/load_model.py): its answers on the cases that each broke one of the
four controllers that used to predict for themselves, and a check that the router's policy, the
ingress's first-token queue, the run-time planner and the autoscaling signals all answer from it."""

from __future__ import annotations

import math

import pytest

from cluster.config import AutoscalingOptions
from cluster.engine.outputs import EngineLoad
from cluster.planner.config import SLO
from cluster.planner.runtime import SplitOptions, SplitPolicy, prefill_pressure
from cluster.serving.autoscaling import ReplicaMetrics, ScalingState, decide
from router import load_model
from router.index import PrefixIndex
from router.ingress.gateway.queue_model import MIN_SAMPLE_S, FirstTokenQueue
from router.policy import PolicyConfig, ReplicaLoad, RoutingPolicy

SLO_ = SLO(ttft_s=1.0, tpot_s=0.1)
OPTS = SplitOptions(interval_s=1.0, patience=1, cooldown_s=0.0)
PROMPT = list(range(80))


class Clock:
    def __init__(self):
        self.t = 50.0

    def __call__(self):
        return self.t


def replica(rid, role="prefill", queued=0, running_prompt=0, rate=0.0, running=0, busy=None, deployment=None):
    return ReplicaLoad(rid, role, 1000, 1000, running=running, queued_prefill_tokens=queued, tokens_per_s=rate,
                       running_prompt_tokens=running_prompt, busy_fraction=busy, deployment=deployment)


def route(loads):
    return RoutingPolicy(PolicyConfig(local_prefill_threshold=0)).route([], len(PROMPT), PrefixIndex(), loads)


# ---- the regression cases -----------------------------------------------------------------------


def test_a_fresh_processes_first_slow_answer_is_not_its_rate():
    """A fresh ingress's first answer timed its own warm-up: 2 tokens in 3 s (0.67/s) where the
    pools ran 533 tokens/s. Taken alone it predicted 48 s for 16 two-token requests; with two warm
    samples the rate starts at the larger, and one later stall moves it by alpha only."""
    meter = load_model.RateMeter(alpha=0.3, warm=2)
    meter.add(2 / 3.0)
    assert (meter.value, meter.estimate()) == (None, None)  # one sample: no rate, no refusal
    assert load_model.queue_wait_s(32, meter.estimate()) is None
    meter.add(533.0)
    assert meter.value == 533.0 and meter.estimate() == load_model.Estimate(533.0, 2)
    assert load_model.queue_wait_s(32, meter.estimate()) == pytest.approx(32 / 533.0)  # 0.06 s, not 48 s
    meter.add(2 / 3.0)
    assert meter.value == pytest.approx(0.7 * 533.0 + 0.3 * 2 / 3.0)
    assert meter.estimate().spread() == pytest.approx(1 / math.sqrt(3))
    meter.reset()
    assert (meter.value, meter.samples) == (None, 0)


def test_two_token_prompts_whose_cost_is_per_request():
    """Requests of 2 prompt tokens that take 20 ms each whatever their length: measured over whole
    requests the rate is 100 tokens/s, so 24 ahead wait 0.48 s and one request's floor is 20 ms."""
    assert load_model.queue_wait_s(24 * 2, 100.0) == pytest.approx(0.48)
    assert load_model.queue_wait_s(24 * 2, 100.0, n=2) == pytest.approx(0.50)  # with its own
    assert load_model.request_floor_s(2.0, 100.0) == pytest.approx(0.02)
    assert load_model.request_floor_s(2.0, None) is None


def test_a_saturated_prefill_pool_does_not_read_a_wait_of_zero():
    """Chunked prefill runs every admitted prompt: a saturated replica has none waiting, and a wait
    from waiting prompts alone read 0. Its running prompts' uncomputed tokens count; a replica with
    no rate of its own is priced at its pool's median; a pool with work and no rate is unmeasured."""
    busy = replica("p-a", running_prompt=3000, rate=1500.0, running=3)
    assert load_model.tokens_ahead(busy) == 3000
    assert load_model.replica_queue_wait_s(busy) == pytest.approx(2.0)
    fresh = replica("p-b", queued=1000, running_prompt=500)  # no rate yet
    assert load_model.replica_rate(fresh, [busy, fresh]) == load_model.Estimate(1500.0, 0)  # a prior
    assert load_model.replica_rate(fresh, [busy, fresh]).spread() == math.inf
    assert load_model.replica_queue_wait_s(fresh, [busy, fresh]) == pytest.approx(1.0)
    assert load_model.pool_queue_wait([busy, fresh]) == (pytest.approx(4500 / 3000), 4500, 3000.0)
    assert load_model.pool_queue_wait([fresh]) == (None, 1500, 0.0)
    unmeasured = prefill_pressure([fresh, replica("p-c", running_prompt=10)], SLO_, OPTS)
    assert (unmeasured.value, unmeasured.binding, unmeasured.without_one()) == (0.0, "unmeasured", math.inf)


def test_a_flipped_replica_is_priced_at_its_new_pools_rate():
    """A decode replica flipped to prefill reports no rate (its reporter starts again,
    tests/serving/test_load_reports.py): its prompts wait at the prefill pool's median rate, not at
    0 and not at its decode throughput."""
    flipped = replica("d-1", queued=2000, deployment="decode")
    pool = [replica("p-a", rate=1000.0), replica("p-b", rate=3000.0), flipped]
    assert load_model.replica_queue_wait_s(flipped, pool) == pytest.approx(1.0)  # 2000 at the median 2000
    d = route([flipped, replica("dec", "decode")])
    assert (d.prefill, d.prefill_deployment, d.queue_wait_s) == ("d-1", "decode", 0.0)  # alone: no prior


def test_a_cpu_whose_one_stream_is_slower_than_any_absolute_target():
    """One stream at 142 ms a token against an 80 ms objective: the decode headroom is negative at
    one stream (what the objective alone would call overload), and the planner's decode pressure
    reads it; the ingress's pace bound is relative to the floor (test_relative_bounds.py)."""
    one = ReplicaLoad("d-0", "decode", 1000, 1000, running=1, step_time_s=0.142)
    assert load_model.decode_step_s([one]) == pytest.approx(0.142)
    assert load_model.decode_headroom([one], 0.08) == pytest.approx(1 - 0.142 / 0.08)
    assert load_model.decode_headroom([one], 8 * 0.142) == pytest.approx(0.875)  # 8x its own pace
    idle = ReplicaLoad("d-1", "decode", 1000, 1000, running=0, step_time_s=0.5)  # no stream: not a pace
    assert load_model.decode_step_s([idle]) == 0.0


def test_busy_fraction_and_kv_headroom():
    assert load_model.busy_fraction(replica("a", busy=0.25)) == 0.25
    assert load_model.busy_fraction(replica("b")) == 0.0  # unreported, holds nothing
    assert load_model.busy_fraction(replica("c", running_prompt=1)) == 1.0  # unreported, holds work
    assert load_model.pool_busy_fraction([replica("a", busy=0.25), replica("c", running=1)]) == 0.625
    loads = [ReplicaLoad("x", "decode", 250, 1000), ReplicaLoad("y", "decode", 750, 1000)]
    assert load_model.kv_headroom(loads) == 0.5 and load_model.kv_usage(0, 0) == 0.0
    meter = load_model.BusyMeter(tau_s=2.0)
    assert meter.update(10.0, 100.0) is None  # the first call only marks
    assert meter.update(11.0, 102.0) == 0.5  # 1 s busy of 2
    w = math.exp(-1.0)
    assert meter.update(13.0, 104.0) == pytest.approx(w * 0.5 + (1 - w) * 1.0)


# ---- one model, four readers ---------------------------------------------------------------------


def test_every_controller_answers_from_the_one_load_model(monkeypatch):
    """The router's decision, the ingress's prediction, the planner's prefill pressure and the
    autoscaler's prefill signal all move when the load model's answer does: none predicts alone."""
    saturated = replica("p-a", running_prompt=3000, rate=1500.0, running=3)
    decode = replica("d-0", "decode")
    q = FirstTokenQueue(Clock())
    q.rate = 1000.0
    pending = [q.admit(500) for _ in range(3)]
    engine_load = EngineLoad(free_blocks=10, total_blocks=100, running=2, waiting=0, importing=0, held=0,
                             queued_prefill_tokens=0, running_prompt_tokens=3000)

    def answers():
        return (route([saturated, decode]).queue_wait_s, q.predicted_wait_s(),
                prefill_pressure([saturated], SLO_, OPTS).value * OPTS.ttft_share * SLO_.ttft_s,
                ReplicaMetrics.of(engine_load, 0.0, 0.0).queued_prefill_tokens)

    assert answers() == (pytest.approx(2.0), pytest.approx(1.5), pytest.approx(2.0), 3000.0)
    monkeypatch.setattr(load_model, "queue_wait_s", lambda tokens, rate, n=0: 42.0)
    monkeypatch.setattr(load_model, "tokens_ahead", lambda r: 7)
    assert answers() == (42.0, 42.0, pytest.approx(42.0), 7.0)
    for p in pending:
        p.done()


def test_the_autoscaler_scales_a_saturated_prefill_replica_with_none_waiting():
    """Before: queued_prefill_tokens counted waiting prompts only, so a replica running 3000
    uncomputed prompt tokens read 0 and the pool held at one replica."""
    opts = AutoscalingOptions(min_replicas=1, max_replicas=4, target_queued_prefill_tokens=1000, upscale_delay_s=0)
    saturated = EngineLoad(free_blocks=10, total_blocks=100, running=3, waiting=0, importing=0, held=0,
                           queued_prefill_tokens=0, running_prompt_tokens=3000)
    m = ReplicaMetrics.of(saturated, ttft_s=0.0, itl_s=0.0)
    assert (m.kv_usage, m.queued_prefill_tokens) == (pytest.approx(0.9), 3000.0)
    assert decide("prefill", [m], 1, 0.0, ScalingState(), opts).replicas == 3


def test_the_queue_meter_is_the_load_models():
    """The ingress's rate is a load_model.RateMeter fed its samples: the same samples give the same rate."""
    clock = Clock()
    q = FirstTokenQueue(clock, alpha=0.3)
    meter = load_model.RateMeter(alpha=0.3, warm=2)
    for tokens in (2, 300, 500):
        p = q.admit(tokens)
        clock.t += MIN_SAMPLE_S
        p.done(tokens)
        meter.add(tokens / MIN_SAMPLE_S)
    assert isinstance(q.meter, load_model.RateMeter) and q.rate == meter.value == pytest.approx(
        0.7 * 600.0 + 0.3 * 1000.0)
    ahead = q.admit(100)
    assert ahead.predicted_s == pytest.approx(100 / meter.value)
    ahead.done()


def test_the_planners_donor_is_the_least_busy_replica():
    """Two prefill replicas with no queue: the one busy 90% of the time is not the one to move;
    and a pool busy all the time with no queue is not one that can spare a replica."""
    policy = SplitPolicy(SLO_, OPTS)
    full_decode = ReplicaLoad("d-0", "decode", 50, 1000, running=10)  # KV 95%: over 0.9
    loads = [replica("p-a", busy=0.05, running=1), replica("p-b", busy=0.0, running=0), full_decode]
    assert policy.decide(loads, 0.0).replica_id == "p-b"  # fewest requests and least busy agree
    loads = [replica("p-a", busy=0.02, running=1), replica("p-b", busy=0.25, running=0), full_decode]
    d = SplitPolicy(SLO_, OPTS).decide(loads, 0.0)
    assert (d.action, d.replica_id) == ("flip", "p-a")  # least busy, though it holds a request
    assert d.reason == "decode KV at 1.06x; the prefill pool one smaller would be at 0.27x"
    saturated = [replica("p-a", busy=0.9), replica("p-b", busy=0.8), full_decode]  # no queue, always busy
    d = SplitPolicy(SLO_, OPTS).decide(saturated, 0.0)
    assert (d.action, d.reason) == ("hold", "the other pool cannot spare a replica")
