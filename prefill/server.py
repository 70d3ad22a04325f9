"""The prefill pool's Serve deployment: one PrefillEngine per replica, driven by its own loop."""

from __future__ import annotations

import logging
import uuid
from typing import Sequence

from cluster.app_config import AppConfig
from cluster.async_engine import AsyncEngine
from cluster.registry import RayMetadataStore, get_registry
from cluster.replica import ReportingCore, build_engine
from cluster.sampling_params import SamplingParams
from kv_transfer.layout import engine_layout
from kv_transfer.transport import NixlTransport
from prefill.engine import PrefillEngine, PrefillResult

log = logging.getLogger(__name__)


class PrefillServer:
    def __init__(self, config: dict):
        cfg = AppConfig.model_validate(config)
        self.replica_id = f"prefill-{uuid.uuid4().hex[:8]}"
        engine = build_engine(cfg, "prefill")
        registry = get_registry()
        kv = cfg.kv_transfer
        transport = NixlTransport(
            self.replica_id, engine.kv_cache, engine_layout(engine), RayMetadataStore(registry),
            required_transports=kv.required_transports, num_threads=kv.nixl_threads,
        )
        self.core = ReportingCore(PrefillEngine(engine, transport, lease_s=kv.lease_s), self.replica_id,
                                  "prefill", registry)
        # Idle wake-ups serve lease expiry and completion notifications.
        self.loop = AsyncEngine(self.core, idle_poll_s=0.05, name="pdserve-prefill")

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> PrefillResult:
        """Prefill and hold the blocks; cancelling this call aborts the prefill."""
        stream = self.loop.stream(request_id, lambda: self.core.core.submit(request_id, prompt_token_ids, sampling))
        try:
            async for result in stream:
                return result
        finally:
            await stream.aclose()
        raise RuntimeError(f"prefill stream for {request_id} ended without a result")

    async def release(self, request_id: str) -> None:
        """End a lease early (the request was cancelled before decode pulled it)."""
        await self.loop.call(lambda: self.core.abort(request_id))

    async def load(self) -> dict:
        return await self.loop.call(self.core.load)

    def check_health(self) -> None:
        if not self.loop._thread.is_alive():  # noqa: SLF001
            raise RuntimeError("prefill engine loop is not running")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown(timeout=2)
