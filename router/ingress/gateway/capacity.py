"""The refusals this ingress makes from its own measurements (`Capacity`, `CapacityStage`): the
queue ahead of a new request's first token (`FirstTokenQueue`, queue_model.py, reading the load
model) and the decode pool's pace (`StreamPace`, pace.py); `InflightCap` sizes
admission.max_inflight "auto" from the decode pool's KV.
"""

from __future__ import annotations

import time
from typing import Callable

from cluster.config import AdmissionBounds
from cluster.engine.request import Priority, RequestContext
from router.ingress.gateway.pace import SLOW_WINDOWS, StreamPace  # noqa: F401 (SLOW_WINDOWS: read by tests)
from router.ingress.gateway.queue_model import MIN_SAMPLE_S, WARM_SAMPLES, FirstTokenQueue  # noqa: F401
from router.ingress.gateway.stages import Outcome, Stage
from router.ingress.status import Rejected

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
        yet. It only reads, so the gRPC server may ask it before a call's work starts (with two
        loops, from the transport's thread; api/grpc_server.py)."""
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
        if o.streaming is not None:
            pace.tokens(len(d.token_ids), o.streaming)
            if d.finish_reason is not None:  # ended now, not when the client's side lets go
                pace.end(o.streaming)
                o.streaming = None
        elif d.finish_reason is None:
            o.streaming = pace.start()  # at its first token: its own pace counts from here

    def finish(self, o: Outcome, error: BaseException | None) -> None:
        if o.place is not None:
            o.place.done()  # no first token (refused, failed, cancelled): nothing measured
        if o.streaming is not None:
            self.capacity.pace.end(o.streaming)
            o.streaming = None
