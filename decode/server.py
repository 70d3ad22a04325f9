"""The decode pool's Serve deployment: one DecodeEngine per replica, driven by its own loop."""

from __future__ import annotations

import logging
import uuid
from typing import AsyncIterator, Sequence

from cluster.app_config import AppConfig
from cluster.async_engine import AsyncEngine
from cluster.engine import RequestOutput
from cluster.registry import RayMetadataStore, get_registry
from cluster.replica import ReportingCore, build_engine
from cluster.sampling_params import SamplingParams
from decode.engine import DecodeEngine
from kv_transfer.handle import KVHandle
from kv_transfer.layout import engine_layout
from kv_transfer.transport import NixlTransport

log = logging.getLogger(__name__)


class DecodeServer:
    def __init__(self, config: dict):
        cfg = AppConfig.model_validate(config)
        self.replica_id = f"decode-{uuid.uuid4().hex[:8]}"
        engine = build_engine(cfg, "decode")
        registry = get_registry()
        kv = cfg.kv_transfer
        transport = NixlTransport(
            self.replica_id, engine.kv_cache, engine_layout(engine), RayMetadataStore(registry),
            required_transports=kv.required_transports, num_threads=kv.nixl_threads,
        )
        decode = DecodeEngine(engine, transport, policy=kv.failure_policy, transfer_timeout_s=kv.timeout_s)
        self.core = ReportingCore(decode, self.replica_id, "decode", registry)
        self.loop = AsyncEngine(self.core, idle_poll_s=1.0, name="pdserve-decode")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        kv_handle: KVHandle | None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas. With a KV handle the prompt's KV is pulled from prefill
        (the first token was already sent); without one the prompt is prefilled here."""
        engine = self.core.engine
        if kv_handle is None:
            req = engine.make_request(request_id, None, prompt_token_ids, sampling)

            def submit():
                engine.add(req)
        else:
            def submit():
                self.core.core.submit(request_id, prompt_token_ids, sampling, kv_handle)

        async for out in self.loop.stream(request_id, submit):
            yield out

    async def load(self) -> dict:
        return await self.loop.call(self.core.load)

    def check_health(self) -> None:
        if not self.loop._thread.is_alive():  # noqa: SLF001
            raise RuntimeError("decode engine loop is not running")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown(timeout=2)
