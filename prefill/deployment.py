"""The prefill pool's Serve deployment: one PrefillEngine per replica, driven by its own loop."""

from __future__ import annotations

from typing import Sequence

from cluster.serving.replica import EngineReplica
from cluster.engine.request import DEFAULT_CONTEXT, RequestContext
from cluster.engine.sampling_params import SamplingParams
from prefill.engine import PrefillEngine
from prefill.result import PrefillResult


class PrefillServer(EngineReplica):
    pool = "prefill"
    idle_poll_s = 0.05  # idle wake-ups serve lease expiry and completion notifications

    def make_role(self, engine, transport, config) -> PrefillEngine:
        kv = config.kv_transfer
        return PrefillEngine(engine, transport, lease_s=kv.lease_s, release_grace_s=kv.release_grace_s)

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                      ctx: RequestContext = DEFAULT_CONTEXT, target_replica: str | None = None) -> PrefillResult:
        """Prefill and hold the blocks; cancelling this call aborts the prefill.
        (`target_replica` is read by the request router that brought the call here.)"""
        self.arrived(target_replica)
        stream = self.loop.stream(
            request_id, lambda: self.role.submit(request_id, prompt_token_ids, sampling, ctx))
        try:
            async for result in stream:
                return result
        finally:
            await stream.aclose()
        raise RuntimeError(f"prefill stream for {request_id} ended without a result")

    async def release(self, request_id: str, target_replica: str | None = None) -> None:
        """End a lease early (the request was cancelled before decode pulled it); its blocks
        wait out kv_transfer.release_grace_s. The ingress sends it to the replica holding the
        lease (`target_replica`, read by the request router)."""
        self.arrived(target_replica)
        await self.loop.call(lambda: self.role.abort(request_id))
