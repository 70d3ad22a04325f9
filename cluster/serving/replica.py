"""What the prefill and decode deployments share. The stack is flat:

    deployment (prefill/deployment.py, decode/deployment.py: the Serve methods)
      -> EngineLoop (cluster/engine/loop.py: one thread; hooks for reports and telemetry)
        -> role (PrefillEngine / DecodeEngine: first token and leases / KV import)
          -> LLMEngine (the verbs the roles call)

An `EngineReplica` builds that stack from the app config: the engine, its NIXL transport, the role
(`make_role`), the loop with its hooks (`LoadReporter`, `ReplicaTelemetry`), and, only with
`fault_tolerance.fault_injection`, the fault wrappers. It also answers Serve's health checks and
autoscaler."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Literal

import ray

from cluster.config import AppConfig, TelemetryOptions
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine, resolve_device
from cluster.engine.loop import EngineLoop
from cluster.serving import faults
from cluster.serving.registry import RayMetadataStore, get_registry
from cluster.serving.reporting import LoadReporter
from cluster.serving.tensor_parallel import RayRanks, guard_group
from cluster.telemetry import gc_pauses
from cluster.telemetry.replica import ReplicaTelemetry
from kv_transfer.layout import engine_layout
from kv_transfer.stats import TransferStats
from kv_transfer.transport import NixlTransport
from router.actor import get_router

log = logging.getLogger(__name__)


def build_engine(config: AppConfig, pool: Literal["prefill", "decode"],
                 replica_id: str) -> tuple[LLMEngine, RayRanks | None]:
    """The pool's engine; with tensor_parallel_size > 1 its worker ranks first, as Ray actors of
    this replica's placement group (cluster/serving/tensor_parallel.py), which the engine drives,
    and a failed forward ends the replica (GroupGuard)."""
    engine_config = EngineConfig(model=config.model, **config.engine_for(pool).model_dump())
    if engine_config.tensor_parallel_size == 1:
        return LLMEngine(engine_config), None
    opts = getattr(config, pool)
    ranks = RayRanks.start(replica_id, engine_config.tensor_parallel_size, resolve_device(engine_config.device),
                           num_cpus=opts.num_cpus, num_gpus=opts.num_gpus)
    try:
        engine = LLMEngine(engine_config)
        guard_group(engine)
        return engine, ranks
    except Exception:
        ranks.kill()
        raise


def make_replica_telemetry(options: TelemetryOptions, engine: LLMEngine, transfer_stats: TransferStats,
                           pool: str, replica_id: str):
    """The replica's metrics and traces exporter; None (and no probe in the engine) when both are off."""
    if not options.metrics and options.traces == "none":
        return None
    return ReplicaTelemetry(options, engine, transfer_stats, pool, replica_id)


def _serve_replica_id() -> str | None:
    """Serve's id of this replica: routing decisions name replicas by it."""
    from ray import serve  # noqa: PLC0415
    from ray.serve.exceptions import RayServeException  # noqa: PLC0415

    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # not running as a Serve replica
        return None


class EngineReplica:
    """Base of the prefill and decode Serve deployments. Subclasses name their `pool` and build
    their role with `make_role(engine, transport, config)`."""

    pool: Literal["prefill", "decode"]
    idle_poll_s: float | None = None
    ranks: RayRanks | None = None  # a tensor-parallel replica's worker ranks

    def __init__(self, config: dict):
        cfg = AppConfig.model_validate(config)
        self.stuck_loop_s = cfg.fault_tolerance.stuck_loop_s
        self.max_consecutive_step_errors = cfg.fault_tolerance.max_consecutive_step_errors
        self.replica_id = _serve_replica_id() or f"{self.pool}-{uuid.uuid4().hex[:8]}"
        # Calls that named a replica (the router's choice, passed as target_replica) and arrived
        # here: on target, or not (Serve's request router handed the replica to another call)
        self.routed = {"on_target": 0, "off_target": 0}
        engine, self.ranks = build_engine(cfg, self.pool, self.replica_id)
        self.engine = engine
        kv = cfg.kv_transfer
        registry = RayMetadataStore(get_registry(), kv.registry_timeout_s)
        transport = NixlTransport(
            self.replica_id, engine.kv_cache, engine_layout(engine), registry,
            required_transports=kv.required_transports, num_threads=kv.nixl_threads,
            progress_thread=kv.progress_thread,
            host_cache=engine.host_arena() if self.pool == "prefill" else None,  # kv_tiers.lease_from_host
            tensor_parallel=engine.tensor_parallel,  # a tp replica registers every rank's pool
        )
        self.faults = faults.install(engine, transport) if cfg.fault_tolerance.fault_injection else None
        self.role = self.make_role(engine, transport, cfg)
        self.reporter = LoadReporter(engine, transport.stats, self.replica_id, self.pool, registry, get_router(),
                                     node_id=ray.get_runtime_context().get_node_id(), group=cfg.serving_group)
        hooks = [self.reporter]
        telemetry = make_replica_telemetry(cfg.telemetry, engine, transport.stats, self.pool, self.replica_id)
        if telemetry is not None:
            hooks.append(telemetry)
        self.loop = EngineLoop(self.role, idle_poll_s=self.idle_poll_s, name=f"pdserve-{self.pool}", hooks=hooks,
                               nice=getattr(cfg, self.pool).compute_nice,
                               stream_interval=getattr(cfg, self.pool).stream_interval)
        # A full collection holds the GIL, so it stalls the engine's step thread and every stream with
        # it: the model, torch's and transformers' start-up objects are frozen out of the collector,
        # as in the ingress (cluster/telemetry/gc_pauses.py).
        gc_pauses.settle_after_start()

    def make_role(self, engine: LLMEngine, transport: NixlTransport, config: AppConfig):
        raise NotImplementedError

    def arrived(self, target_replica: str | None) -> None:
        """Count a call against the replica it named (none named: not counted)."""
        if target_replica is not None:
            self.routed["on_target" if target_replica == self.replica_id else "off_target"] += 1

    async def load(self, target_replica: str | None = None) -> dict:
        """This replica's load (`target_replica`, read by the request router, picks the replica)."""
        self.arrived(target_replica)
        ranks = {} if self.ranks is None else {"rank_nodes": list(self.ranks.nodes)}  # tensor-parallel: rank 0 first
        return {"replica_id": self.replica_id, "routed": dict(self.routed), "gc_pauses": gc_pauses.PAUSES.summary(),
                **ranks, **await self.loop.call(self.reporter.report)}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook (called only when the pool autoscales): the pool's signals
        since the previous call, for `cluster.serving.autoscaling_policy`."""
        def metrics():
            return self.reporter.autoscaling_metrics(self.loop.first_outputs.drain(time.monotonic())).as_dict()

        return await self.loop.call(metrics)

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes Serve replace the replica
        (and callers' request routers, then the router actor, drop it)."""
        if not self.loop.is_alive():
            raise RuntimeError(f"{self.pool} engine loop is not running")
        stalled = self.loop.stalled_for(time.monotonic())
        if stalled > self.stuck_loop_s:
            raise RuntimeError(f"{self.pool} engine loop has made no progress for {stalled:.1f} s "
                               f"(stuck_loop_s {self.stuck_loop_s:g})")
        lost = self.ranks.lost() if self.ranks is not None else None
        if lost is not None:  # a tensor-parallel replica is whole or dead
            raise RuntimeError(f"{self.pool} engine: {lost}")
        failed = self.engine.stats.consecutive_step_errors  # an int the loop thread writes: read as is
        if failed >= self.max_consecutive_step_errors:
            raise RuntimeError(f"{self.pool} engine: the last {failed} steps failed "
                               f"(max_consecutive_step_errors {self.max_consecutive_step_errors})")

    async def inject_fault(self, pull: faults.PullFault | None = None, step_delay_s: float | None = None,
                           stall_loop_s: float | None = None, fail_requests: float | None = None,
                           target_replica: str | None = None) -> None:
        """Chaos tests and drills (only with fault_tolerance.fault_injection): `pull` "drop" |
        "stall" | "none" on this replica's KV transfers, a delay added to every engine step (a
        slow node), one loop turn blocked for `stall_loop_s` (a stuck engine), or the fraction
        of new requests a decode replica fails at once (`fail_requests`: a broken version).
        `target_replica` picks the replica (read by the request router)."""
        if self.faults is None:
            raise PermissionError("fault injection is off (fault_tolerance.fault_injection: false)")

        def apply():
            if pull is not None:
                self.faults.pull = pull
            if step_delay_s is not None:
                self.faults.step_delay_s = step_delay_s
            if fail_requests is not None:
                self.faults.fail_requests = fail_requests

        await self.loop.call(apply)
        if stall_loop_s:
            asyncio.ensure_future(self.loop.call(lambda: time.sleep(stall_loop_s)))

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown(timeout=2)
        ranks = getattr(self, "ranks", None)
        if ranks is not None:  # a step stuck in a collective with them ends with them
            ranks.kill()
        try:  # leaving: no more decisions should name this replica (it also goes stale in 3 s)
            get_router().forget.remote(self.replica_id)
        except Exception:  # noqa: BLE001 — best effort while the process ends
            pass
