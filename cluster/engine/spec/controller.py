"""When to speculate, and how far: the engine calls `propose` before each schedule and `observe`
after each update.

- A request speculates only when its sampling runs on the plain path: logit_bias, penalties,
  logprobs and response_format (grammar) turn speculation off for it, once, counted by reason
  (their state advances token by token; verifying them exactly would need each draft position's
  own counts, bias rows, grammar state and logprobs). Temperature, top_k, top_p, min_p and seeds
  are exact under speculation (cluster/engine/spec/verify.py).
- k per request follows its recent acceptance rate r (an EWMA over verified steps): with i.i.d.
  acceptance the expected run of accepted drafts is r / (1 - r), so k = 1 + floor(r / (1 - r)),
  capped at options.k. A request whose r falls below options.min_acceptance stops speculating
  for 16 output tokens, then 32, 64, ... (up to 1024), and tries again: a workload with nothing
  to copy costs a few verify steps per pause. A good run (r >= 0.6) resets the pause length.
- Drafts must pay at the current decode batch (cluster/engine/spec/cost.py): of the step's
  candidate drafts (request i's j-th accepted with probability r_i^j) it verifies the n most
  likely, n chosen for the most tokens a second from the replica's measured step times by rows
  computed. A request not verified yet counts at no more than the replica's recent acceptance
  over all requests (`prior_acceptance`). A step that leaves any candidate request without drafts
  counts off reason "cost".
- The replica does not speculate while more than options.max_batch requests are decoding: a
  large batch is compute-bound and drafts then cost more than they save.
- Drafts never exceed what the request may still emit (max_tokens, the context length), and
  the scheduler gives them only budget the other decodes do not need.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Iterable

from cluster.engine.config import SpeculativeOptions
from cluster.engine.outputs import EngineStats
from cluster.engine.request import Request
from cluster.engine.scheduler import SchedulerOutput
from cluster.engine.spec.cost import StepCosts, draft_probabilities
from cluster.engine.spec.proposer import Proposer
from cluster.engine.spec.state import SpecState

EWMA = 0.3  # weight of the latest verified step in the acceptance rate
START_ACCEPTANCE = 0.8  # optimistic: a new request starts at the full k
PRIOR_EWMA = 0.05  # weight of the latest verified step in the replica's acceptance (the prior)
RESUME_ACCEPTANCE = 0.45  # after a pause, one more bad step pauses it again
MIN_STEPS = 3  # verified steps before a request may be paused
PAUSE_TOKENS = 16
MAX_PAUSE_DOUBLINGS = 6


def off_reason(req: Request) -> str | None:
    """Why this request's sampling cannot speculate, or None."""
    sp = req.sampling
    if sp.response_format is not None:
        return "grammar"
    if sp.logprobs is not None:
        return "logprobs"
    if sp.penalized:
        return "penalties"
    if sp.logit_bias:
        return "logit_bias"
    return None


class Speculator:
    def __init__(self, options: SpeculativeOptions, proposer: Proposer, stats: EngineStats, max_model_len: int):
        self.options = options
        self.proposer = proposer
        self.stats = stats
        self.max_model_len = max_model_len
        self.costs = StepCosts()
        # The replica's recent acceptance over all requests: what the cost plan expects of a request
        # not verified yet (its own rate starts optimistic, for k), so that where drafts are mostly
        # rejected a stream of new requests does not pay a verify step each to find out again.
        self.prior_acceptance = START_ACCEPTANCE
        self._propose_s = 0.0  # the last propose() call's time, counted in its step's cost
        self._asked: list[Request] = []  # the requests the proposer drafted for in that call

    def propose(self, running: Iterable[Request]) -> None:
        """Set this step's drafts on the decoding requests that speculate."""
        self._propose_s = 0.0
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens
                    and not r.keep_kv]
        if not decoding:
            return
        if len(decoding) > self.options.max_batch:
            self._count_off("batch")
            return
        t0 = time.perf_counter()
        cands: list[tuple[Request, int]] = []
        for req in decoding:
            state = req.spec or self._start(req)
            if state.off_reason is not None or req.num_output_tokens < state.paused_until:
                continue
            sp = req.sampling
            room = min(sp.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            k = min(state.k, room)
            if k > 0:
                cands.append((req, k))
        asks = cands
        if cands and self.options.cost_model == "measured":  # the n most likely drafts, n from step costs
            rates = [req.spec.acceptance if req.spec.verified_steps else min(req.spec.acceptance, self.prior_acceptance)
                     for req, _ in cands]
            best = draft_probabilities(rates, [k for _, k in cands])
            n = self.costs.plan(len(decoding), [p for p, _ in best])
            take = Counter(i for _, i in best[:n])
            asks = [(req, take[i]) for i, (req, _) in enumerate(cands) if take[i]]
            if len(asks) < len(cands):
                self._count_off("cost")
        self._asked = [req for req, _ in asks]
        if asks:  # one call for the step: a draft model batches its forwards across the requests
            for (req, _), draft in zip(asks, self.proposer.propose_batch(asks)):
                req.draft_token_ids = draft
        self._propose_s = time.perf_counter() - t0
        self.stats.spec_proposer_s += self._propose_s

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's time, for the cost model: decode-only steps (no prompt tokens) only. The
        proposer's time before the step counts in it: a draft model's forwards are part of
        what drafts cost (an n-gram lookup's are next to nothing)."""
        propose_s, self._propose_s = self._propose_s, 0.0
        if all(c.num_tokens == 1 + len(c.draft) and c.start >= c.request.num_prompt_tokens for c in out.chunks):
            self.costs.observe(len(out.chunks), out.num_tokens, seconds + propose_s)

    def release(self, request_id: str) -> None:
        """The request left the engine (or was preempted): the proposer frees what it holds for it."""
        self.proposer.release(request_id)

    def observe(self, out: SchedulerOutput, accepted: dict[str, tuple[int, ...]]) -> None:
        """Acceptance of this step's verified drafts: counters, then each request's k and pause.
        First the proposer rolls back what it holds past each asked request's tokens."""
        asked, self._asked = self._asked, []
        for req in asked:
            if not req.status.finished:
                self.proposer.rollback(req)
        st = self.stats
        for chunk in out.chunks:
            if not chunk.draft or chunk.request.request_id not in accepted:
                continue  # no drafts, or the request failed
            req, proposed, a = chunk.request, len(chunk.draft), len(accepted[chunk.request.request_id])
            st.spec_steps += 1
            st.spec_proposed_tokens += proposed
            st.spec_accepted_tokens += a
            state = req.spec
            self.prior_acceptance = (1 - PRIOR_EWMA) * self.prior_acceptance + PRIOR_EWMA * a / proposed
            r = state.acceptance = (1 - EWMA) * state.acceptance + EWMA * a / proposed
            state.verified_steps += 1
            state.k = max(1, min(self.options.k, 1 + int(r / (1 - r)) if r < 1 else self.options.k))
            if r >= 0.6:
                state.pauses = 0
            elif r < self.options.min_acceptance and state.verified_steps >= MIN_STEPS:
                state.paused_until = req.num_output_tokens + PAUSE_TOKENS * 2 ** min(state.pauses, MAX_PAUSE_DOUBLINGS)
                state.pauses += 1
                state.acceptance, state.verified_steps = RESUME_ACCEPTANCE, MIN_STEPS - 1
                self._count_off("low_acceptance")

    def _start(self, req: Request) -> SpecState:
        reason = off_reason(req)
        if reason is not None:
            self._count_off(reason)
        req.spec = SpecState(k=self.options.k, off_reason=reason, acceptance=START_ACCEPTANCE)
        return req.spec

    def _count_off(self, reason: str) -> None:
        self.stats.spec_off[reason] = self.stats.spec_off.get(reason, 0) + 1
