"""The ingress's first-token queue (router/ingress/gateway/capacity.py) with an injected clock: exact
pending counts through every lifecycle, the rate measured over backlogged time only, and the
predicted wait; then the flow's refusal by it (before any await) and batch work shed first."""

import asyncio
import time

import pytest

from cluster.config import AppConfig
from cluster.engine.request import Priority, RequestContext
from router.ingress.gateway.admission import Admission, Quotas
from router.ingress.gateway.capacity import MIN_SAMPLE_S, WARM_SAMPLES, FirstTokenQueue
from router.ingress.status import Rejected


class Clock:
    def __init__(self):
        self.t = 50.0

    def __call__(self):
        return self.t


def test_pending_tokens_follow_every_lifecycle_exactly():
    q = FirstTokenQueue(Clock())
    assert q.predicted_wait_s() == 0.0  # nothing ahead: no wait, measured or not
    a, b, c = q.admit(100), q.admit(50), q.admit(30)
    assert (q.pending_tokens, q.pending_requests) == (180, 3)
    assert q.predicted_wait_s() is None  # work ahead, rate unknown: no prediction, no refusal
    a.done(100)
    a.done(100)  # idempotent
    b.done()  # ended without a first token (refused downstream, cancelled)
    assert (q.pending_tokens, q.pending_requests) == (30, 1)
    c.done(0)
    assert (q.pending_tokens, q.pending_requests) == (0, 0)


def warm(q: FirstTokenQueue, clock: Clock, rate: float) -> None:
    """WARM_SAMPLES samples at `rate` (prompt tokens/s), so the queue has a rate."""
    for _ in range(WARM_SAMPLES):
        p = q.admit(int(rate * MIN_SAMPLE_S))
        clock.t += MIN_SAMPLE_S
        p.done(int(rate * MIN_SAMPLE_S))
    assert q.rate == pytest.approx(rate)


def test_rate_is_measured_over_backlogged_time_only():
    clock = Clock()
    q = FirstTokenQueue(clock, alpha=0.5)
    clock.t += 10.0  # idle time never counts: nothing was pending
    first, second = q.admit(400), q.admit(600)
    clock.t += 0.25
    first.done(400)  # 0.25 s of a 0.5 s sample: no sample yet
    clock.t += 0.25
    second.done(100)  # 1000 prompt tokens over 0.5 s backlogged (500 of them cached: the rate counts prompts)
    assert q.rate is None  # one sample: still warming up
    clock.t += 10.0
    third = q.admit(250)
    clock.t += 0.5
    third.done(250)  # a second sample, 500 tokens/s: the rate starts at the larger
    assert q.rate == pytest.approx(2000.0)
    clock.t += 30.0  # idle again
    p = [q.admit(1000) for _ in range(2)]
    assert q.predicted_wait_s() == pytest.approx(1.0)  # 2000 tokens ahead at 2000 tokens/s
    clock.t += MIN_SAMPLE_S
    p[0].done(1000)  # 1000 tokens in 0.5 s = 2000/s
    assert q.rate == pytest.approx(2000.0)
    assert q.predicted_wait_s() == pytest.approx(0.5)
    p[1].done(1000)


def test_a_cached_system_prompt_is_counted_on_both_sides():
    """Issue 51's chats: 620-token prompts of which 600 are a cached system prompt, 20 computed. The
    queue ahead counts whole prompts (no cache is asked at admission); a rate of computed tokens
    (20 per request) against it predicted 31x the wait. Counted in whole prompts on both sides, three
    such requests ahead predict three requests' time."""
    clock = Clock()
    q = FirstTokenQueue(clock, alpha=1.0)
    for _ in range(WARM_SAMPLES):  # one request each 0.5 s: 620 prompt tokens, 20 computed
        p = q.admit(620)
        clock.t += MIN_SAMPLE_S
        p.done(20)
    assert q.rate == pytest.approx(1240.0) and q.request_floor_s() == pytest.approx(0.5)
    ahead = [q.admit(620) for _ in range(3)]
    assert q.predicted_wait_s() == pytest.approx(1.5)  # was 46.5 s with the computed-token rate
    for p in ahead:
        p.done()


def test_a_fresh_ingress_s_warm_up_is_not_taken_for_the_pools_rate():
    """The case that failed CI: an ingress Serve started after another was killed took 16 streams
    at once; its first answer took 3.0 s (its own first calls), the other 15 came 24-40 ms later.
    That first sample alone (2 tokens / 3 s) predicted a 48 s wait for 16 two-token requests, and
    the ingress refused them against their 60 s deadline. Only the next sample sets the rate."""
    clock = Clock()
    q = FirstTokenQueue(clock)
    stalled = [q.admit(2) for _ in range(16)]
    clock.t += 3.0
    stalled[0].done(2)  # a sample of 0.67 tokens/s
    assert q.rate is None and q.predicted_wait_s() is None
    for p in stalled[1:]:
        clock.t += 0.002
        p.done(2)
    for _ in range(9):  # the pools' real pace: 16 two-token requests every 0.06 s, 533 tokens/s
        batch = [q.admit(2) for _ in range(16)]
        clock.t += 0.06
        for p in batch:
            p.done(2)
    # the second sample closed at the first answer past MIN_SAMPLE_S of backlog (batch 8's first):
    # the 15 late answers, 7 batches and one answer over 0.51 s; the rate starts at it, not at 0.67
    assert q.rate == pytest.approx((15 * 2 + 7 * 32 + 2) / (15 * 0.002 + 8 * 0.06))
    queue = [q.admit(2) for _ in range(16)]
    assert q.predicted_wait_s() == pytest.approx(32 / q.rate)  # 0.06 s, not 48 s
    for p in queue:
        p.done()


def test_each_request_s_prediction_is_compared_with_its_first_token():
    clock = Clock()
    q = FirstTokenQueue(clock, alpha=1.0)
    a = q.admit(500)
    assert a.predicted_s is None  # no rate yet: nothing to compare
    a.done()
    warm(q, clock, 1000.0)  # its requests were admitted before there was a rate
    assert q.prediction_error() is None
    b, c = q.admit(1000), q.admit(1000)  # predicted 1.0 s and 2.0 s (the queue ahead, then its own)
    assert (b.predicted_s, c.predicted_s) == (1.0, 2.0)
    clock.t += 1.5
    b.done(1000)  # 0.5 s late
    clock.t += 0.25
    c.done(1000)  # 0.25 s early
    c.done(1000)  # idempotent: counted once
    q.admit(10).done()  # no first token: not compared
    err = q.prediction_error()
    assert (err["count"], err["median"], err["abs_p50"], err["abs_p90"]) == (2, 0.125, 0.5, 0.5)
    assert list(q.errors) == [0.5, -0.25]


def _door(tiny_model, **admission):
    from tests.helpers import front_door

    cfg = AppConfig.model_validate({"model": tiny_model, "admission": admission, "tenants": {
        "batchy": {"api_keys": ["kb"], "priority": "batch"}, "live": {"api_keys": ["ki"]}}})
    return front_door(cfg)


def test_a_request_the_queue_would_keep_past_the_bound_is_refused_before_any_work(tiny_model):
    door = _door(tiny_model, max_queue_wait_s=2.0, batch_share=0.5)
    q = door.capacity.first_tokens
    q.rate = 1000.0
    held = q.admit(1500)  # 1.5 s ahead
    door.capacity.check(RequestContext(priority=Priority.INTERACTIVE))
    with pytest.raises(Rejected, match=r"predicted queue wait 1.50 s exceeds max_queue_wait_s 1 \(batch share\)") as e:
        door.capacity.check(RequestContext(priority=Priority.BATCH))
    assert e.value.retry_after_s == pytest.approx(0.5)
    with pytest.raises(Rejected, match="left before its deadline"):
        door.capacity.check(RequestContext(deadline=time.time() + 1.0))
    more = q.admit(1000)  # 2.5 s ahead: interactive work is refused too
    with pytest.raises(Rejected, match="predicted queue wait 2.50 s exceeds max_queue_wait_s 2:"):
        door.capacity.check(RequestContext())
    held.done(1500)
    more.done(1000)
    door.capacity.check(RequestContext(priority=Priority.BATCH))  # drained: both pass


def test_requests_let_through_but_not_yet_queued_count_ahead_at_the_mean_length(tiny_model):
    """Reserved (checked, being tokenized) and in transit (asked from the gRPC transport's thread)
    requests are ahead of a new one: without them, a burst passes the check faster than it joins."""
    door = _door(tiny_model, max_queue_wait_s=1.0)
    q = door.capacity.first_tokens
    q.rate = 1000.0
    q.admit(400)  # 0.4 s ahead; the mean length is now 400
    assert q.mean_tokens == 400
    assert door.capacity.shedding() is None and door.capacity.shedding(in_transit=1) is None  # 0.8 s
    assert door.capacity.shedding(in_transit=2).reason == "queue_wait"  # 1.2 s
    reserved = q.reserve()  # checked, not yet tokenized: counted at the mean length
    door.capacity.check(RequestContext())  # 0.8 s
    assert "predicted queue wait 1.20 s" in door.capacity.shedding(in_transit=1).message
    reserved.join(600)  # tokenized: it joins with its own length
    assert (q.reserved, q.pending_requests, q.pending_tokens) == (0, 2, 1000)
    with pytest.raises(Rejected, match="predicted queue wait 1.00 s exceeds the"):
        door.capacity.check(RequestContext(deadline=time.time() + 0.5))
    gone = q.reserve()
    gone.done()  # refused or failed before it joined: its place goes
    gone.done()
    assert q.reserved == 0


def test_the_front_door_refuses_by_predicted_wait_without_touching_a_pool_and_releases_the_slot(tiny_model):
    from tests.helpers import generate

    door = _door(tiny_model, max_queue_wait_s=1.0)
    door.capacity.first_tokens.rate = 100.0
    ahead = door.capacity.first_tokens.admit(500)  # 5 s ahead

    async def one():
        async for _ in generate(door, ids=[1, 2, 3], tenant="live", max_tokens=2):
            pass

    with pytest.raises(Rejected) as e:  # the pools are None: any call to them would fail differently
        asyncio.run(one())
    assert e.value.reason == "queue_wait"
    assert door.admission.total_inflight == 0  # the in-flight slot went back
    assert (door.capacity.first_tokens.pending_requests, door.capacity.first_tokens.pending_tokens) == (1, 500)
    ahead.done(500)


def test_batch_work_is_refused_at_its_share_of_the_in_flight_cap():
    cfg = AppConfig.model_validate({"admission": {"max_inflight": 4, "batch_share": 0.5}, "tenants": {
        "batchy": {"api_keys": ["kb"], "priority": "batch"}, "live": {"api_keys": ["ki"]}}})

    async def take(*args):
        return Quotas().take(*args)

    adm = Admission(cfg, take)
    tickets = [adm.reserve("live"), adm.reserve("live")]
    with pytest.raises(Rejected, match="at capacity \\(2 requests in flight on this ingress for batch work\\)"):
        adm.reserve("batchy")
    tickets += [adm.reserve("live"), adm.reserve("live")]  # interactive work keeps the whole cap
    with pytest.raises(Rejected, match="at capacity \\(4 requests in flight on this ingress\\)"):
        adm.reserve("live")
    for t in tickets:
        t.done()
    assert adm.total_inflight == 0
    adm.reserve("batchy").done()


def test_stream_pace_caps_by_its_gradient_once_over_the_target_and_probes_back_up():
    from router.ingress.gateway.capacity import StreamPace

    clock = Clock()
    pace = StreamPace(clock, alpha=1.0, target_itl_s=0.1)
    assert pace.cap() is None  # nothing measured: no cap
    for _ in range(2):
        pace.start()
    clock.t += 0.5
    pace.tokens(20)  # 2 streams x 0.5 s over 20 tokens: 50 ms per token per stream
    assert pace.itl_s == pytest.approx(0.05) and pace.mean_streams == pytest.approx(2.0)
    assert pace.cap() is None  # within the target: no cap (the gradient, 4, would refuse a pool far from full)
    assert pace.proven() == 2  # but 2 streams ran within it
    for _ in range(2):
        pace.start()
    clock.t += 0.5
    pace.tokens(10)  # 4 x 0.5 s over 10 tokens: 200 ms, over the target
    assert pace.cap() is None  # one slow window: a pause, not yet a pace
    clock.t += 0.5
    pace.tokens(10)  # the second in a row
    assert pace.cap() == 2  # 4 streams x 100 / 200 ms
    for _ in range(2):
        pace.end()
    clock.t += 10.0  # 2 streams, no tokens for 10 s: one slow window
    pace.tokens(20)
    assert pace.cap() == 2  # 2 x 0.1 / 1.0 = 0.2, but never under the 2 that ran within the target (nor MIN_LIMIT)
    clock.t += 0.5
    pace.tokens(20)  # 2 streams (>= 0.8 of the limit) at 50 ms: within the target, at the limit
    assert pace.limit == pytest.approx(4.0)  # max(1 + 1, the gradient 2 x 100 / 50 ms)
    clock.t += 0.5
    pace.tokens(20)  # the same, now at half the limit: no probe
    assert pace.limit == pytest.approx(4.0)
    for _ in range(2):
        pace.start()
    clock.t += 0.5
    pace.tokens(40)  # 4 streams at 50 ms: at the limit, gradient 8
    assert pace.cap() == 8
    for _ in range(4):
        pace.end()
    clock.t += 100.0  # idle time counts in no window
    pace.start()
    clock.t += 0.5
    pace.tokens(10)
    assert pace.cap() == 8  # a quiet window keeps the limit
    assert StreamPace(clock, alpha=1.0).cap() is None  # no target: never a cap


def test_the_decode_pace_cap_refuses_new_work_interactive_last(tiny_model):
    door = _door(tiny_model, target_itl_s=0.1, batch_share=0.5)
    clock = Clock()
    door.capacity.pace.clock = clock
    door.capacity.pace._last = clock.t
    for _ in range(12):
        door.capacity.pace.start()
    for _ in range(2):  # two windows in a row
        clock.t += 0.5
        door.capacity.pace.tokens(30)  # 12 streams at 200 ms: the cap at 100 ms is 6
    for _ in range(9):
        door.capacity.pace.end()
    door.capacity.check(RequestContext())  # 3 streams < 6
    with pytest.raises(Rejected, match=r"target_itl_s 0.1 \(measured 200 ms per token over 12.0 streams\) \(batch share\)"):
        door.capacity.check(RequestContext(priority=Priority.BATCH))  # 3 >= 6 x 0.5
    waiting = [door.capacity.first_tokens.admit(10) for _ in range(3)]  # 3 streams + 3 waiting for a first token = 6
    with pytest.raises(Rejected) as e:
        door.capacity.check(RequestContext())
    assert e.value.reason == "capacity"
    for p in waiting:
        p.done(10)


def test_the_ingress_scrape_shows_the_prediction_error(tiny_model):
    from router.ingress.api.probes import metrics_text

    door = _door(tiny_model)
    assert b"pdserve_ingress_ttft_prediction_error_seconds" not in metrics_text(door)  # nothing compared yet
    door.capacity.first_tokens.errors.extend([0.5, -0.25])
    text = metrics_text(door).decode()
    assert 'pdserve_ingress_ttft_prediction_error_seconds{stat="median"} 0.125' in text
    assert 'pdserve_ingress_ttft_prediction_error_seconds{stat="abs_p90"} 0.5' in text
    assert "pdserve_ingress_ttft_predictions 2.0" in text


def test_the_ingress_scrape_shows_the_collections(tiny_model):
    from cluster.telemetry import gc_pauses
    from router.ingress.api.probes import metrics_text

    saved, saved_full = gc_pauses.PAUSES.by_generation, gc_pauses.FULL
    gc_pauses.PAUSES.by_generation = [gc_pauses.GenerationPauses(), gc_pauses.GenerationPauses(),
                                      gc_pauses.GenerationPauses(count=3, total_s=0.25, max_s=0.125)]
    gc_pauses.FULL = gc_pauses.FullCollectionStats(idle=gc_pauses.GenerationPauses(2, 0.0625, 0.046875),
                                                   forced=gc_pauses.GenerationPauses(1, 0.5, 0.5), deferred=4,
                                                   freed=12345)
    try:
        text = metrics_text(_door(tiny_model)).decode()
    finally:
        gc_pauses.PAUSES.by_generation, gc_pauses.FULL = saved, saved_full
    assert 'pdserve_ingress_gc_pauses{generation="2"} 3.0' in text
    assert 'pdserve_ingress_gc_pause_seconds{generation="2",stat="total"} 0.25' in text
    assert 'pdserve_ingress_gc_pause_seconds{generation="2",stat="max"} 0.125' in text
    assert 'pdserve_ingress_gc_pauses{generation="0"} 0.0' in text
    assert 'pdserve_ingress_gc_full_runs{when="idle"} 2.0' in text
    assert 'pdserve_ingress_gc_full_runs{when="forced"} 1.0' in text
    assert 'pdserve_ingress_gc_full_run_seconds{stat="max",when="idle"} 0.046875' in text
    assert 'pdserve_ingress_gc_full_run_seconds{stat="total",when="forced"} 0.5' in text
    assert "pdserve_ingress_gc_full_deferred 4.0" in text
    assert "pdserve_ingress_gc_full_freed_objects 12345.0" in text


def test_the_auto_inflight_cap_is_sized_from_the_decode_pool_s_kv():
    from router.ingress.gateway.capacity import AUTO_MIN, AUTO_UNMEASURED, REFRESH_S, InflightCap

    clock = Clock()
    assert InflightCap(16)() == 16 and not InflightCap(16).due()  # a number is a number
    cap = InflightCap("auto", ingress_replicas=2, clock=clock, alpha=0.5)
    assert cap() == AUTO_UNMEASURED and cap.due()
    cap.kv_read(409_600)  # the decode pool's blocks x block size
    assert cap() == AUTO_UNMEASURED  # requests' size not known yet
    cap.admitted(1000)
    cap.admitted(3000)  # smoothed: 2000 tokens a request
    assert cap() == int(2.0 * 409_600 / 2000 / 2) == 204  # twice what the KV holds, half per ingress
    cap.kv_read(None)  # a failed read keeps the last value
    assert cap() == 204 and not cap.due()
    clock.t += REFRESH_S
    assert cap.due()
    cap.kv_read(8_192)
    assert cap() == AUTO_MIN  # never below the floor


def test_admission_refuses_at_the_auto_cap_naming_it(tiny_model):
    cfg = AppConfig.model_validate({"model": tiny_model})
    adm = Admission(cfg, None)
    cap = adm.max_inflight
    cap.kv_read(64 * 16 * 32)
    cap.admitted(16)  # 2 x 32768 / 16 = 4096
    assert cap() == 4096
    cap.kv_read(64 * 16)
    assert cap() == 128
    tickets = [adm.reserve("default") for _ in range(128)]
    with pytest.raises(Rejected, match=r"at capacity \(128 requests in flight on this ingress\)"):
        adm.reserve("default")
    for t in tickets:
        t.done(0)
    assert adm.total_inflight == 0


@pytest.mark.parametrize("admission, slo, bounds", [
    ({}, {}, (0.5, 0.08)),  # protection on by default: half the TTFT objective, 0.8 of the interval's
    ({}, {"ttft_threshold_s": 2.5, "itl_threshold_s": 0.3}, (1.25, 0.24)),
    ({"max_queue_wait_s": "none", "target_itl_s": None}, {}, (None, None)),
    ({"max_queue_wait_s": 3, "target_itl_s": "auto"}, {}, (3.0, 0.08)),
])
def test_admission_bounds_default_to_the_slo_and_none_turns_them_off(admission, slo, bounds):
    cfg = AppConfig.model_validate({"admission": admission, "telemetry": {"slo": slo}})
    b = cfg.admission_bounds
    assert (b.max_queue_wait_s, None if b.target_itl_s is None else round(b.target_itl_s, 6)) == bounds
    assert cfg.admission.max_queue_wait_s == admission.get("max_queue_wait_s", "auto")  # the config as written
