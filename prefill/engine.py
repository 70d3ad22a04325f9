"""The prefill role: compute a prompt, sample its first token, hold its blocks under a lease.

The lease ends when the decode side's READ completes (its "done" notification arrives): the
blocks go back to the pool at once (and stay in the prefix cache until reused). A lease that ends
any other way (it expired, the ingress released it, a decode engine gave up on a READ that may
still be running) keeps its blocks quarantined for `release_grace_s` more: a decode may still be
reading them, and must never read blocks already given to another request. Quarantined blocks
stay in the prefix cache (a hit only reads them); they are just not allocated.

With a host tier registered for peers (kv_tiers.lease_from_host) a lease's full prompt blocks
are served from the host tier instead: written there (unless already held), pinned, and their
device blocks given back to the pool at once, so only the partial last block holds device
memory while decode pulls. The host pins end when the lease (and its grace) does.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Callable, Sequence

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import FinishReason
from cluster.engine.request import DEFAULT_CONTEXT, Request, RequestContext
from cluster.engine.sampling_params import SamplingParams
from kv_transfer.handle import KVHandle
from kv_transfer.layout import engine_layout
from kv_transfer.transport import NixlTransport
from prefill.result import PrefillResult


class PrefillEngine:
    def __init__(
        self,
        engine: LLMEngine,
        transport: NixlTransport,
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        release_grace_s: float = 2.0,
    ):
        self.engine = engine
        self.transport = transport
        self.lease_s = lease_s
        self.release_grace_s = release_grace_s
        self.clock = clock
        self.layout = engine_layout(engine)
        self._leases: dict[str, float] = {}  # request id -> expiry (clock time)
        # an ended lease's blocks a READ may still read: key -> (when they may be reused (clock
        # time), quarantine token of its device blocks or 0, its pinned host hashes)
        self._grace: dict[int, tuple[float, int, list]] = {}
        self._grace_keys = itertools.count(1)
        self._host_pins: dict[str, list] = {}  # request id -> hashes its lease pins in the host tier
        self.from_host = transport.host_num_blocks > 0
        if self.from_host and engine.host_arena() is None:
            raise ValueError("the transport serves a host arena but the engine's kv_tiers.lease_from_host is off")
        self._max_tokens: dict[str, int] = {}  # the whole request's, while its prefill runs

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
               ctx: RequestContext = DEFAULT_CONTEXT) -> None:
        """Queue a prefill. Its first token is sampled with the request's own sampling params."""
        first_only = replace(sampling, max_tokens=1, min_tokens=0)
        req = self.engine.make_request(request_id, None, prompt_token_ids, first_only, ctx)
        self.engine.check_length(req.num_prompt_tokens, sampling.max_tokens)  # the whole request
        self.engine.add(req, hold_kv=True)
        self._max_tokens[request_id] = sampling.max_tokens

    def step(self) -> list[PrefillResult]:
        self.service_leases()
        results = []
        for out in self.engine.step():
            if not out.finished:
                continue
            held = self.engine.held(out.request_id)
            max_tokens = self._max_tokens.pop(out.request_id, 0)
            first_lp = out.logprobs[0] if out.logprobs else None
            if held is None:  # error or abort: nothing held
                results.append(PrefillResult(out.request_id, None, out.finish_reason, out.error,
                                             error_kind=out.error_kind))
            elif out.finish_reason == FinishReason.STOP or max_tokens == 1:
                # The first token already ends the request (EOS, stop token, max_tokens=1).
                self.engine.release(out.request_id)
                results.append(PrefillResult(out.request_id, None, out.finish_reason, None,
                                             out.token_ids[0], out.num_cached_tokens, first_logprob=first_lp,
                                             prompt_logprobs=out.prompt_logprobs))
            else:
                handle = self._lease(held)
                results.append(PrefillResult(out.request_id, handle, None, None, handle.first_token,
                                             out.num_cached_tokens, first_logprob=first_lp,
                                             prompt_logprobs=out.prompt_logprobs))
        return results

    def _lease(self, req: Request) -> KVHandle:
        # Wall-clock time, read by decode on another node: clocks must be synchronised (NTP), and
        # decode keeps a margin (kv_transfer.min_lease_left_s) on top; the grace after expiry
        # covers what skew is left.
        expiry = self.clock() + self.lease_s
        self._leases[req.request_id] = expiry
        self.transport.stats.leases_granted += 1
        block_ids = self.engine.block_ids(req.request_id)
        served = self.engine.lease_from_host(req) if self.from_host else None
        if served is not None:
            block_ids, self._host_pins[req.request_id] = served
            self.transport.stats.leases_from_host += 1
        return KVHandle(
            request_id=req.request_id,
            engine_id=self.transport.engine_id,
            incarnation=self.transport.incarnation,
            agent_name=self.transport.agent_name,
            block_ids=tuple(block_ids),
            block_hashes=tuple(self.engine.full_block_hashes(req)),
            num_prompt_tokens=req.num_prompt_tokens,
            first_token=req.output_token_ids[0],
            kv_layout=self.layout,
            lease_expiry=expiry,
        )

    def prefill(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> PrefillResult:
        """Synchronous convenience: submit and step until this request is done."""
        self.submit(request_id, prompt_token_ids, sampling)
        while True:
            for r in self.step():
                if r.request_id == request_id:
                    return r

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def service(self) -> None:
        self.service_leases()
        self.transport.progress_notices()  # a replica that decoded before its role flipped: its last notices

    def in_flight(self) -> int:
        """Requests this role holds: prefilling (waiting or running) or leased to a decode engine."""
        waiting, running, _ = self.engine.queue_shape()
        return waiting + running + len(self._leases)

    def drained(self) -> bool:
        """Nothing left of this role's work: no prefill, no lease, no ended lease's blocks in
        grace (a role flip may replace it; the blocks it frees stay in the prefix cache)."""
        return not self.engine.has_unfinished() and not (self._leases or self._grace or self._host_pins)

    def service_leases(self) -> None:
        """Release leases whose transfer completed, expire overdue ones, end finished graces."""
        notices = self.transport.lease_notices()
        for rid in notices.done:
            if self._leases.pop(rid, None) is not None and self.engine.release(rid):
                self._unpin(rid)
                self.transport.stats.leases_released += 1
        for rid in notices.released:
            if self._leases.pop(rid, None) is not None:
                self._end_lease(rid)
                self.transport.stats.leases_released += 1
        now = self.clock()
        for rid, expiry in list(self._leases.items()):
            if now >= expiry:
                del self._leases[rid]
                self._end_lease(rid)
                self.transport.stats.leases_expired += 1
        for key, (until, token, hashes) in list(self._grace.items()):
            if now >= until:
                del self._grace[key]
                self.transport.stats.grace_blocks_released += self.engine.release_quarantine(token)
                if hashes:
                    self.engine.unpin_host(hashes)

    def _unpin(self, rid: str) -> None:
        hashes = self._host_pins.pop(rid, None)
        if hashes:
            self.engine.unpin_host(hashes)

    def _end_lease(self, rid: str) -> None:
        """A lease ended without a completed READ: its blocks (device and host) wait out the grace period."""
        token = self.engine.quarantine(rid)
        self.engine.release(rid)
        hashes = self._host_pins.pop(rid, [])
        if token or hashes:
            self._grace[next(self._grace_keys)] = (self.clock() + self.release_grace_s, token, hashes)

    def abort(self, request_id: str) -> PrefillResult | None:
        """Stop a prefill, or end its lease early (with the grace period: a decode may already be
        reading). Returns the terminal result if it was running."""
        out = self.engine.abort(request_id)
        self._max_tokens.pop(request_id, None)
        if self._leases.pop(request_id, None) is not None:
            self._end_lease(request_id)
        return None if out is None else PrefillResult(request_id, None, out.finish_reason)

    def release_all(self) -> None:
        """End every lease and grace now (benchmarks between rounds, with no transfer in flight)."""
        for rid in list(self._leases):
            del self._leases[rid]
            self.engine.release(rid)
            self._unpin(rid)
        for key, (_, token, hashes) in list(self._grace.items()):
            del self._grace[key]
            self.engine.release_quarantine(token)
            if hashes:
                self.engine.unpin_host(hashes)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_in_grace(self) -> int:
        """Ended leases whose blocks are still quarantined."""
        return len(self._grace)
