"""The decode pool's Serve deployment: one DecodeEngine per replica, driven by its own loop."""

from __future__ import annotations

from typing import AsyncIterator, Sequence

from cluster.engine.outputs import RequestOutput, merge_outputs
from cluster.serving.replica import EngineReplica
from cluster.engine.request import DEFAULT_CONTEXT, RequestContext
from cluster.engine.sampling_params import SamplingParams
from decode.engine import DecodeEngine
from kv_transfer.handle import KVHandle


class DecodeServer(EngineReplica):
    pool = "decode"
    idle_poll_s = 1.0

    def make_role(self, engine, transport, config) -> DecodeEngine:
        kv = config.kv_transfer
        return DecodeEngine(engine, transport, policy=kv.failure_policy, transfer_timeout_s=kv.timeout_s,
                            min_lease_left_s=kv.min_lease_left_s)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        kv_handle: KVHandle | None,
        ctx: RequestContext = DEFAULT_CONTEXT,
        target_replica: str | None = None,  # read by the request router that brought the call here
        generated: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas. With a KV handle the prompt's KV is pulled from prefill
        (the first token was already sent); without one the prompt is prefilled here, after it
        the `generated` tokens (a migrated request's, already sent). Deltas that queue while the
        caller is busy are merged into one message."""
        self.arrived(target_replica)
        if self.faults is not None and self.faults.fails_request():
            raise RuntimeError(f"request {request_id}: failed by fault injection (fail_requests)")

        def submit():
            self.role.submit(request_id, prompt_token_ids, sampling, kv_handle, ctx, generated)

        async for out in self.loop.stream(request_id, submit, merge=merge_outputs):
            yield out
