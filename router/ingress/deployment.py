"""The ingress deployment: gRPC `pdserve.v1.Generation` (behind Serve's gRPC proxy), the standard
grpc.health.v1 service, and the OpenAI-compatible HTTP API (FastAPI, behind Serve's HTTP proxy)."""

from __future__ import annotations

import logging

import grpc
import ray
from grpc_health.v1 import health_pb2
from ray import serve

from cluster.config import AppConfig
from cluster.errors import InvalidRequestError
from cluster.telemetry import gc_pauses
from protos.pdserve.v1 import generation_pb2 as pb
from router.actor import get_router
from router.ingress.admission import Admission, Idempotent
from router.ingress.admission_actor import get_admission
from cluster.telemetry.metrics import guardrail_metrics
from router.ingress.audit import AuditShipper
from router.ingress.audit_actor import get_audit_writer
from router.ingress.budget import Budget
from router.ingress.budget_actor import get_ledger
from router.ingress.flow import RequestFlow
from router.ingress.grpc_api import (ToolOutput, chat_tools_from_proto, delta_to_proto, fail,
                                     prompt_from_proto, sampling_from_proto, shaped, with_tools)
from router.ingress.openai_schema import ToolUse, tool_use
from router.ingress.openai_api import TIMEOUT_HEADER, bind_replica, build_openai_app, parse_deadline
from router.ingress.catalog import ModelCatalog
from router.ingress.rollout_actor import get_rollout
from router.ingress.choices import interleave, start_choices
from router.ingress.session import SESSION_HEADER, session_key
from router.ingress import probes
from router.ingress.status import Code, ServingError
from router.ingress.telemetry import IngressTelemetry
from router.policy import PolicyConfig

log = logging.getLogger(__name__)

GRPC_SERVICERS = [
    "protos.pdserve.v1.generation_pb2_grpc.add_GenerationServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]

HEALTH_SERVICES = ("", "pdserve.v1.Generation")
ACTOR_START_TIMEOUT_S = 60.0

openai_app = build_openai_app()

CLIENT_FAULT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}


def versioned(response: pb.GenerateResponse, first: set[int], flow) -> pb.GenerateResponse:
    """A choice's first response names the model version that serves it."""
    if response.index not in first:
        first.add(response.index)
        response.model_version = flow.config.version or ""
    return response


class _QuietClientErrors(logging.Filter):
    """Serve logs a traceback for every gRPC request that ends in an exception, which is how a
    status reaches its proxy. A refusal for the client's own fault is counted in pdserve's
    metrics by code instead: a flood of bad requests must not become a flood of tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return getattr(err, "grpc_code", None) not in CLIENT_FAULT_CODES


@serve.ingress(openai_app)
class Ingress:
    def __init__(self, config: dict, pools: dict, classifier_handle=None):
        """`pools`: serving group (AppConfig.serving_group) -> (prefill handle or None, decode handle),
        one entry per model version."""
        self.config = AppConfig.model_validate(config)
        self.config.check_startable()
        logging.getLogger("ray.serve").addFilter(_QuietClientErrors())
        router = None
        if self.config.routing.enabled:
            r = self.config.routing
            router = get_router()
            router.configure.remote(PolicyConfig(
                block_size=self.config.engine.block_size, local_prefill_threshold=r.local_prefill_threshold,
                hot_load_cap=r.hot_load_cap, slow_factor=r.slow_factor, pull_block_cost=r.pull_block_cost,
                evict_block_cost=r.evict_block_cost,
                tier_weights=None if r.tier_weights is None else tuple(r.tier_weights),
                session_bonus=r.session_bonus, max_sessions=r.max_sessions,
                session_ttl_s=r.session_ttl_s), r.strategy)
        actor = get_admission(self.config.admission)
        admission = Admission(self.config, actor.take.remote)  # reads the keys (env, file) and keeps their hashes
        self.telemetry = IngressTelemetry(self.config.telemetry)
        cfg, metrics = self.config, self.telemetry.metrics
        audit = budget = None
        if cfg.audit.enabled:
            get_audit_writer(cfg.audit)  # created now, not by the first request (the shipper retries anyway)
            audit = AuditShipper(cfg.audit, lambda: get_audit_writer(cfg.audit), metrics)
        budgets = cfg.budgets.prices or any(t.monthly_budget_usd is not None for t in cfg.tenants.values())
        if budgets:
            # ready before this replica takes traffic: a ledger still starting would refuse the first
            # requests (when_unreachable: closed)
            ray.get(get_ledger(cfg.budgets).snapshot.remote(), timeout=ACTOR_START_TIMEOUT_S)
        guard_metrics = guardrail_metrics() if cfg.telemetry.metrics else None
        flows = {}
        for v in cfg.served_versions():  # one flow per model version, sharing the front door's state
            prefill, decode = pools[v.config.serving_group]
            budget = Budget(v.config, lambda: get_ledger(cfg.budgets), metrics) if budgets else None  # its prices
            flows[v.name, v.label] = RequestFlow(v.config, prefill, decode, router, admission=admission,
                                                 telemetry=self.telemetry, guard_metrics=guard_metrics,
                                                 classifier=classifier_handle, audit=audit, budget=budget,
                                                 sampling_defaults=v.sampling.overrides())
        self.models = ModelCatalog.build(cfg, flows)  # which version serves a request
        if self.models.rollout_models():  # a model with several versions: live splits and the canary gate
            self.models.connect(get_rollout(), ACTOR_START_TIMEOUT_S)
        bind_replica(self.models, Idempotent(actor, admission))
        gc_pauses.settle_after_start()  # last: everything start-up made is never walked again

    async def __del__(self):
        """Serve's graceful shutdown: send the audit records still spooled (bounded); a replica
        killed instead leaves its spool to be adopted."""
        audit = self.models.default.audit  # one shipper, every flow's
        if audit is not None:
            await audit.drain(min(5.0, self.config.graceful_shutdown_timeout_s))

    # ---- gRPC: pdserve.v1.Generation -------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context):  # noqa: N802 — the RPC's name
        use = ToolUse()
        try:
            metadata = dict(grpc_context.invocation_metadata())
            tenant = self.models.authorize(metadata.get("authorization"), request.model)
            limits = self.config.ingress_limits
            size = request.ByteSize()  # Serve's proxy may take more (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE)
            if size > limits.grpc_max_receive_bytes:
                raise InvalidRequestError("request", f"message of {size} bytes exceeds grpc_max_receive_bytes "
                                                     f"{limits.grpc_max_receive_bytes}")
            deadline = parse_deadline(metadata.get(TIMEOUT_HEADER), limits.max_timeout_header_chars)
            session = session_key(metadata.get(SESSION_HEADER), None, None, limits.max_session_id_chars)
            routed = self.models.select(request.model, tenant, session)
            flow = routed.flow
            prompt, ids, messages = prompt_from_proto(request, limits.max_chat_messages)
            flow.config.engine.limits.check_counts(len(request.sampling.stop), len(request.sampling.stop_token_ids))
            sampling = sampling_from_proto(request.sampling, flow.config.default_max_tokens, flow.validator,
                                           flow.sampling_defaults)
            tool_req = None if messages is None else chat_tools_from_proto(
                request.chat, request.sampling, flow.validator.limits.max_schema_bytes)
            if tool_req is not None:
                use = tool_use(tool_req, flow.config.tool_call_parser)
                sampling = with_tools(sampling, tool_req, use, flow.validator)
            tools = [t.model_dump(exclude_none=True) for t in tool_req.tools] if use.active else None
            n = request.n if request.HasField("n") else 1
            limits.check_choices(n)
            shapers = [ToolOutput(use) if use.active else None for _ in range(n)]
            first: set[int] = set()  # the choices whose first response went: it names the version
            if n == 1:
                async for delta in routed.generate(prompt, ids, sampling, request.request_id or None,
                                                      tenant=tenant, deadline=deadline, messages=messages,
                                                      tools=tools, session=session):
                    yield versioned(shaped(shapers[0], delta_to_proto(delta), delta), first, flow)
                return
            if request.request_id:  # it labels the replies (each choice's request has its own id)
                flow.validator.check_request_id(request.request_id)
            # as /v1/chat/completions' n: each choice a request, labelled here with one id
            choices = await start_choices(routed.for_choices(n), n, prompt, ids, sampling, tenant, deadline, messages,
                                          tools=tools, session=session)
            label = request.request_id or choices[0][1].request_id
            async for i, delta in interleave(choices):
                yield versioned(shaped(shapers[i], delta_to_proto(delta, i, label), delta), first, flow)
        except (InvalidRequestError, ServingError) as e:
            if isinstance(e, InvalidRequestError) and use.forced is not None and e.field == "response_format":
                e = InvalidRequestError("tools", e.message)  # the tools' grammar: name what the client sent
            raise fail(grpc_context, e) from e

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context) -> pb.ListModelsResponse:  # noqa: N802
        try:
            self.models.authorize(dict(grpc_context.invocation_metadata()).get("authorization"), None)
        except ServingError as e:
            raise fail(grpc_context, e) from e
        return pb.ListModelsResponse(models=[pb.ModelInfo(**m) for m in self.models.model_info()])

    # ---- gRPC: grpc.health.v1.Health --------------------------------------------------------

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context):  # noqa: N802
        """SERVING for the server ("") and pdserve.v1.Generation while a decode replica answers
        (bounded), NOT_SERVING otherwise; NOT_FOUND for any other service, as the protocol says."""
        if request.service not in HEALTH_SERVICES:
            raise fail(grpc_context, ServingError(Code.NOT_FOUND, f"unknown service {request.service!r}"))
        live = await probes.all_live(self.models)
        status = health_pb2.HealthCheckResponse.SERVING if live else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)
