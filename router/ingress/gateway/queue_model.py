"""The ingress's own model of the queue in front of the pools (`FirstTokenQueue`), for refusing
work at once; the wait it predicts and the rate it measures are the load model's
(router/load_model.py), as the router's, the planner's and the autoscaler's are.

A request admitted here waits for its first token behind the prompt tokens of every request this
ingress admitted earlier that has no first token yet. So the predicted wait of a new request is

    pending prompt tokens / the rate at which the pools turn prompt tokens into first tokens

and both numbers live here: `pending` moves with every admission and first token (exact, no
report lag), and the rate is measured from the first tokens themselves, over the time the queue
was not empty (a backlogged pool's throughput). Requests already let through but not yet in the
queue count at the mean prompt length of the admitted ones: those reserved (checked, being
tokenized) and, asked by the gRPC server, the calls whose work has not started on the front door's
loop yet (api/grpc_server.py). So a request arriving in a burst is refused on arrival by the same
bound it would meet at the front door, instead of waiting in line for the front door to refuse it.
No actor call, no replica report: under a burst the prediction includes every request admitted a
millisecond ago, where a model fed by the replicas' load reports (every 0.25 s, through the router)
would see a queue that is seconds old.

With several ingress replicas each sees its share of the traffic (Serve's proxy spreads it) and
of the throughput, so the ratio holds without coordination.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from router import load_model

MIN_SAMPLE_S = 0.5  # busy time per rate sample: shorter samples are one chunk's noise
WARM_SAMPLES = 2  # rate samples before the first-token queue predicts (the rate starts at their largest)
ERRORS_KEPT = 2048  # the latest requests whose prediction is compared with what happened
MEAN_ALPHA = 0.05  # smoothing of the admitted requests' mean prompt length
GROWTH_TAU_S = 2.0  # arrivals and departures are counted with this decay...
GROWING_AT = 1.5  # ...and the queue grows while requests arrive this many times faster than they leave it


class Meter:
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


class FirstTokenQueue(Meter):
    """The queue ahead of a new request's first token and the rate it drains at.

    The rate is unknown (no prediction, no refusal) until WARM_SAMPLES samples were taken, and
    starts at the largest of them. A fresh ingress's first sample times its own warm-up (its first
    calls to the router and the pools: 3 s for a replica Serve started after another was killed),
    not the pools' throughput: taken alone, it once set a rate of 0.7 prompt tokens/s where the
    pools ran 270, and the ingress refused 16 two-token requests for a predicted 60 s wait.
    Later samples are smoothed, so one stall moves the rate by at most `alpha` (the load model's
    `RateMeter`, as every controller measures a rate; its queue wait is `load_model.queue_wait_s`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, alpha: float = 0.3):
        super().__init__(clock, alpha)
        # prompt tokens per second while backlogged (the load model's meter: None until WARM_SAMPLES)
        self.meter = load_model.RateMeter(alpha, warm=WARM_SAMPLES)
        self.pending_tokens = 0
        self.pending_requests = 0
        self.reserved = 0  # requests checked and let through, not yet in the queue (being tokenized)
        self.mean_tokens: float | None = None  # prompt tokens per admitted request, smoothed (alpha MEAN_ALPHA)
        self._busy_s = 0.0  # backlogged time in the current sample
        self._done_tokens = 0  # prompt tokens computed in the current sample
        self.errors: deque[float] = deque(maxlen=ERRORS_KEPT)  # actual - predicted time to first token (s)
        self._arrived = self._left = 0.0  # requests into and out of the queue, decayed (GROWTH_TAU_S)
        self._counted_at = self._last

    @property
    def rate(self) -> float | None:
        return self.meter.value

    @rate.setter
    def rate(self, value: float | None) -> None:  # a test's or an operator's known rate
        self.meter.value = value

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
        return load_model.request_floor_s(self.mean_tokens, self.rate)

    def predicted_wait_s(self, in_transit: int = 0) -> float | None:
        """Seconds before a request admitted now starts its prompt; None while the rate is unknown.
        The requests reserved and `in_transit` (let through, not yet here) count at the mean length."""
        tokens = self.pending_tokens + max(0, self.reserved + in_transit) * (self.mean_tokens or 0.0)
        return load_model.queue_wait_s(tokens, self.rate)

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
        p.predicted_s = load_model.queue_wait_s(self.pending_tokens, self.rate, n=tokens)  # the queue, then its own
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
                self.meter.add(self._done_tokens / self._busy_s)
                self._busy_s, self._done_tokens = 0.0, 0

    def _advance(self) -> None:
        dt = self._tick()
        if self.pending_requests > 0:
            self._busy_s += dt
