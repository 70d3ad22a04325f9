"""The decode pace the ingress holds streams to (router/ingress/gateway/pace.py) on a colocated
replica with chunked prefill: every prompt chunk stalls every stream, so a window's mean interval
reads the stalls as slow streams while each request's own time per output token meets the target
(issue 51: the plan's emitted config refused 10 of 90 requests of its own trace for it)."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

from cluster.config import AdmissionBounds
from cluster.engine.request import RequestContext
from router.ingress.gateway.capacity import Capacity, CapacityStage
from router.ingress.gateway.pace import (
    CALM_WINDOWS, FLOOR_HOLD_S, FLOOR_TAU_S, MIN_STREAM_TOKENS, WEIGHT_TOKENS, StreamPace, weighted_pace)
from router.ingress.status import Rejected

# 25 decode steps of 40 ms, then two 3-chunk prompts' mixed steps of 300 ms: each stream's own time
# per output token is (25 x 0.04 + 6 x 0.3) / 31 = 90 ms; a 0.5 s window in the prompts reads 300 ms
CYCLE = [0.04] * 25 + [0.3] * 6


class Clock:
    def __init__(self):
        self.t = 50.0

    def __call__(self):
        return self.t


def relay(pace: StreamPace, clock: Clock, streams: list, steps: list[float], per_stream: bool = True) -> set:
    """Each step: every stream gets one token. Returns the caps seen after each step."""
    caps = set()
    for step in steps:
        clock.t += step
        for s in streams:
            pace.tokens(1, s if per_stream else None)
        caps.add(pace.cap())
    return caps


def test_prefill_stalls_on_a_colocated_replica_are_not_slow_streams():
    clock = Clock()
    pace = StreamPace(clock, alpha=1.0, target_itl_s=0.16)
    streams = [pace.start() for _ in range(4)]
    assert relay(pace, clock, streams, CYCLE * 10) == {None}  # never capped
    assert streams[0].tpot_s() == pytest.approx(2.8 / 31)
    assert pace.itl_s == pytest.approx(2.8 / 31, rel=0.02)  # the streams' own pace, not the window's
    # the window's mean interval alone (what the cap read before): capped at half the streams it runs
    clock, window = Clock(), None
    window = StreamPace(clock, alpha=1.0, target_itl_s=0.16)
    blind = [window.start() for _ in range(4)]
    caps = relay(window, clock, blind, CYCLE * 10, per_stream=False)
    assert window.cap() == 4 and min(c for c in caps if c) == 4  # not one more than the 4 it ran in the decode steps


def test_streams_that_really_slow_down_are_still_capped():
    clock = Clock()
    pace = StreamPace(clock, alpha=1.0, target_itl_s=0.16)
    streams = [pace.start() for _ in range(8)]
    relay(pace, clock, streams, [0.04] * 25)
    assert pace.cap() is None
    relay(pace, clock, streams, [0.32] * 60)  # every step now 320 ms: the streams' own pace follows
    assert streams[0].tpot_s() == pytest.approx((25 * 0.04 + 60 * 0.32) / 85)
    # no new stream while they are slow, but none refused under the 8 that ran within the target
    assert pace.cap() == 8 and pace.proven() == 8  # (the gradient: 8 x 0.16 / their pace, 0.238 s = 5)
    relay(pace, clock, streams, [0.32] * 100)  # 32 s more: what ran within the target is PROVEN_S old
    assert pace.proven() == 0 and pace.cap() == 4  # the gradient: 8 x 0.16 / 0.282 s
    young = pace.start()  # a stream with fewer than MIN_STREAM_TOKENS counts only when it has them
    assert young.tpot_s() is None and MIN_STREAM_TOKENS == 4


def test_a_limit_the_load_no_longer_reaches_is_lifted():
    """Two slow windows set a limit; the load then falls under PROBE_AT of it, so it never probed
    back up, and a clump of arrivals (the requests ahead of their first token count against it)
    was refused while the streams ran at half the target: 2 of 20 and 2 of 60 of a plan's own
    traces (issue 51). After CALM_WINDOWS such windows it is lifted."""
    clock = Clock()
    capacity = Capacity(AdmissionBounds(max_queue_wait_s=None, target_itl_s=0.125), clock)
    pace = capacity.pace
    slow = [pace.start() for _ in range(6)]
    relay(pace, clock, slow, [0.25] * 8)  # 6 streams at 250 ms: four windows over the target
    assert pace.cap() == 3  # 6 x 0.125 / 0.25
    for s in slow:
        pace.end(s)
    calm = [pace.start() for _ in range(2)]
    caps = []
    for _ in range(CALM_WINDOWS + 2):  # 2 streams at 62.5 ms, one 0.5 s window each
        relay(pace, clock, calm, [0.0625] * 8)
        caps.append(pace.cap())
    # the first window still holds the slow streams that ended in it (MIN_LIMIT; what ran within
    # the target was slow); the second presses on its limit of 2 and probes to the gradient (2 x 0.125 / 0.0625); then CALM_WINDOWS under it
    assert caps == [2, 4] + [4] * (CALM_WINDOWS - 1) + [None]
    clump = [capacity.first_tokens.admit(10) for _ in range(3)]  # 2 streams + 3 ahead: over the old 4
    capacity.check(RequestContext())
    for p in clump:
        p.done(10)
    back = calm + [pace.start() for _ in range(6)]
    relay(pace, clock, back, [0.25] * 12)  # 8 streams at 250 ms: capped again
    assert pace.cap() == 4  # 8 x 0.125 / 0.25
    with pytest.raises(Rejected, match="the decode pool is at the streams it runs at target_itl_s 0.125"):
        capacity.check(RequestContext())


def test_a_prompt_s_stall_at_fewer_streams_than_just_ran_well_does_not_cap_under_them():
    """A plan's own trace (0P+1D colocated, chunk 256, 0.4 req/s of 350-800-token prompts) was
    refused 4 of 60 at "measured 260 ms per token over 2.5 streams" against a target of 320 ms:
    a long prompt's chunks stalled the streams for a second, two windows read slow, and the
    gradient (2.5 x 0.32 / 0.4 = 2) capped a pool that had just run 4 streams within the target."""
    clock = Clock()
    capacity = Capacity(AdmissionBounds(max_queue_wait_s=None, target_itl_s=0.32), clock)
    pace = capacity.pace
    four = [pace.start() for _ in range(4)]
    relay(pace, clock, four, [0.0625] * 16)  # 4 streams at 62.5 ms: two windows within the target
    assert pace.cap() is None and pace.proven() == 4
    for s in four:
        pace.end(s)
    young = [pace.start() for _ in range(3)]  # three new streams: their own pace reads every stall
    relay(pace, clock, young, [0.0625] * 4 + [1.5] * 3)  # three prompts' chunks stall them 1.5 s each
    assert pace._slow_windows == 2  # at 3.25 s / 6 tokens (the first window after: the 4 ended ones' pace)
    assert pace.cap() == 4  # the gradient alone: 3 x 0.32 / 0.54 = 1.8, a cap of 1 before MIN_LIMIT
    capacity.check(RequestContext())  # the fourth user: served
    arrived = capacity.first_tokens.admit(600)
    with pytest.raises(Rejected, match="at the streams it runs at target_itl_s 0.32"):
        capacity.check(RequestContext())  # a fifth: more than ran within the target, while it is slow
    arrived.done(600)


def test_one_stream_stalled_by_the_prompts_beside_it_sets_no_limit():
    """A plan's long-prompt trace (600-1,500-token prompts at 0.15 req/s, target 200 ms) had 1 of
    20 refused at "measured 390 ms per token over 1.0 streams": the next prompt's chunks stalled
    the one stream, and a limit of 2 refused a third request. No number of streams refused speeds
    up one stream; the prompts beside it are the queue bound's to govern."""
    clock = Clock()
    capacity = Capacity(AdmissionBounds(max_queue_wait_s=None, target_itl_s=0.2), clock)
    pace = capacity.pace
    one = [pace.start()]
    relay(pace, clock, one, [0.0625] * 4 + [1.6] * 3)  # the next 1,500-token prompt's 6 chunks stall it
    assert one[0].tpot_s() == pytest.approx(5.05 / 7) and pace.cap() is None
    waiting = capacity.first_tokens.admit(1500)
    capacity.check(RequestContext())  # a third request: served
    waiting.done(1500)
    two = one + [pace.start()]  # two streams that slow: the limit is set (never under MIN_LIMIT)
    relay(pace, clock, two, [0.0625] * 4 + [1.6] * 3)
    assert pace.cap() == 2
    with pytest.raises(Rejected, match="at the streams it runs at target_itl_s 0.2"):
        capacity.check(RequestContext())


def test_young_streams_stalled_by_their_own_prompts_do_not_outvote_the_streams_that_ran():
    """A plan's near-saturation trace (350-800-token prompts at 0.4 req/s, target 320 ms) was
    refused 1-3 of 60 at "measured 388 ms per token over 10.0 streams" while the served requests'
    TPOT was p90 161-243 ms: a clump of arrivals' prompt chunks stalled every stream, and the young
    streams, the majority, read the stalls over their first few tokens; the median of the streams'
    paces was theirs. Each stream now weighs its tokens so far (up to WEIGHT_TOKENS)."""
    clock = Clock()
    capacity = Capacity(AdmissionBounds(max_queue_wait_s=None, target_itl_s=0.32), clock)
    pace = capacity.pace
    old = [pace.start() for _ in range(4)]
    relay(pace, clock, old, [0.07] * 30)  # 4 streams at 70 ms
    young = [pace.start() for _ in range(5)]  # a clump of 5 arrivals...
    relay(pace, clock, old + young, [0.07] * 4 + [0.9] * 4 + [0.07])  # ...whose prompts' chunks stall every stream
    assert young[0].tpot_s() == pytest.approx(3.95 / 9) and old[0].tpot_s() == pytest.approx(6.05 / 39)
    # what the limit read before, two windows in a row: the young streams' 439 ms (capped at the 9 streams)
    assert statistics.median(s.tpot_s() for s in old + young) == pytest.approx(3.95 / 9)
    weighted = (4 * WEIGHT_TOKENS * 6.05 / 39 + 5 * 3.95) / (4 * WEIGHT_TOKENS + 5 * 9)
    assert weighted_pace(old + young) == pytest.approx(weighted) and weighted < 0.28
    assert pace.itl_s < 0.32 and pace.cap() is None
    capacity.check(RequestContext())  # the tenth: served
    relay(pace, clock, old + young, [0.4] * 20)  # every stream really slows to 400 ms: capped
    assert pace.cap() == 9 and pace.proven() == 9  # never under the 9 that just ran within the target
    with pytest.raises(Rejected, match="at the streams it runs at target_itl_s 0.32"):
        capacity.check(RequestContext())


def test_the_floor_is_a_decayed_minimum():
    clock = Clock()
    pace = StreamPace(clock, alpha=1.0, target_itl_s=0.08, floor_multiple=8.0)
    streams = [pace.start()]
    relay(pace, clock, streams, [0.02] * 30)  # one fast stream: floor 20 ms
    assert pace.floor_itl_s == pytest.approx(0.02)
    pace.end(streams[0])
    streams = [pace.start() for _ in range(4)]
    relay(pace, clock, streams, [0.1] * 300)  # 30 s at 100 ms: within the hold, the floor stays
    assert pace.floor_itl_s == pytest.approx(0.02)
    relay(pace, clock, streams, [0.1] * int((FLOOR_HOLD_S - 30 + FLOOR_TAU_S) / 0.1))  # a time constant past the hold
    # the streams' own pace is ~0.1 s by now; the floor has come 1 - 1/e of the way towards it
    assert pace.floor_itl_s == pytest.approx(0.1 - 0.08 / 2.718281828, abs=0.0005)
    assert pace.target() == pytest.approx(8 * pace.floor_itl_s)


def test_the_capacity_stage_hands_each_stream_its_own_pace():
    clock = Clock()
    stage = CapacityStage(Capacity(AdmissionBounds(max_queue_wait_s=None, target_itl_s=0.16), clock))
    pace = stage.capacity.pace
    o = SimpleNamespace(streaming=None, place=None, cache_hit=False)
    stage.delta(o, SimpleNamespace(token_ids=[7], finish_reason=None))  # the first token: its stream starts
    first = o.streaming
    assert pace.streams == 1 and first.first_at == clock.t
    for _ in range(5):
        clock.t += 0.05
        stage.delta(o, SimpleNamespace(token_ids=[7, 8], finish_reason=None))
    assert (first.tokens, first.tpot_s()) == (10, pytest.approx(0.025))
    clock.t += 0.05
    stage.delta(o, SimpleNamespace(token_ids=[9], finish_reason="length"))
    assert (pace.streams, o.streaming, [s.tpot_s() for s in pace._ended]) == (0, None, [pytest.approx(0.3 / 11)])
    stage.finish(o, None)
    assert pace.streams == 0  # counted once
