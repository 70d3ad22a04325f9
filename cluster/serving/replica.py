"""What every engine replica shares: building its engine from the app config, reporting its load
to the registry (from the loop thread, at most once a second, fire-and-forget), and answering
Serve's autoscaler with the pool's signals (`record_autoscaling_stats`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Literal

from cluster.config import AppConfig
from cluster.serving.autoscaling import ReplicaMetrics
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.latency import TokenIntervals

if TYPE_CHECKING:
    from router.policy import ReplicaLoad


WARMUP_STEPS = 20


def build_engine(config: AppConfig, pool: Literal["prefill", "decode"]) -> LLMEngine:
    opts = config.engine_for(pool)
    return LLMEngine(EngineConfig(model=config.model, **opts.model_dump()))


def engine_load(engine: LLMEngine) -> dict:
    sched = engine.scheduler
    return {
        "free_blocks": engine.kv.num_free_blocks,
        "total_blocks": engine.kv.num_blocks,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "importing": len(sched.importing),
        "leased": len(sched.leased),
        "queued_prefill_tokens": sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
        "last_step_ms": round(engine.stats.last_step_s * 1e3, 3),
        "avg_step_ms": round(engine.stats.step_s_avg * 1e3, 3),
        "steps": engine.stats.steps,
        "generation_tokens": engine.stats.generation_tokens,
        "preemptions": engine.stats.preemptions,
    }


class ReportingCore:
    """Wraps a role core (prefill or decode) so its loop also feeds the router (block events every
    turn, load once a second) and reports load to the registry (for `pdserve status`)."""

    def __init__(self, core, replica_id: str, pool: str, registry, router=None, interval_s: float = 1.0,
                 router_interval_s: float = 0.25, router_min_interval_s: float = 0.02, node_id: str | None = None,
                 telemetry=None):
        from router.events import KVEventPublisher  # noqa: PLC0415

        self.core = core
        self.engine = core.engine
        self.replica_id = replica_id
        self.pool = pool
        self.node_id = node_id  # the Ray node this replica runs on (`pdserve status` shows it)
        self.registry = registry
        self.router = router
        self.publisher = None if router is None else KVEventPublisher(replica_id, core.engine.kv.pool, router)
        self.interval_s = interval_s
        self.router_interval_s = router_interval_s
        self.router_min_interval_s = router_min_interval_s
        self._next = 0.0
        self._last_router = float("-inf")
        self._last_queue: tuple = ()
        self._inner_service = getattr(core, "service", None)
        self._tokens_per_s = 0.0
        self._tp_mark = (0, 0.0)  # (tokens_computed, busy_s) at the last throughput estimate
        self.token_intervals = TokenIntervals()
        self.telemetry = telemetry  # ReplicaTelemetry (cluster/telemetry/replica.py), or None: off

    def step(self):
        outputs = self.core.step()
        self.token_intervals.after_step(self.engine.stats.generation_tokens, time.monotonic())
        return outputs

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def abort(self, request_id: str):
        return self.core.abort(request_id)

    def service(self) -> None:
        if self._inner_service is not None:
            self._inner_service()
        if not self.core.has_unfinished():
            self.token_intervals.idle()
        if self.publisher is not None:
            self.publisher.publish()
        now = time.monotonic()
        load = None
        if self.router is not None:
            # The router counts work it sent here until our next report, so report as soon as the
            # queues change (at most every 20 ms; at once when they empty, since the loop may then
            # sleep up to idle_poll_s), and at least every 0.25 s.
            sched = self.engine.scheduler
            queue = (len(sched.waiting), len(sched.running), len(sched.importing))
            since = now - self._last_router
            changed = queue != self._last_queue and (since >= self.router_min_interval_s or not any(queue))
            if since >= self.router_interval_s or changed:
                self._last_router, self._last_queue = now, queue
                load = self.load()
                self.router.report_load.remote(self.replica_load(load))
        if now >= self._next:
            self._next = now + self.interval_s
            self.registry.report.remote(self.replica_id, load or self.load())
        if self.telemetry is not None:
            self.telemetry.service(now)

    def replica_load(self, load: dict) -> "ReplicaLoad":
        from router.policy import ReplicaLoad  # noqa: PLC0415

        return ReplicaLoad(self.replica_id, self.pool, load["free_blocks"], load["total_blocks"],
                           load["running"] + load["importing"], load["waiting"],
                           load["queued_prefill_tokens"], self._step_time(load), self._throughput())

    @staticmethod
    def _step_time(load: dict) -> float:
        """The slow-replica signal: smoothed step time, or 0 (not measured) during the first
        WARMUP_STEPS, whose one-time costs would mark a fresh replica slow."""
        return load["avg_step_ms"] / 1e3 if load["steps"] >= WARMUP_STEPS else 0.0

    def _throughput(self) -> float:
        """Tokens a second while busy, smoothed over reports: the router's queue-wait predictor."""
        stats = self.engine.stats
        tokens, busy = stats.tokens_computed - self._tp_mark[0], stats.busy_s - self._tp_mark[1]
        if busy > 0.05:  # enough work since the last estimate to measure
            rate = tokens / busy
            self._tokens_per_s = rate if self._tokens_per_s == 0 else 0.7 * self._tokens_per_s + 0.3 * rate
            self._tp_mark = (stats.tokens_computed, stats.busy_s)
        return self._tokens_per_s

    def load(self) -> dict:
        return {"pool": self.pool, "node_id": self.node_id, **engine_load(self.engine),
                "transfer": asdict(self.core.transport.stats)}

    def autoscaling_metrics(self, ttft_s: float) -> ReplicaMetrics:
        """This replica's autoscaling signals since the previous call (`ttft_s` comes from the
        loop, which sees streams start and produce)."""
        load = engine_load(self.engine)
        return ReplicaMetrics(
            kv_usage=1.0 - load["free_blocks"] / load["total_blocks"],
            queued_prefill_tokens=float(load["queued_prefill_tokens"]),
            ttft_s=ttft_s,
            itl_s=self.token_intervals.drain(),
        )


def make_replica_telemetry(options, engine: LLMEngine, transfer_stats, pool: str, replica_id: str):
    """The replica's metrics and traces exporter; None (and no probe in the engine) when both are off."""
    if not options.metrics and options.traces == "none":
        return None
    from cluster.telemetry.replica import ReplicaTelemetry  # noqa: PLC0415

    return ReplicaTelemetry(options, engine, transfer_stats, pool, replica_id)


def _serve_replica_id() -> str | None:
    """Serve's id of this replica: routing decisions name replicas by it."""
    try:
        from ray import serve  # noqa: PLC0415

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 — not running as a Serve replica
        return None


class EngineReplica:
    """Base of the prefill and decode Serve deployments: engine, NIXL transport, loop thread.

    Subclasses wrap the engine in their role core via `make_core(engine, transport, config)`.
    """

    pool: Literal["prefill", "decode"]
    idle_poll_s: float | None = None

    def __init__(self, config: dict):
        import uuid  # noqa: PLC0415

        from cluster.engine.loop import AsyncEngine  # noqa: PLC0415
        from cluster.serving.registry import RayMetadataStore, get_registry  # noqa: PLC0415
        from kv_transfer.layout import engine_layout  # noqa: PLC0415
        from kv_transfer.transport import NixlTransport  # noqa: PLC0415

        import ray  # noqa: PLC0415

        from router.actor import get_router  # noqa: PLC0415

        cfg = AppConfig.model_validate(config)
        self.stuck_loop_s = cfg.fault_tolerance.stuck_loop_s
        self.fault_injection = cfg.fault_tolerance.fault_injection
        self.replica_id = _serve_replica_id() or f"{self.pool}-{uuid.uuid4().hex[:8]}"
        engine = build_engine(cfg, self.pool)
        registry = get_registry()
        kv = cfg.kv_transfer
        transport = NixlTransport(
            self.replica_id, engine.kv_cache, engine_layout(engine), RayMetadataStore(registry),
            required_transports=kv.required_transports, num_threads=kv.nixl_threads,
            progress_thread=kv.progress_thread,
        )
        self.core = ReportingCore(self.make_core(engine, transport, cfg), self.replica_id, self.pool, registry,
                                  get_router(), node_id=ray.get_runtime_context().get_node_id(),
                                  telemetry=make_replica_telemetry(cfg.telemetry, engine, transport.stats,
                                                                   self.pool, self.replica_id))
        self.loop = AsyncEngine(self.core, idle_poll_s=self.idle_poll_s, name=f"pdserve-{self.pool}")

    def make_core(self, engine: LLMEngine, transport, config: AppConfig):
        raise NotImplementedError

    async def load(self, target_replica: str | None = None) -> dict:
        """This replica's load (`target_replica`, read by the request router, picks the replica)."""
        return {"replica_id": self.replica_id, **await self.loop.call(self.core.load)}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook (called only when the pool autoscales): the pool's signals
        since the previous call, for `cluster.serving.autoscaling_policy`."""
        def metrics():
            return self.core.autoscaling_metrics(self.loop.first_outputs.drain(time.monotonic())).as_dict()

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

    async def inject_fault(self, pull: str | None = None, step_delay_s: float | None = None,
                           stall_loop_s: float | None = None, target_replica: str | None = None) -> None:
        """Chaos tests and drills (only with fault_tolerance.fault_injection): `pull` "drop" |
        "stall" | "none" on this replica's KV transfers, a delay added to every engine step (a
        slow node), or one loop turn blocked for `stall_loop_s` (a stuck engine). `target_replica`
        picks the replica (read by the request router)."""
        if not self.fault_injection:
            raise PermissionError("fault injection is off (fault_tolerance.fault_injection: false)")

        def apply():
            if pull is not None:
                self.core.core.transport.fault = pull
            if step_delay_s is not None:
                self.core.engine.step_delay_s = step_delay_s

        await self.loop.call(apply)
        if stall_loop_s:
            asyncio.ensure_future(self.loop.call(lambda: time.sleep(stall_loop_s)))

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown(timeout=2)
        try:  # leaving: no more decisions should name this replica (it also goes stale in 3 s)
            from router.actor import get_router  # noqa: PLC0415

            get_router().forget.remote(self.replica_id)
        except Exception:  # noqa: BLE001 — best effort while the process ends
            pass
