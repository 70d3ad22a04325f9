"""Continuous batching with chunked prefill under a per-step token budget.

Each step schedules, in this order:
  1. every running request that is decoding (one token each),
  2. running requests part-way through their prompt (the rest of the budget, chunked),
  3. waiting requests, taking their cached prefix from the KV manager, in FairQueue order
     (interactive before batch, weighted fair across tenants, FCFS within a tenant); a tenant
     holding more than its KV budget (a fraction of the pool) waits while others are admitted.
So a long prompt never holds up running decodes for more than one step's chunk.

A waiting request whose prefix is in a lower KV tier (host, disk) is admitted to `loading`: its
blocks are allocated and copied in while the others step; a later step finds the copy done and
it runs from there, its prefix computed (or, if the copy failed, it goes back to the head of the
queue and recomputes). A request that needs a block another one is loading waits for it.

When blocks run out, a running request not yet scheduled in this step is preempted: the lowest
priority class first, then the most recently admitted (recompute: its blocks are freed and it
restarts from its prompt plus the tokens it has produced; its prefix usually comes back from
the cache).

Overload: the waiting queue is bounded (`add` raises QueueFullError), a request that waits in
the queue for `queue_ttl_s` is rejected, and any request past its deadline is stopped (`expire`).
The time-to-live counts the current wait: from arrival for a request never admitted, from the
moment it went back to the queue for one that did (preempted, or its import or tier load failed).
So a request is never rejected for the time it spent running, and a preempted one that does not
get its blocks back within the time-to-live ends ("rejected", with the tokens it already sent)
instead of waiting without a bound behind an overload.

The scheduler never touches tensors; it is tested with a KV manager and token ids alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cluster.errors import QueueFullError
from cluster.engine.fair_queue import FairQueue
from cluster.engine.kv_cache import KVCacheManager
from cluster.engine.kv_cache.manager import NO_PREFIX, cdiv
from cluster.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token position computed in this step
    num_tokens: int
    samples: bool  # the chunk reaches the end of the known tokens, so a token is sampled
    # Speculative decode: draft tokens computed after the request's last token. The model scores
    # all 1 + len(draft) positions; the accepted drafts and one more token are appended.
    draft: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_waiting: int | None = None,
        queue_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.kv = kv
        self.clock = clock  # monotonic, like Request.arrival_time: when a request goes back to the queue
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.queue_ttl_s = queue_ttl_s
        self.waiting = FairQueue()
        self.running: list[Request] = []
        self.importing: dict[str, Request] = {}  # WAITING_FOR_KV: blocks allocated, KV arriving
        self.loading: dict[str, Request] = {}  # WAITING_FOR_KV: its prefix copying in from a lower tier
        self.failed_import_loads: set[str] = set()  # importing requests whose own tier copy failed
        self.leased: dict[str, Request] = {}  # finished with keep_kv: blocks held until release()
        self.requests: dict[str, Request] = {}
        self._num_deadlines = 0  # requests in flight with a deadline (expire() skips work without)
        self._next_ttl_check = float("-inf")
        # Called with a request's id when it ends (any status, from any queue) or is preempted:
        # state kept beside its blocks (a draft model's KV, spec/draft.py) goes when they do.
        self.on_free: Callable[[str], None] | None = None

    # ---- admission and removal -------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting (max_waiting {self.max_waiting})")
        self._track(req)
        self.waiting.append(req)

    def _track(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.ctx.deadline is not None:
            self._num_deadlines += 1

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request at any moment (abort, stop string, error) and free its blocks.

        A request with keep_kv that ends normally keeps its blocks, leased, until release().
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.ctx.deadline is not None:
            self._num_deadlines -= 1
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif request_id in self.importing:
            del self.importing[request_id]
            self.failed_import_loads.discard(request_id)
        elif request_id in self.loading:
            del self.loading[request_id]
        else:
            self.waiting.remove(req)
        req.status = status
        if self.on_free is not None:
            self.on_free(request_id)
        if req.keep_kv and status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            self.leased[request_id] = req
        else:
            self.kv.free(request_id)
        return req

    def release(self, request_id: str) -> bool:
        """Free a leased request's blocks (transfer done or lease expired)."""
        if self.leased.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def add_importing(self, req: Request, hashes, num_tokens: int) -> int | None:
        """Admit a request whose first `num_tokens` tokens' KV will be pulled from a peer.

        Takes this engine's cached prefix (by hash) and allocates the rest. Returns how many
        leading blocks were already here, or None if the pool has no room (nothing changed).
        """
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        cached = self.kv.find_imported_prefix(hashes)
        if not self.kv.allocate_slots(req, num_tokens - len(cached) * self.kv.block_size, cached):
            return None
        req.status = RequestStatus.WAITING_FOR_KV
        req.num_cached_tokens = len(cached) * self.kv.block_size
        self._track(req)
        self.importing[req.request_id] = req
        return len(cached)

    def activate_imported(self, request_id: str, num_tokens: int, first_token: int) -> Request | None:
        """The KV has arrived: the request joins continuous batching after its first token."""
        req = self.importing.pop(request_id)
        req.num_computed_tokens = num_tokens
        self.kv.cache_blocks(req, num_tokens)
        req.append_token(first_token)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        status = req.check_stop(self.max_model_len)
        if status is not None:
            self.finish(request_id, status)
        return req

    def requeue_imported(self, request_id: str, first_token: int) -> Request:
        """The transfer failed: compute the prompt here instead (recompute), first token kept."""
        req = self.importing.pop(request_id)
        self.failed_import_loads.discard(request_id)
        self.kv.free(request_id)
        req.append_token(first_token)
        req.num_computed_tokens = 0
        self._requeue(req)
        self.waiting.append(req)
        return req

    def _requeue(self, req: Request) -> None:
        """Back to waiting (its blocks already freed): the queue time-to-live counts from now."""
        req.status = RequestStatus.WAITING
        req.requeued_at = self.clock()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def expire(self, now: float, now_mono: float) -> list[Request]:
        """Finish requests past their deadline (`now`, wall clock; waiting or running: a request
        importing KV is left to its transfer timeout) and requests that have waited in the queue
        for queue_ttl_s (`now_mono`, monotonic like arrival_time): since arrival, or since they
        went back to the queue (see the module docstring). Their blocks are freed."""
        expired = []
        if self._num_deadlines:
            for req in [*self.waiting, *self.running]:
                if req.ctx.deadline is not None and now >= req.ctx.deadline:
                    req.error = f"deadline exceeded after {req.num_output_tokens} output tokens"
                    expired.append(self.finish(req.request_id, RequestStatus.FINISHED_DEADLINE))
        if self.queue_ttl_s is not None and now_mono >= self._next_ttl_check:
            self._next_ttl_check = now_mono + min(0.1, self.queue_ttl_s / 10)  # not every step: it scans the queue
            cutoff = now_mono - self.queue_ttl_s
            for req in [r for r in self.waiting if _queued_since(r) <= cutoff]:
                req.error = (f"not admitted within the queue time-to-live ({self.queue_ttl_s:g} s): overloaded"
                             if req.requeued_at is None else
                             f"back in the queue after {req.num_output_tokens} output tokens (preempted) and not "
                             f"resumed within the queue time-to-live ({self.queue_ttl_s:g} s): overloaded")
                expired.append(self.finish(req.request_id, RequestStatus.FINISHED_REJECTED))
        return expired

    # ---- one step ----------------------------------------------------------------------------

    def _settle_loads(self) -> None:
        """Requests whose tier copy finished run from their loaded prefix; a failed copy requeues."""
        for rid, ok in self.kv.poll_loads():
            req = self.loading.pop(rid, None)
            if req is None:  # an importing request's own prefix: its activation waits for it
                if not ok:
                    self.failed_import_loads.add(rid)
                continue
            if ok:
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            else:
                self.kv.free(rid)
                req.num_computed_tokens = 0
                self._requeue(req)
                self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        """The step's chunks: the running requests first (decodes, then prompt chunks; a request
        that cannot get its blocks preempts the newest), then waiting ones admitted while the
        token budget, the batch and the pool allow."""
        out = SchedulerOutput()
        scheduled: set[str] = set()
        if self.loading or self.kv.num_loading:
            self._settle_loads()
        budget = self._schedule_running(out, self.max_num_batched_tokens, scheduled)
        self._admit_waiting(out, budget, scheduled)
        charge = self.waiting.charge
        for chunk in out.chunks:
            charge(chunk.request.ctx, chunk.num_tokens)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, scheduled: set[str]) -> int:
        """Chunks for the running requests (decodes first); the token budget left."""
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for r in self.running:
            left = r.num_tokens - r.num_computed_tokens
            if left == 1:
                decoding.append(r)
            elif left > 1:
                prefilling.append(r)
        running = RequestStatus.RUNNING
        kv = self.kv
        for i, req in enumerate(decoding + prefilling):
            if budget == 0:
                break
            if req.status is not running:  # preempted earlier in this loop
                continue
            if not req.draft_token_ids and i < len(decoding) and kv.allocate_slots(req, 1):
                # A plain decode with room (every block it needs held, or one free): the common case.
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, 1, True))
                scheduled.add(req.request_id)
                budget -= 1
                continue
            if req.draft_token_ids:
                # Drafts take only budget the remaining decodes do not need, and never preempt.
                draft = req.draft_token_ids[: max(0, budget - max(0, len(decoding) - i))]
                req.draft_token_ids = ()
                if draft and self.kv.allocate_slots(req, 1 + len(draft)):
                    out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, 1 + len(draft), True, draft))
                    scheduled.add(req.request_id)
                    budget -= 1 + len(draft)
                    continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, n, scheduled, out):
                continue
            out.chunks.append(self._chunk(req, req.num_computed_tokens, n))
            scheduled.add(req.request_id)
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, scheduled: set[str]) -> None:
        """Waiting requests admitted in queue order (each tenant's KV budget held) while the token
        budget, the batch and the pool allow, and no request was preempted this step."""
        over_budget: set[str] = set()
        held: dict[str, int] | None = None  # blocks per tenant, computed when a budget applies
        while budget > 0 and not out.preempted and len(self.running) + len(self.loading) < self.max_num_seqs:
            req = self.waiting.peek(over_budget)
            if req is None:
                break
            tenant = req.ctx.tenant
            if req.ctx.kv_budget < 1.0:
                held = held if held is not None else self._blocks_by_tenant()
                need = cdiv(req.num_tokens, self.kv.block_size)
                # a tenant holding nothing may always start one request (else a small budget starves it)
                if held.get(tenant, 0) and held[tenant] + need > req.ctx.kv_budget * self.kv.num_blocks:
                    over_budget.add(tenant)
                    continue
            # prompt logprobs need every prompt position's logits: nothing is taken from the cache
            cached = NO_PREFIX if req.prompt_logprobs is not None else self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            if self.kv.loads_conflict(cached):
                break  # another request is loading some of those blocks: wait for it, in order
            # a prefix copied in on the loader thread computes in a later step: no chunk now
            n = min(req.num_tokens - num_cached, budget) if self.kv.load_inline(cached) else 0
            if not self.kv.allocate_slots(req, n, cached):
                break
            self.waiting.remove(req)
            if held is not None:
                held[tenant] = held.get(tenant, 0) + len(self.kv.block_ids(req.request_id))
            req.num_computed_tokens = num_cached  # for a loading request: once its copy is done
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if self.kv.is_loading(req.request_id):  # on the loader thread, or an inline copy failed
                req.status = RequestStatus.WAITING_FOR_KV
                self.loading[req.request_id] = req
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, num_cached, n))
            scheduled.add(req.request_id)
            budget -= n

    def _blocks_by_tenant(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for req in [*self.running, *self.importing.values(), *self.loading.values()]:
            held[req.ctx.tenant] = held.get(req.ctx.tenant, 0) + len(self.kv.block_ids(req.request_id))
        return held

    @staticmethod
    def _chunk(req: Request, start: int, n: int) -> ScheduledChunk:
        return ScheduledChunk(req, start, n, start + n == req.num_tokens)

    def _allocate_or_preempt(
        self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput
    ) -> bool:
        while not self.kv.allocate_slots(req, n):
            # lowest class first, then the latest admitted; `req` itself only when its class is lowest
            candidates = [(r.ctx.priority, i, r) for i, r in enumerate(self.running)
                          if r.request_id not in scheduled and r is not req]
            victim = max([*candidates, (req.ctx.priority, -1, req)], key=lambda v: v[:2])[2]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        if self.on_free is not None:
            self.on_free(req.request_id)
        self._requeue(req)
        req.draft_token_ids = ()
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               accepted: Mapping[str, Sequence[int]] | None = None) -> list[Request]:
        """Apply one step's results. Returns the requests that finished in it. `accepted`: for a
        speculative chunk, its draft tokens the model accepted (a prefix of the draft), which
        come before the request's sampled token."""
        finished = []
        running = RequestStatus.RUNNING
        cache_blocks = self.kv.cache_blocks
        for chunk in out.chunks:
            req = chunk.request
            if req.status is not running:  # aborted while the step ran
                continue
            if chunk.draft:
                if self._update_speculative(req, (accepted or {}).get(req.request_id, ()),
                                            sampled[req.request_id]):
                    finished.append(req)
                continue
            req.num_computed_tokens += chunk.num_tokens
            cache_blocks(req, req.num_computed_tokens)
            if chunk.samples:
                req.append_token(sampled[req.request_id])
                status = req.check_stop(self.max_model_len)
                if status is not None:
                    self.finish(req.request_id, status)
                    finished.append(req)
        return finished

    def _update_speculative(self, req: Request, accepted: Sequence[int], token: int) -> bool:
        """The last token and the accepted drafts are now computed; the rejected drafts' slots go
        back (the request keeps the blocks a non-speculative decode would hold). Tokens are
        appended one at a time, each checked as a decode's would be: none after a stop."""
        computed = req.num_computed_tokens + 1 + len(accepted)
        status = None
        for t in (*accepted, token):
            req.append_token(t)
            status = req.check_stop(self.max_model_len)
            if status is not None:
                break
        req.num_computed_tokens = min(computed, req.num_tokens)
        self.kv.cache_blocks(req, req.num_computed_tokens)
        if status is not None:
            self.finish(req.request_id, status)
            return True
        self.kv.trim(req.request_id, req.num_computed_tokens)
        return False

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        holders = self.kv.holders()
        allowed = {r.request_id for r in self.running} | set(self.importing) | set(self.loading) | set(self.leased)
        if not holders <= allowed:
            raise AssertionError(f"blocks held by requests neither running, importing, loading nor leased: "
                                 f"{holders - allowed}")
        if not all(self.kv.is_loading(rid) for rid in self.loading):
            raise AssertionError("a loading request has no copy in progress")


def _queued_since(req: Request) -> float:
    """Where its current wait in the queue began (monotonic)."""
    return req.arrival_time if req.requeued_at is None else req.requeued_at
