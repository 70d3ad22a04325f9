"""The decode role: import a request's prompt KV from a prefill engine, then decode it.

For each KVHandle: allocate blocks, reuse the prompt blocks this engine already holds in its own
prefix cache (by hash), pull only the missing ones with one NIXL READ, and when it completes the
request joins continuous batching after the first token (which prefill already sent). If the pull
fails or stalls past its timeout, the policy decides: "recompute" prefills the prompt here (same
output), "fail" ends the request with an error. Never a hang, never a leaked block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Sequence

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


class DecodeEngine:
    def __init__(
        self,
        engine: LLMEngine,
        transport: NixlTransport,
        policy: FailurePolicy = "recompute",
        transfer_timeout_s: float = 10.0,
    ):
        if policy not in ("recompute", "fail"):
            raise ValueError(f"policy must be 'recompute' or 'fail', got {policy!r}")
        self.engine = engine
        self.transport = transport
        self.policy = policy
        self.timeout_s = transfer_timeout_s
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
    ) -> None:
        """Queue a request. Without a handle its prompt is prefilled here; with one, its prompt KV
        is imported from the prefill engine that sampled its first token. Raises
        InvalidRequestError (bad input), IncompatiblePeerError, QueueFullError."""
        req = self.engine.make_request(request_id, None, prompt_token_ids, sampling, ctx)
        if handle is None:
            self.engine.add(req)
            return
        if handle.num_prompt_tokens != req.num_prompt_tokens:
            raise ValueError(f"handle covers {handle.num_prompt_tokens} tokens, prompt has {req.num_prompt_tokens}")
        self.layout.check_compatible(handle.kv_layout, f"engine {handle.engine_id}")
        reused = self.engine.import_request(req, handle.block_hashes, handle.num_prompt_tokens, handle.first_token)
        if reused is None:  # no room now: queue it to be computed here when blocks free up
            log.info("no KV room to import %s; prefilling it locally", request_id)
            self.engine.add_after_first_token(req, handle.first_token)
            self.transport.notify_release(handle)
            return
        local = self.engine.block_ids(request_id)
        self.transport.stats.blocks_reused += reused
        pull = None
        if reused < len(handle.block_ids):
            try:
                pull = self.transport.start_pull(
                    handle, list(handle.block_ids[reused:]), local[reused:], self.timeout_s
                )
            except IncompatiblePeerError:
                self.engine.fail(request_id, "incompatible KV peer")
                raise
            except KVTransferError as e:
                self.transport.stats.pulls_failed += 1
                self._on_failure(request_id, handle, str(e))
                return
        self._imports[request_id] = _Import(handle, pull)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, imp in list(self._imports.items()):
            try:
                done = imp.pull is None or self.transport.poll(imp.pull)
            except KVTransferError as e:
                del self._imports[rid]
                self._on_failure(rid, imp.handle, str(e))
                continue
            if done:
                del self._imports[rid]
                if imp.pull is None:
                    self.transport.notify_release(imp.handle)
                final = self.engine.activate(rid, imp.handle.num_prompt_tokens, imp.handle.first_token)
                if final is not None:  # max_tokens == 1 or the first token stops it
                    outputs.append(final)
        outputs += self._pending_outputs  # requests failed outside a step (policy "fail")
        self._pending_outputs = []
        return outputs + self.engine.step()

    def _on_failure(self, request_id: str, handle: KVHandle, why: str) -> None:
        if self.policy == "recompute":
            log.warning("KV pull for %s failed (%s); recomputing the prompt locally", request_id, why)
            self.engine.requeue(request_id, handle.first_token)
            self.transport.stats.fallbacks_recompute += 1
        else:
            log.warning("KV pull for %s failed (%s); failing the request", request_id, why)
            self._pending_outputs.append(self.engine.fail(request_id, f"KV transfer failed: {why}"))
        self.transport.notify_release(handle)

    def abort(self, request_id: str) -> RequestOutput | None:
        imp = self._imports.pop(request_id, None)
        out = self.engine.abort(request_id)
        if imp is not None:
            self.transport.notify_release(imp.handle)
        return out

    def has_unfinished(self) -> bool:
        return bool(self._imports or self._pending_outputs) or self.engine.has_unfinished()
