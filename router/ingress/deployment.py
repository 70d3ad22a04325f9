"""The ingress deployment: gRPC `pdserve.v1.Generation` (behind Serve's gRPC proxy), the standard
grpc.health.v1 service, and the OpenAI-compatible HTTP API (FastAPI, behind Serve's HTTP proxy).

It builds the front door once (gateway/front_door.py) with the cluster's shared actors (quotas,
idempotency, audit writer, budget ledger, rollout, router); each RPC is convert -> serve -> convert."""

from __future__ import annotations

import logging

import ray
from grpc_health.v1 import health_pb2
from ray import serve

from cluster.config import AppConfig
from cluster.errors import InvalidRequestError
from cluster.telemetry import gc_pauses
from cluster.telemetry.metrics import guardrail_metrics
from protos.pdserve.v1 import generation_pb2 as pb
from router.actor import get_router
from router.policy import PolicyConfig
from router.ingress.api import grpc_api, openai_api, probes
from router.ingress.gateway.admission_actor import get_admission
from router.ingress.gateway.audit import AuditShipper
from router.ingress.gateway.audit_actor import get_audit_writer
from router.ingress.gateway.budget_actor import get_ledger
from router.ingress.gateway.front_door import FrontDoor
from router.ingress.gateway.telemetry import IngressTelemetry
from router.ingress.status import Code, ServingError
from router.ingress.versions.rollout_actor import get_rollout

log = logging.getLogger(__name__)

GRPC_SERVICERS = [
    "protos.pdserve.v1.generation_pb2_grpc.add_GenerationServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]

HEALTH_SERVICES = ("", "pdserve.v1.Generation")
ACTOR_START_TIMEOUT_S = 60.0


class _QuietClientErrors(logging.Filter):
    """Serve logs a traceback for every gRPC request that ends in an exception, which is how a
    status reaches its proxy. A refusal for the client's own fault is counted in pdserve's
    metrics by code instead: a flood of bad requests must not become a flood of tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        # Serve logs its own gRPCStatusError, whose grpc_code is the code set on the context
        # (grpc_api.fail); in this process a GrpcAbort carries our Code
        status = getattr(err, "grpc_code", None)
        code = Code.__members__.get(status.name) if status is not None else getattr(err, "code", None)
        return not (isinstance(code, Code) and code.client_fault)


def build_front_door(config: AppConfig, pools: dict, classifier_handle=None) -> FrontDoor:
    """The front door over the cluster's actors, each created now if no one has yet."""
    router = None
    if config.routing.enabled:
        router = get_router()
        router.configure.remote(PolicyConfig.of(config.routing, config.engine.block_size), config.routing.strategy)
    telemetry = IngressTelemetry(config.telemetry)
    audit = ledger = None
    if config.audit.enabled:
        get_audit_writer(config.audit)  # created now, not by the first request (the shipper retries anyway)
        audit = AuditShipper(config.audit, lambda: get_audit_writer(config.audit), telemetry.metrics)
    if config.budgets.prices or any(t.monthly_budget_usd is not None for t in config.tenants.values()):
        ledger = lambda: get_ledger(config.budgets)  # noqa: E731
        # ready before this replica takes traffic: a ledger still starting would refuse the first
        # requests (when_unreachable: closed)
        ray.get(ledger().snapshot.remote(), timeout=ACTOR_START_TIMEOUT_S)
    quotas = get_admission(config.admission)
    door = FrontDoor.build(config, pools, router=router, take=quotas.take.remote, telemetry=telemetry, audit=audit,
                           ledger=ledger, classifier=classifier_handle, idempotency_actor=quotas,
                           guard_metrics=guardrail_metrics() if config.telemetry.metrics else None)
    if door.catalog.rollout_models():  # a model with several versions: live splits and the canary gate
        door.catalog.connect(get_rollout(), ACTOR_START_TIMEOUT_S)
    return door


@serve.ingress(openai_api.app)
class Ingress:
    def __init__(self, config: dict, pools: dict, classifier_handle=None):
        """`pools`: serving group (AppConfig.serving_group) -> (prefill handle or None, decode handle),
        one entry per model version."""
        self.config = AppConfig.model_validate(config)
        self.config.check_startable()
        logging.getLogger("ray.serve").addFilter(_QuietClientErrors())
        self.door = build_front_door(self.config, pools, classifier_handle)
        log.info("%s", self.config.admission_bounds.describe())
        openai_api.bind(self.door)
        gc_pauses.settle_after_start()  # last: everything start-up made is never walked again

    async def __del__(self):
        """Serve's graceful shutdown: send the audit records still spooled (bounded); a replica
        killed instead leaves its spool to be adopted."""
        if self.door.audit is not None:
            await self.door.audit.drain(min(5.0, self.config.graceful_shutdown_timeout_s))

    # ---- gRPC: pdserve.v1.Generation -------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context):  # noqa: N802 — the RPC's name
        try:
            metadata = dict(grpc_context.invocation_metadata())
            tenant = self.door.authorize(metadata.get("authorization"), request.model)
            reply = await self.door.serve(grpc_api.request_from_proto(request, metadata, tenant, self.config))
            async for response in grpc_api.responses(reply):
                yield response
        except (InvalidRequestError, ServingError) as e:
            raise grpc_api.fail(grpc_context, e) from e

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context) -> pb.ListModelsResponse:  # noqa: N802
        try:
            self.door.authorize(dict(grpc_context.invocation_metadata()).get("authorization"), None)
        except ServingError as e:
            raise grpc_api.fail(grpc_context, e) from e
        return pb.ListModelsResponse(models=[pb.ModelInfo(**m) for m in self.door.model_info()])

    # ---- gRPC: grpc.health.v1.Health --------------------------------------------------------

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context):  # noqa: N802
        """SERVING for the server ("") and pdserve.v1.Generation while a decode replica answers
        (bounded), NOT_SERVING otherwise; NOT_FOUND for any other service, as the protocol says."""
        if request.service not in HEALTH_SERVICES:
            raise grpc_api.fail(grpc_context, ServingError(Code.NOT_FOUND, f"unknown service {request.service!r}"))
        live = await self.door.live(probes.LIVE_TIMEOUT_S)
        status = health_pb2.HealthCheckResponse.SERVING if live else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)
