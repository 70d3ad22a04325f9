"""The ingress deployment: gRPC `pdserve.v1.Generation` (behind Serve's gRPC proxy), the standard
grpc.health.v1 service, and the OpenAI-compatible HTTP API (FastAPI, behind Serve's HTTP proxy)."""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2
from ray import serve

from cluster.app_config import AppConfig
from cluster.errors import InvalidRequestError
from protos.pdserve.v1 import generation_pb2 as pb
from router.auth import ApiKeyAuth
from router.flow import RequestFlow, ServingError
from router.grpc_api import delta_to_proto, fail, prompt_from_proto, sampling_from_proto
from router.openai_api import bind_replica, build_openai_app

log = logging.getLogger(__name__)

GRPC_SERVICERS = [
    "protos.pdserve.v1.generation_pb2_grpc.add_GenerationServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]

openai_app = build_openai_app()


@serve.ingress(openai_app)
class Ingress:
    def __init__(self, config: dict, prefill_handle, decode_handle):
        from router.actor import get_router  # noqa: PLC0415
        from router.policy import PolicyConfig  # noqa: PLC0415

        self.config = AppConfig.model_validate(config)
        router = None
        if self.config.routing.enabled:
            r = self.config.routing
            router = get_router()
            router.configure.remote(PolicyConfig(
                block_size=self.config.engine.block_size, local_prefill_threshold=r.local_prefill_threshold,
                hot_load_cap=r.hot_load_cap, slow_factor=r.slow_factor), r.strategy)
        self.flow = RequestFlow(self.config, prefill_handle, decode_handle, router)
        self.auth = ApiKeyAuth(self.config.api_keys)
        bind_replica(self.flow, self.auth.check)

    # ---- gRPC: pdserve.v1.Generation -------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context):  # noqa: N802 — the RPC's name
        try:
            self._admit(request.model, grpc_context)
            prompt, ids = prompt_from_proto(request)
            sampling = sampling_from_proto(request.sampling, self.config.default_max_tokens)
            async for delta in self.flow.generate(prompt, ids, sampling, request.request_id or None):
                yield delta_to_proto(delta)
        except InvalidRequestError as e:
            raise fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        except ServingError as e:
            raise fail(grpc_context, getattr(grpc.StatusCode, e.code), e.message) from e

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context) -> pb.ListModelsResponse:  # noqa: N802
        try:
            self._admit("", grpc_context)
        except ServingError as e:
            raise fail(grpc_context, getattr(grpc.StatusCode, e.code), e.message) from e
        return pb.ListModelsResponse(models=[pb.ModelInfo(**self.flow.model_info())])

    def _admit(self, model: str, grpc_context) -> None:
        metadata = dict(grpc_context.invocation_metadata())
        self.auth.check(metadata.get("authorization"))
        if model and model != self.config.model_name:
            raise ServingError("NOT_FOUND", f"model {model!r} does not exist; this server serves "
                                            f"{self.config.model_name!r}")

    # ---- gRPC: grpc.health.v1.Health --------------------------------------------------------

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context):  # noqa: N802
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
