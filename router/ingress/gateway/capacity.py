"""The ingress's own model of the queue in front of the pools, for refusing work at once.

A request admitted here waits for its first token behind the prompt tokens of every request this
ingress admitted earlier that has no first token yet. So the predicted wait of a new request is

    pending prompt tokens / the rate at which the pools turn prompt tokens into first tokens

and both numbers live here: `pending` moves with every admission and first token (exact, no
report lag), and the rate is measured from the first tokens themselves, over the time the queue
was not empty (a backlogged pool's throughput). Requests already let through but not yet in the
queue count at the mean prompt length of the admitted ones: those reserved (checked, being
tokenized) and, asked from the gRPC transport's thread, the calls on their way to the front door's
loop (api/grpc_server.py). So a request arriving in a burst is refused on arrival by the same
bound it would meet at the front door, instead of waiting in line for the front door to refuse it.
No actor call, no replica report: under a burst the prediction includes every request admitted a
millisecond ago, where a model fed by the replicas' load reports (every 0.25 s, through the router)
would see a queue that is seconds old.

With several ingress replicas each sees its share of the traffic (Serve's proxy spreads it) and
of the throughput, so the ratio holds without coordination.

`Capacity` makes the refusals (the queue's predicted wait, the decode pace cap `StreamPace`);
`InflightCap` sizes admission.max_inflight "auto" from the decode pool's KV.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from cluster.config import AdmissionBounds
from cluster.engine.request import Priority, RequestContext
from router.ingress.gateway.stages import Outcome, Stage
from router.ingress.status import Rejected

SLOW_WINDOWS = 2  # windows in a row over target_itl_s before the pace limit shrinks
PROBE_AT = 0.8  # the pace limit grows while the streams reach this share of it within the target...
PROBE_STEP = 0.25  # ... by this share of itself a window
MIN_SAMPLE_S = 0.5  # busy time per rate sample: shorter samples are one chunk's noise
WARM_SAMPLES = 2  # rate samples before the first-token queue predicts (the rate starts at their largest)
ERRORS_KEPT = 2048  # the latest requests whose prediction is compared with what happened
MEAN_ALPHA = 0.05  # smoothing of the admitted requests' mean prompt length
GROWTH_TAU_S = 2.0  # arrivals and departures are counted with this decay...
GROWING_AT = 1.5  # ...and the queue grows while requests arrive this many times faster than they leave it


class _Meter:
    """What both models share: a clock read at every event (`_tick()` returns the seconds since
    the previous one) and an exponentially weighted mean of their samples (None until the first)."""

    def __init__(self, clock: Callable[[], float], alpha: float):
        self.clock = clock
        self.alpha = alpha
        self._last = clock()

    def _tick(self) -> float:
        now = self.clock()
        dt, self._last = now - self._last, now
        return dt

    def _smooth(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1 - self.alpha) * old + self.alpha * sample


@dataclass
class Pending:
    """One request's place in the model: reserved (checked, its length not known yet), then
    admitted (`join`); `done` is idempotent."""

    tokens: int
    _queue: "FirstTokenQueue | None"
    predicted_s: float | None = None  # its time to first token as predicted when admitted (None: no rate yet)
    admitted_at: float = field(default=0.0)
    reserved: bool = False

    def join(self, tokens: int) -> None:
        """A reserved request joins the queue with its prompt's length."""
        if self._queue is not None and self.reserved:
            self._queue._join(self, tokens)

    def done(self, computed_tokens: int | None = None) -> None:
        """Its first token arrived (`computed_tokens`: the prompt tokens computed for it, i.e.
        not found in a cache; None: the request ended before, nothing measured). The rate counts its
        whole prompt: the queue ahead is counted in whole prompts, before any cache is asked, so the
        rate that drains it must be too (a rate of computed tokens against a queue of whole prompts
        predicted 30x the wait behind a cached 600-token system prompt, and refused 155 of 160 chats)."""
        if self._queue is not None:
            if self.reserved:
                self._queue.reserved -= 1
            else:
                self._queue._done(self, computed_tokens)
            self._queue = None


class FirstTokenQueue(_Meter):
    """The queue ahead of a new request's first token and the rate it drains at.

    The rate is unknown (no prediction, no refusal) until WARM_SAMPLES samples were taken, and
    starts at the largest of them. A fresh ingress's first sample times its own warm-up (its first
    calls to the router and the pools: 3 s for a replica Serve started after another was killed),
    not the pools' throughput: taken alone, it once set a rate of 0.7 prompt tokens/s where the
    pools ran 270, and the ingress refused 16 two-token requests for a predicted 60 s wait.
    Later samples are smoothed, so one stall moves the rate by at most `alpha`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, alpha: float = 0.3):
        super().__init__(clock, alpha)
        self.rate: float | None = None  # prompt tokens per second while backlogged; None until measured
        self._warm: list[float] = []  # the first samples, before there is a rate
        self.pending_tokens = 0
        self.pending_requests = 0
        self.reserved = 0  # requests checked and let through, not yet in the queue (being tokenized)
        self.mean_tokens: float | None = None  # prompt tokens per admitted request, smoothed (alpha MEAN_ALPHA)
        self._busy_s = 0.0  # backlogged time in the current sample
        self._done_tokens = 0  # prompt tokens computed in the current sample
        self.errors: deque[float] = deque(maxlen=ERRORS_KEPT)  # actual - predicted time to first token (s)
        self._arrived = self._left = 0.0  # requests into and out of the queue, decayed (GROWTH_TAU_S)
        self._counted_at = self._last

    def ahead(self, in_transit: int = 0) -> int:
        """Requests ahead of one checked now: in the queue, reserved, and `in_transit` more."""
        return self.pending_requests + max(0, self.reserved + in_transit)

    def offered(self) -> None:
        """A request arrived (checked, whether it is then admitted or refused)."""
        self._count(1, 0)

    def growing(self, at_least: float = 1.0) -> bool:
        """Requests arrive faster than they leave (GROWING_AT, over the last few GROWTH_TAU_S): an
        overload. Arrivals are the requests offered, refused ones included: counted at admission, a
        burst held at the bound looks steady (as many admitted as leave). A closed loop of clients
        that is never refused is steady: each arrival follows a departure. `at_least`: departures
        counted as no fewer than this, so that a closed loop of that many clients arriving at once (a
        cold start, whose first tokens are slow) is not growth; read as growth, its refusals brought
        retries at once, which kept it growing (16 of 40 chats refused). It only reads (the gRPC
        transport's thread asks it through `shedding`); the counts move on the front door's loop."""
        decay = self._decay()
        return self.pending_requests > 1 and self._arrived * decay > GROWING_AT * max(self._left * decay, at_least)

    def _decay(self) -> float:
        return math.exp(-(self.clock() - self._counted_at) / GROWTH_TAU_S)

    def _count(self, arrived: int, left: int) -> None:
        decay = self._decay()
        self._counted_at = self.clock()
        self._arrived = self._arrived * decay + arrived
        self._left = self._left * decay + left

    def request_floor_s(self) -> float | None:
        """One request's own prompt time at the pools' measured pace (mean prompt / rate): the wait
        a request behind one other expects. Per-request costs are in it (the rate is measured over
        whole requests); None until there is a rate."""
        return self.mean_tokens / self.rate if self.rate and self.mean_tokens else None

    def predicted_wait_s(self, in_transit: int = 0) -> float | None:
        """Seconds before a request admitted now starts its prompt; None while the rate is unknown.
        The requests reserved and `in_transit` (let through, not yet here) count at the mean length."""
        tokens = self.pending_tokens + max(0, self.reserved + in_transit) * (self.mean_tokens or 0.0)
        if tokens <= 0:
            return 0.0
        return None if not self.rate else tokens / self.rate

    def admit(self, tokens: int) -> Pending:
        p = Pending(tokens, self, reserved=True)
        self.reserved += 1
        self._join(p, tokens)
        return p

    def reserve(self) -> Pending:
        """A place for a request that passed the check and is being prepared: it counts ahead of
        every request checked after it until it joins (`Pending.join`) or ends (`done`)."""
        self.reserved += 1
        return Pending(0, self, reserved=True)

    def _join(self, p: Pending, tokens: int) -> None:
        self._advance()
        self.reserved -= 1
        p.reserved, p.tokens = False, tokens
        p.predicted_s = (self.pending_tokens + tokens) / self.rate if self.rate else None  # the queue, then its own
        p.admitted_at = self._last
        self.pending_tokens += tokens
        self.pending_requests += 1
        m = self.mean_tokens
        self.mean_tokens = tokens if m is None else (1 - MEAN_ALPHA) * m + MEAN_ALPHA * tokens

    def prediction_error(self) -> dict[str, float] | None:
        """How the predicted time to first token compared with the actual one over the latest
        ERRORS_KEPT requests (seconds; positive: later than predicted); None before any."""
        if not self.errors:
            return None
        errs = sorted(self.errors)
        absolute = sorted(abs(e) for e in errs)

        def q(values, p):
            return values[min(len(values) - 1, int(p * len(values)))]
        return {"count": len(errs), "median": statistics.median(errs), "abs_p50": q(absolute, 0.5),
                "abs_p90": q(absolute, 0.9), "abs_p99": q(absolute, 0.99)}

    def _done(self, p: Pending, computed: int | None) -> None:
        self._advance()
        self.pending_tokens -= p.tokens
        self.pending_requests -= 1
        self._count(0, 1)
        if computed is not None:
            if p.predicted_s is not None:
                self.errors.append(self._last - p.admitted_at - p.predicted_s)
            self._done_tokens += p.tokens  # whole prompts, as `pending` counts them (cache hits fold into the rate)
            if self._busy_s >= MIN_SAMPLE_S and self._done_tokens > 0:
                sample = self._done_tokens / self._busy_s
                if self.rate is not None:
                    self.rate = self._smooth(self.rate, sample)
                else:
                    self._warm.append(sample)
                    if len(self._warm) >= WARM_SAMPLES:
                        self.rate = max(self._warm)
                self._busy_s, self._done_tokens = 0.0, 0

    def _advance(self) -> None:
        dt = self._tick()
        if self.pending_requests > 0:
            self._busy_s += dt


class StreamPace(_Meter):
    """The streams past their first token and the interval between their tokens as this ingress
    relays them (the decode pool's ITL, measured where the client gets it), over windows of
    MIN_SAMPLE_S with at least one stream running, and the limit on streams they imply.

    The limit (`cap()`) exists once SLOW_WINDOWS windows in a row measured the interval over
    `target_itl_s`: it is then set to the streams the pool would run at the target by the gradient
    of the last one (mean streams x target / measured ITL); at or over it, new work is refused, so
    running streams keep their pace instead of every stream slowing together. While the interval
    stays within the target and the streams reach PROBE_AT of the limit, it grows by PROBE_STEP a
    window (or to the gradient, if larger). No cap before the pool was first measured slow: at low
    load a step's fixed cost dominates the interval, and the gradient through zero would refuse a
    pool that is far from full.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, alpha: float = 0.3,
                 target_itl_s: float | None = None, floor_multiple: float = 0.0,
                 steady: Callable[[], bool] = lambda: True):
        super().__init__(clock, alpha)
        self.steady = steady  # the load is not growing: the floor multiple may loosen the target
        self.target_itl_s = target_itl_s
        self.streams = 0
        self.itl_s: float | None = None  # None until measured
        self.mean_streams = 0.0  # over the last window
        self.limit: float | None = None  # streams; None until SLOW_WINDOWS windows in a row were over the target
        self.floor_multiple = floor_multiple
        self.floor_itl_s: float | None = None  # the fastest window's interval: this deployment's own pace
        self._slow_windows = 0
        self._window_s = 0.0
        self._stream_s = 0.0  # integral of streams over the window
        self._tokens = 0

    def start(self) -> None:
        self._advance()
        self.streams += 1

    def end(self) -> None:
        self._advance()
        self.streams -= 1

    def tokens(self, n: int) -> None:
        self._advance()
        self._tokens += n
        if self._window_s >= MIN_SAMPLE_S and self._tokens > 0:
            sample = self._stream_s / self._tokens
            self.itl_s = self._smooth(self.itl_s, sample)
            self.mean_streams = self._stream_s / self._window_s
            self._window_s = self._stream_s = 0.0
            self._tokens = 0
            self._adjust(sample)

    def target(self) -> float | None:
        """The interval streams are held to: target_itl_s, or with a floor multiple the larger of it and
        that multiple of the fastest interval measured while the load is steady (a CPU whose one
        stream is slower than the objective still runs as many streams as keep its own pace; a
        growing load is held to the objective, so a burst cannot crowd the streams it shares cores with)."""
        if self.target_itl_s is None or not self.floor_multiple or self.floor_itl_s is None or not self.steady():
            return self.target_itl_s
        return max(self.target_itl_s, self.floor_multiple * self.floor_itl_s)

    def _adjust(self, itl_s: float) -> None:
        """The limit from this window's interval (not the smoothed one: a limit set in a slow
        warm-up must not outlive it by the smoothing's memory)."""
        self.floor_itl_s = itl_s if self.floor_itl_s is None else min(self.floor_itl_s, itl_s)
        target = self.target()
        if target is None:
            return
        gradient = self.mean_streams * target / itl_s
        if itl_s > target:
            self._slow_windows += 1
            if self._slow_windows >= SLOW_WINDOWS:  # one slow window is a pause, not a pace
                self.limit = max(1.0, gradient)
        else:
            self._slow_windows = 0
            if self.limit is not None and self.mean_streams >= PROBE_AT * self.limit:
                self.limit = max(self.limit + max(1.0, PROBE_STEP * self.limit), gradient)

    def cap(self) -> int | None:
        return None if self.limit is None else max(1, int(self.limit))

    def _advance(self) -> None:
        dt = self._tick()
        if self.streams > 0:
            self._window_s += dt
            self._stream_s += self.streams * dt


AUTO_HEADROOM = 2.0  # requests in flight per request the decode pool's KV holds (one batch running, one queued)
AUTO_MIN = 64  # the auto cap never goes below this
AUTO_UNMEASURED = 1024  # until the decode pool's KV and the requests' size are known
REFRESH_S = 5.0  # how often the decode pool's KV is read again (replicas come and go)


class InflightCap:
    """admission.max_inflight: the configured number, or with "auto" the requests the decode
    pool's KV can hold, sized from what is measured: the pool's KV tokens (its replicas' blocks,
    read from the router every REFRESH_S) over the tokens a recent request may occupy (prompt +
    max_tokens, smoothed), x AUTO_HEADROOM, split over the ingress replicas. Past it, streams
    would wait for KV on decode (or be preempted) rather than run: the queue belongs at the door."""

    def __init__(self, configured: int | str, ingress_replicas: int = 1,
                 clock: Callable[[], float] = time.monotonic, alpha: float = 0.05):
        self.configured = configured
        self.ingress_replicas = max(1, ingress_replicas)
        self.clock = clock
        self.alpha = alpha
        self.kv_tokens: int | None = None  # the decode pool's, at the last read
        self.request_tokens: float | None = None  # prompt + max_tokens, smoothed over admitted requests
        self.read_at = float("-inf")

    @property
    def auto(self) -> bool:
        return self.configured == "auto"

    def __call__(self) -> int:
        if not self.auto:
            return int(self.configured)
        if not self.kv_tokens or not self.request_tokens:
            return AUTO_UNMEASURED
        per_ingress = AUTO_HEADROOM * self.kv_tokens / self.request_tokens / self.ingress_replicas
        return max(AUTO_MIN, int(per_ingress))

    def admitted(self, tokens: int) -> None:
        if self.auto:
            r = self.request_tokens
            self.request_tokens = float(tokens) if r is None else (1 - self.alpha) * r + self.alpha * tokens

    def due(self) -> bool:
        """Time to read the decode pool's KV again (the caller reads it, then calls `kv_read`)."""
        return self.auto and self.clock() - self.read_at >= REFRESH_S

    def kv_read(self, kv_tokens: int | None) -> None:
        self.read_at = self.clock()
        if kv_tokens:
            self.kv_tokens = kv_tokens


class Capacity:
    """The refusals this ingress makes from its own measurements, before any work or actor call:
    a request the queue ahead of it would keep past the queue bound or past its deadline, or one
    that would take the decode pool past the streams it runs at the pace bound. Batch work is refused
    at `batch_share` of each bound: it is shed first.

    A bound left `auto` is relative (AdmissionBounds): never tighter than floor_multiple x what the
    deployment does at its own pace, and a request with at most one other ahead of it is never
    refused for the queue: a server that refuses its second user is not protected but unusable."""

    def __init__(self, bounds: AdmissionBounds, clock: Callable[[], float] = time.monotonic):
        self.bounds = bounds
        self.first_tokens = FirstTokenQueue(clock)  # the queue ahead of a new request
        # the streams past their first token, their token interval and the limit it sets
        self.pace = StreamPace(clock, target_itl_s=bounds.target_itl_s, floor_multiple=bounds.itl_floor_multiple,
                               steady=lambda: not self.growing())

    def growing(self) -> bool:
        """The load grows (FirstTokenQueue.growing) beyond what a closed loop of floor_multiple clients
        can offer at once: the relative bounds are off while it does."""
        return self.first_tokens.growing(at_least=max(1.0, self.bounds.queue_floor_multiple))

    def check(self, ctx: RequestContext) -> None:
        self.first_tokens.offered()
        refusal = self._refusal(ctx.priority == Priority.BATCH, ctx.remaining_s())
        if refusal is not None:
            raise refusal

    def shedding(self, in_transit: int = 0) -> Rejected | None:
        """The refusal any request would get now (an interactive one without a deadline gets the
        loosest bounds), behind `in_transit` requests let through that have not reached the check
        yet. It only reads, so the gRPC server's transport thread may ask it before a call reaches
        the front door's loop (api/grpc_server.py)."""
        return self._refusal(False, None, in_transit)

    def queue_bound_s(self, floor_s: float | None = None) -> float | None:
        """The longest predicted wait admitted now (None: off): max_queue_wait_s, or for `auto` the
        larger of it and floor_multiple x one request's own prompt time (`floor_s`; default: as this
        ingress measures it) while the queue is steady; a growing queue is held to max_queue_wait_s."""
        b = self.bounds
        floor = (floor_s or self.first_tokens.request_floor_s()) if b.queue_floor_multiple else None
        if b.max_queue_wait_s is None or floor is None or self.growing():
            return b.max_queue_wait_s
        return max(b.max_queue_wait_s, b.queue_floor_multiple * floor)

    def _refusal(self, batch: bool, remaining_s: float | None, in_transit: int = 0) -> Rejected | None:
        b, pace, q = self.bounds, self.pace, self.first_tokens
        share = b.batch_share if batch else 1.0
        cap = pace.cap()
        if cap is not None and pace.streams + q.ahead(in_transit) >= max(1, int(cap * share)):
            target = pace.target()
            bound = (f"target_itl_s {target:g}" if target == b.target_itl_s else
                     f"{target * 1e3:.0f} ms per token ({pace.floor_multiple:g}x its fastest, target_itl_s auto)")
            return Rejected(f"the decode pool is at the streams it runs at {bound} (measured {pace.itl_s * 1e3:.0f} "
                            f"ms per token over {pace.mean_streams:.1f} streams){' (batch share)' if batch else ''}: "
                            "overloaded", 1.0, reason="capacity")
        wait = q.predicted_wait_s(in_transit)
        if wait is None or (b.queue_floor_multiple and q.ahead(in_transit) <= 1):
            return None
        more = q.ahead(in_transit) - q.pending_requests
        ahead = (f" ({q.pending_tokens} prompt tokens of {q.pending_requests} requests ahead and {more} on their "
                 f"way, at {q.rate:.1f} tokens/s)" if q.rate else "")
        return self._queue_refusal(f"the ingress's queue{ahead}", wait, batch, remaining_s, self.queue_bound_s())

    def check_queue_wait(self, who: str, wait_s: float, ctx: RequestContext, ahead: int) -> None:
        """Refuse work that would wait longer than the server's bound (batch work: its batch_share
        of it) or the request's deadline: the router's prediction for the replica that will compute
        the prompt, behind `ahead` requests waiting there. With auto bounds its floor is its wait per
        request ahead, and one request ahead is never refused (as for this ingress's own queue)."""
        floor = None
        if self.bounds.queue_floor_multiple:
            floor = wait_s / ahead if ahead > 1 else None
            bound = self.queue_bound_s(floor) if ahead > 1 else None  # one ahead: the deadline only
        else:
            bound = self.bounds.max_queue_wait_s
        refusal = self._queue_refusal(who, wait_s, ctx.priority == Priority.BATCH, ctx.remaining_s(), bound, floor)
        if refusal is not None:
            raise refusal

    def _queue_refusal(self, who: str, wait_s: float, batch: bool, remaining_s: float | None,
                       bound: float | None, floor_s: float | None = None) -> Rejected | None:
        """`bound`: the queue bound in force (None: only the deadline); `floor_s`: the floor it was
        derived from, if not this ingress's own."""
        limit = None if bound is None else bound * (self.bounds.batch_share if batch else 1.0)
        if limit is not None and wait_s > limit:
            floor = floor_s or self.first_tokens.request_floor_s()
            name = (f"max_queue_wait_s {limit:g}" if bound == self.bounds.max_queue_wait_s else
                    f"the queue bound {limit:.2f} s ({self.bounds.queue_floor_multiple:g}x one request's own "
                    f"{floor:.2f} s, max_queue_wait_s auto)")
            return Rejected(f"{who}: predicted queue wait {wait_s:.2f} s exceeds {name}"
                            f"{' (batch share)' if batch else ''}: overloaded", wait_s - limit, reason="queue_wait")
        if remaining_s is not None and wait_s > remaining_s:
            return Rejected(f"{who}: predicted queue wait {wait_s:.2f} s exceeds the {remaining_s:.2f} s "
                            f"left before its deadline", wait_s, reason="queue_wait")
        return None


class CapacityStage(Stage):
    """This ingress's measured capacity (Capacity above): refuses before any work, refuses when
    the router's decision predicts too long a queue, keeps the request's place in the first-token
    queue until its first token, and counts its stream's pace."""

    def __init__(self, capacity: Capacity):
        self.capacity = capacity

    async def admit(self, o: Outcome) -> None:
        self.capacity.check(o.ctx)  # no await yet: a refusal here touched nothing
        o.place = self.capacity.first_tokens.reserve()  # ahead of every request checked from now on

    def started(self, o: Outcome) -> None:  # its flow starts: a response-cache hit's never does
        o.place.join(o.prepared.num_prompt_tokens)

    def routed(self, o: Outcome, decision, started: float, num_prompt_tokens: int, ctx: RequestContext) -> None:
        if decision is not None:
            self.capacity.check_queue_wait(f"request {o.rid}", decision.queue_wait_s, ctx, decision.queue_ahead)

    def first_token(self, o: Outcome, computed_tokens: int) -> None:
        o.place.done(computed_tokens)

    def delta(self, o: Outcome, d) -> None:
        if o.cache_hit:  # a replay: no place in the first-token queue, no stream for the pace
            return o.place.done()
        pace = self.capacity.pace
        if o.streaming:
            pace.tokens(len(d.token_ids))
            if d.finish_reason is not None:  # ended now, not when the client's side lets go
                pace.end()
                o.streaming = False
        elif d.finish_reason is None:
            pace.start()
            o.streaming = True

    def finish(self, o: Outcome, error: BaseException | None) -> None:
        if o.place is not None:
            o.place.done()  # no first token (refused, failed, cancelled): nothing measured
        if o.streaming:
            self.capacity.pace.end()
