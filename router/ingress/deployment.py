"""The ingress deployment: gRPC `pdserve.v1.Generation` and the standard grpc.health.v1 service (its
own server: api/grpc_server.py), and the OpenAI-compatible HTTP API (FastAPI, behind Serve's HTTP
proxy).

It builds the front door once (gateway/front_door.py) with its Serve app's control actors (quotas and
idempotency, audit writer, budget ledger, rollout, and a router per model version: router/actor.py);
each RPC is convert -> serve -> convert."""

from __future__ import annotations

import asyncio
import logging

import ray
from ray import serve

from cluster.config import AppConfig
from cluster.engine.priority import raise_process_priority
from cluster.telemetry import gc_pauses
from cluster.telemetry.metrics import guardrail_metrics
from router.actor import serve_app
from router.cells import ingress_routers
from router.policy import PolicyConfig
from router.replies import ReplyInbox
from router.ingress.api import openai_api, probes
from router.ingress.api.grpc_server import GrpcServer
from router.ingress.gateway.admission_actor import get_admission
from router.ingress.gateway.audit import AuditShipper
from router.ingress.gateway.audit_actor import get_audit_writer
from router.ingress.gateway.budget_actor import get_ledger
from router.ingress.gateway.front_door import FrontDoor
from router.ingress.gateway.telemetry import IngressTelemetry
from router.ingress.versions.rollout_actor import get_rollout

log = logging.getLogger(__name__)

ACTOR_START_TIMEOUT_S = 60.0


def pool_handle(handle):
    """A pool's Serve handle as the front door calls it: Serve's request router on the caller's
    loop (this one: call it on the front door's), not on a loop of its own, which made every call
    and every streamed message cross two threads (docs/benchmarks.md, "The front door's parts").
    Serve's throughput profile does the same. The legs choose how a call travels (flow/legs.py `via`)."""
    if handle is not None and not handle.is_initialized:
        handle._init(_run_router_in_separate_loop=False)
    return handle


def build_front_door(config: AppConfig, pools: dict, classifier_handle=None, app: str | None = None) -> FrontDoor:
    """The front door over the app's control actors (`app`: None, this replica's Serve app), each
    created now if no one has yet, and given this config's options: a changed option is applied, or
    refused by its actor with an error naming it (this replica then fails to start)."""
    app = app or serve_app()
    pools = {group: tuple(pool_handle(h) for h in pair) for group, pair in pools.items()}
    routers = configure_routers(config, app) if config.routing.enabled else None
    telemetry = IngressTelemetry(config.telemetry)
    audit = ledger = None
    if config.audit.enabled:
        writer = get_audit_writer(config.audit, app)
        try:  # its directory taken now, not by the first request
            writer.ready(ACTOR_START_TIMEOUT_S)
        except ValueError:  # audit.dir is another app's writer's: refused, naming the option
            raise
        except Exception as e:  # noqa: BLE001 — a damaged log, a slow start: records wait in the spool
            log.error("audit: the writer is not ready (%s); this ingress spools its records and resends them", e)
        audit = AuditShipper(config.audit, lambda: writer, telemetry.metrics)
    if config.budgets.prices or any(t.monthly_budget_usd is not None for t in config.tenants.values()):
        ledger_ref = get_ledger(config.budgets, app)
        # ready before this replica takes traffic: a ledger still starting would refuse the first
        # requests (when_unreachable: closed)
        ledger_ref.ready(ACTOR_START_TIMEOUT_S)
        ledger = lambda: ledger_ref  # noqa: E731
    quotas = get_admission(config.admission, app)
    quotas.ready(ACTOR_START_TIMEOUT_S)
    door = FrontDoor.build(config, pools, routers=routers, take=quotas.take.remote, telemetry=telemetry, audit=audit,
                           ledger=ledger, classifier=classifier_handle, idempotency_actor=quotas,
                           guard_metrics=guardrail_metrics() if config.telemetry.metrics else None,
                           replies=ReplyInbox() if config.decode_replies == "channel" else None)
    if door.catalog.rollout_models():  # a model with several versions: live splits and the canary gate
        door.catalog.connect(get_rollout(app), ACTOR_START_TIMEOUT_S)
    return door


def configure_routers(config: AppConfig, app: str) -> dict:
    """Each model version's router (AppConfig.serving_group -> its ActorRef, or its cells' routers:
    router/cells.py), given the routing policy: each keeps it, and a router its replicas create or
    Ray restarts later starts with it."""
    routers = {}
    for v in config.served_versions():
        cfg = v.config
        routers[cfg.serving_group] = router = ingress_routers(cfg, app)
        router.configure.remote(PolicyConfig.of(cfg.routing, cfg.engine.block_size), cfg.routing.strategy)
    return routers


def front_door_priority(config: AppConfig) -> None:
    """Every thread of this process at `ingress_nice` or better (None: as Ray started them, niceness
    15): the front door is latency work, the engines' compute is not (docs/architecture.md, 'CPU
    priority')."""
    if config.ingress_nice is not None:
        raise_process_priority(config.ingress_nice, "ingress")


@serve.ingress(openai_api.app)
class Ingress:
    async def __init__(self, config: dict, pools: dict, classifier_handle=None, planner_handle=None):
        """`pools`: serving group (AppConfig.serving_group) -> (prefill handle or None, decode handle),
        one entry per model version. `planner_handle`: the run-time planner's deployment (with
        planner.enabled; bound here so that Serve deploys it with the app)."""
        self.planner = planner_handle
        self.config = AppConfig.model_validate(config)
        self.config.check_startable()
        # in a thread: it waits on the control actors (ray.get) and loads tokenizers, which would
        # stop this replica's event loop (Serve's health checks of it included) meanwhile
        # (the pools' handles are initialized here first: their request routers run on this loop)
        pools = {group: tuple(pool_handle(h) for h in pair) for group, pair in pools.items()}
        self.door, liveness = await asyncio.to_thread(self._build, pools, classifier_handle)
        log.info("%s", self.config.admission_bounds.describe())
        openai_api.bind(self.door, liveness)
        self.grpc = GrpcServer(self.door, self.config, liveness)  # binds now: a taken port fails this replica
        await self.grpc.start()
        log.info("gRPC server on %s", self.grpc.address)
        front_door_priority(self.config)  # every thread, the gRPC transport's included (ingress_event_loops 2)
        gc_pauses.settle_after_start()  # last: everything start-up made is never walked again
        # full collections at quiet moments, not in a burst: a collection stops every thread (the
        # transport's too, with two loops). Activity: calls that reached the door; calls in flight
        # there or on their way.
        transit = self.grpc.generation.transit
        self.gc_task = gc_pauses.collect_when_quiet(gc_pauses.idle_from(
            lambda: (self.door.arrivals, self.door.admission.total_inflight + transit.calls)))

    def _build(self, pools: dict, classifier_handle):
        """The front door and what health calls answer from (Serve's controller: probes.serve_liveness)."""
        door = build_front_door(self.config, pools, classifier_handle)
        return door, probes.serve_liveness(door, pools)

    async def __del__(self):
        """Serve's graceful shutdown: the gRPC calls in flight get the shutdown's time to finish;
        then the audit records still spooled are sent (bounded). A replica killed instead leaves
        its spool to be adopted."""
        if not all(hasattr(self, a) for a in ("config", "grpc", "door")):
            return  # __init__ failed before it started them: nothing to stop (its error is the one to read)
        grace = self.config.graceful_shutdown_timeout_s
        if getattr(self, "gc_task", None) is not None:
            self.gc_task.cancel()
        await self.grpc.stop(grace)
        if self.door.replies is not None:
            self.door.replies.close()
        if self.door.telemetry is not None:
            self.door.telemetry.batch.close()  # the last metric values, recorded before the process goes
        if self.door.audit is not None:
            await self.door.audit.drain(min(5.0, grace))
