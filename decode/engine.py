"""The decode role: import a request's prompt KV from a prefill engine, then decode it.

For each KVHandle: allocate blocks, reuse the prompt blocks this engine already holds in its own
prefix cache (by hash; its device pool, then its host and disk tiers, whose blocks are copied
in on the loader thread while the READ runs), pull only the missing ones with one NIXL READ, and when it completes the
request joins continuous batching after the first token (which prefill already sent). If the pull
fails or stalls past its timeout, the policy decides: "recompute" prefills the prompt here (same
output), "fail" ends the request with an error. Never a hang, never a leaked block.

KV safety:
- A handle whose lease has less than `min_lease_left_s` left is not pulled (prefill may reuse the
  blocks before the READ ends): the prompt is recomputed here, whatever the policy.
- Blocks that a READ may still write are never freed under it. When the request stops waiting for
  its READ (abort, failure, timeout that NIXL could not cancel) those blocks are quarantined and
  the transport keeps polling the READ (`abandon`); `service()` gives them back once it settled.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import DEFAULT_CONTEXT, RequestContext
from cluster.engine.sampling_params import SamplingParams
from kv_transfer.errors import IncompatiblePeerError, KVTransferError
from kv_transfer.handle import KVHandle
from kv_transfer.layout import engine_layout
from kv_transfer.transport import NixlTransport, PendingPull

log = logging.getLogger(__name__)

FailurePolicy = Literal["recompute", "fail"]


@dataclass
class _Import:
    handle: KVHandle
    pull: PendingPull | None  # None: nothing to pull (the whole prompt was cached here)
    targets: tuple[int, ...] = ()  # local blocks the READ writes


class DecodeEngine:
    def __init__(
        self,
        engine: LLMEngine,
        transport: NixlTransport,
        policy: FailurePolicy = "recompute",
        transfer_timeout_s: float = 10.0,
        min_lease_left_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        if policy not in ("recompute", "fail"):
            raise ValueError(f"policy must be 'recompute' or 'fail', got {policy!r}")
        self.engine = engine
        self.transport = transport
        self.policy = policy
        self.timeout_s = transfer_timeout_s
        # A pull may run for timeout_s: by default the lease must outlast that.
        self.min_lease_left_s = transfer_timeout_s if min_lease_left_s is None else min_lease_left_s
        self.clock = clock  # wall clock, compared with the prefill node's: NTP-synchronised clocks assumed
        self.layout = engine_layout(engine)
        self._imports: dict[str, _Import] = {}
        self._pending_outputs: list[RequestOutput] = []

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        handle: KVHandle | None = None,
        ctx: RequestContext = DEFAULT_CONTEXT,
        generated: Sequence[int] = (),
    ) -> None:
        """Queue a request. Without a handle its prompt is prefilled here; with one, its prompt KV
        is imported from the prefill engine that sampled its first token. `generated`: output
        tokens already sent to the client (a migrated request; no handle then): computed here
        after the prompt, and counted as the request's output (max_tokens, penalties). Raises
        InvalidRequestError (bad input), IncompatiblePeerError, QueueFullError."""
        req = self.engine.make_request(request_id, None, prompt_token_ids, sampling, ctx)
        if handle is None:
            if generated:
                if len(generated) >= sampling.max_tokens:
                    raise ValueError(f"{len(generated)} tokens already generated of max_tokens {sampling.max_tokens}")
                self.engine.add_after_tokens(req, self.engine.validator.check_token_ids(list(generated)))
            else:
                self.engine.add(req)
            return
        if handle.num_prompt_tokens != req.num_prompt_tokens:
            raise ValueError(f"handle covers {handle.num_prompt_tokens} tokens, prompt has {req.num_prompt_tokens}")
        self.layout.check_compatible(handle.kv_layout, f"engine {handle.engine_id}")
        lease_left = handle.lease_expiry - self.clock()  # two nodes' wall clocks: the margin covers skew
        if lease_left < self.min_lease_left_s:
            log.warning("lease of %s has %.2f s left (< min_lease_left_s %g); recomputing it here",
                        request_id, lease_left, self.min_lease_left_s)
            self.transport.stats.pulls_refused_lease += 1
            self.transport.stats.fallbacks_recompute += 1
            self.engine.add_after_first_token(req, handle.first_token)
            self.transport.notify_release(handle)
            return
        reused = self.engine.import_request(req, handle.block_hashes, handle.num_prompt_tokens, handle.first_token)
        if reused is None:  # no room now: queue it to be computed here when blocks free up
            log.info("no KV room to import %s; prefilling it locally", request_id)
            self.engine.add_after_first_token(req, handle.first_token)
            self.transport.notify_release(handle)
            return
        local = self.engine.block_ids(request_id)
        self.transport.stats.blocks_reused += reused
        pull = None
        targets = tuple(local[reused:len(handle.block_ids)])
        if reused < len(handle.block_ids):
            try:
                pull = self.transport.start_pull(
                    handle, list(handle.block_ids[reused:]), list(targets), self.timeout_s
                )
            except IncompatiblePeerError:
                self.engine.fail(request_id, "incompatible KV peer")
                raise
            except KVTransferError as e:
                self.transport.stats.pulls_failed += 1
                self._on_failure(request_id, handle, str(e))
                return
        self._imports[request_id] = _Import(handle, pull, targets)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, imp in list(self._imports.items()):
            if self.engine.import_loading(rid):  # its prefix from this engine's own tiers: not yet
                continue
            try:
                done = imp.pull is None or self.transport.poll(imp.pull)
            except KVTransferError as e:
                del self._imports[rid]
                token = self._quarantine_unsettled(rid, imp)  # before the failure frees the rest
                self._on_failure(rid, imp.handle, str(e), read_settled=not token)
                continue
            if done:
                del self._imports[rid]
                if imp.pull is None:
                    self.transport.notify_release(imp.handle)
                if self.engine.import_load_failed(rid):  # the pulled part arrived, the local part did not
                    # (prefill was told either way: the READ's own notification, or the release above)
                    log.warning("KV tier load for %s failed; recomputing the prompt locally", rid)
                    self.engine.requeue(rid, imp.handle.first_token)
                    self.transport.stats.fallbacks_recompute += 1
                    continue
                final = self.engine.activate(rid, imp.handle.num_prompt_tokens, imp.handle.first_token)
                if final is not None:  # max_tokens == 1 or the first token stops it
                    outputs.append(final)
        outputs += self._pending_outputs  # requests failed outside a step (policy "fail")
        self._pending_outputs = []
        return outputs + self.engine.step()

    def _quarantine_unsettled(self, rid: str, imp: _Import) -> int:
        """If the READ may still write the request's blocks, quarantine them and leave the READ
        to the transport until it settles. Returns the quarantine token (0: nothing unsettled)."""
        if imp.pull is None or imp.pull.settled:
            return 0
        token = self.engine.quarantine(rid, imp.targets)
        if token:
            self.transport.abandon(imp.pull, token)
        return token

    def service(self) -> None:
        """Every loop turn: completed READs' leases are ended (prefill is told); abandoned READs
        that settled give their quarantined blocks back."""
        self.transport.send_notices()
        for token in self.transport.poll_abandoned():
            self.engine.release_quarantine(token)

    def _on_failure(self, request_id: str, handle: KVHandle, why: str, read_settled: bool = True) -> None:
        if self.policy == "recompute":
            log.warning("KV pull for %s failed (%s); recomputing the prompt locally", request_id, why)
            self.engine.requeue(request_id, handle.first_token)
            self.transport.stats.fallbacks_recompute += 1
        else:
            log.warning("KV pull for %s failed (%s); failing the request", request_id, why)
            self._pending_outputs.append(self.engine.fail(request_id, f"KV transfer failed: {why}"))
        self.transport.notify_release(handle, read_settled)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request. If its READ is in flight, the blocks it writes stay quarantined until
        the transport sees it settle (never freed under it)."""
        imp = self._imports.pop(request_id, None)
        token = 0 if imp is None else self._quarantine_unsettled(request_id, imp)
        out = self.engine.abort(request_id)
        if imp is not None:
            self.transport.notify_release(imp.handle, read_settled=not token)
        return out

    def has_unfinished(self) -> bool:
        return bool(self._imports or self._pending_outputs) or self.engine.has_unfinished()

    def in_flight(self) -> int:
        """Streams this role holds: waiting, importing their KV, or decoding."""
        return sum(self.engine.queue_shape())

    def drained(self) -> bool:
        """Nothing left of this role's work: no stream, no abandoned READ still writing our blocks,
        no "done" notice unsent (a role flip may replace it; prefill's loop still pushes the
        notices already sent)."""
        t = self.transport
        return not self.has_unfinished() and t.num_abandoned == 0 and t.unsent_notices == 0
