"""What the prefill and decode deployments share. The stack is flat:

    deployment (prefill/deployment.py, decode/deployment.py: the Serve methods)
      -> EngineLoop (cluster/engine/loop.py: one thread; hooks for reports and telemetry)
        -> role (PrefillEngine / DecodeEngine: first token and leases / KV import)
          -> LLMEngine (the verbs the roles call)

An `EngineReplica` builds that stack from the app config: the engine, its NIXL transport, the role
(a `RoleSpec`'s `make`), the loop with its hooks (`LoadReporter`, `ReplicaTelemetry`), and, only
with `fault_tolerance.fault_injection`, the fault wrappers. It also answers Serve's health checks and
autoscaler.

A replica's role is state; its Serve deployment is its address. Every replica answers both roles'
calls (`prefill`, `release`, `generate`), serving those of the role it plays now and refusing the
others with WrongRoleError before starting anything; `set_role` drains it and swaps the role over
the same engine, weights and transport (given the other role's spec: the app builder injects both)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal, Mapping, Sequence

import ray

from cluster.config import AppConfig, TelemetryOptions
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine, resolve_device
from cluster.engine.loop import EngineLoop
from cluster.engine.outputs import RequestOutput, merge_outputs
from cluster.engine.request import DEFAULT_CONTEXT, RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import DrainTimeoutError, WrongReplicaError, WrongRoleError
from cluster.serving import faults
from cluster.serving.registry import RayMetadataStore, get_registry
from cluster.serving.reporting import LoadReporter
from cluster.serving.tensor_parallel import RayRanks, guard_group
from cluster.telemetry import gc_pauses
from cluster.telemetry.replica import ReplicaTelemetry
from kv_transfer.handle import KVHandle
from kv_transfer.layout import engine_layout
from kv_transfer.stats import TransferStats
from kv_transfer.transport import NixlTransport
from router.actor import lookup, serve_app
from router.cells import cell_router

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
DRAIN_POLL_S = 0.05  # a draining replica checks its old role this often
ROUTER_ACK_S = 5.0  # the longest a flip waits for the router to take one of its reports


@dataclass(frozen=True)
class RoleSpec:
    """How a replica plays one role. `make(engine, transport, config)` builds the role object the
    loop drives (prefill/deployment.py, decode/deployment.py); `idle_poll_s`: the loop's idle
    wake-up while it plays it (prefill's serve lease expiry and notices)."""

    make: Callable[[LLMEngine, NixlTransport, AppConfig], Any]
    idle_poll_s: float | None = None


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
        guard_group(engine, ranks)
        return engine, ranks
    except Exception:
        ranks.kill()
        raise


def make_replica_telemetry(options: TelemetryOptions, engine: LLMEngine, transfer_stats: TransferStats,
                           pool: str, replica_id: str, feed=None):
    """The replica's metrics and traces exporter; None (and no probe in the engine) when both are off."""
    if not options.metrics and options.traces == "none":
        return None
    return ReplicaTelemetry(options, engine, transfer_stats, pool, replica_id, feed)


def _serve_replica_id() -> str | None:
    """Serve's id of this replica: routing decisions name replicas by it."""
    from ray import serve  # noqa: PLC0415
    from ray.serve.exceptions import RayServeException  # noqa: PLC0415

    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # not running as a Serve replica
        return None


class EngineReplica:
    """Base of the prefill and decode Serve deployments. Subclasses name their `pool` (the home
    deployment's: its engine options, and the role it starts in) and its `home_role` spec;
    `roles` (injected by the app builder) are the roles it may be flipped to."""

    pool: Role
    home_role: RoleSpec
    ranks: RayRanks | None = None  # a tensor-parallel replica's worker ranks

    def __init__(self, config: dict, roles: Mapping[Role, RoleSpec] | None = None):
        cfg = AppConfig.model_validate(config)
        self.config = cfg
        self.roles: dict[Role, RoleSpec] = {**(roles or {}), self.pool: self.home_role}
        self.role_name: Role = self.pool  # the role it plays now (set_role)
        self._flip = asyncio.Lock()  # one flip at a time
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
        self.transport = transport
        self.faults = faults.install(engine, transport) if cfg.fault_tolerance.fault_injection else None
        self.role = self.home_role.make(engine, transport, cfg)
        self.app = serve_app()  # its router: its app's, of its model version
        self.reporter = LoadReporter(engine, transport.stats, self.replica_id, self.pool, registry,
                                     cell_router(cfg, self.app, self.pool, self.replica_id),
                                     node_id=ray.get_runtime_context().get_node_id(), group=cfg.serving_group)
        hooks = [self.reporter]
        telemetry = make_replica_telemetry(cfg.telemetry, engine, transport.stats, self.pool, self.replica_id,
                                           self.reporter.feed)
        if telemetry is not None:
            hooks.append(telemetry)
        self.loop = EngineLoop(self.role, idle_poll_s=self.home_role.idle_poll_s, name=f"pdserve-{self.pool}",
                               hooks=hooks, nice=getattr(cfg, self.pool).compute_nice,
                               stream_interval=getattr(cfg, self.pool).stream_interval)
        # A full collection holds the GIL, so it stalls the engine's step thread and every stream with
        # it: the model, torch's and transformers' start-up objects are frozen out of the collector,
        # as in the ingress (cluster/telemetry/gc_pauses.py).
        gc_pauses.settle_after_start()

    def arrived(self, target_replica: str | None) -> None:
        """Count a call against the replica it named (none named: not counted)."""
        if target_replica is not None:
            self.routed["on_target" if target_replica == self.replica_id else "off_target"] += 1

    # ---- the roles' calls: served by the role played now, refused (WrongRoleError) by the other --

    def _playing(self, role: Role):
        """The role object, if this replica plays `role` now. Loop thread only: a flip swaps the
        role there too, so a call is checked and started against one role."""
        if self.role_name != role:
            raise WrongRoleError(f"replica {self.replica_id} plays {self.role_name} now, not {role}")
        return self.role

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                      ctx: RequestContext = DEFAULT_CONTEXT, target_replica: str | None = None):
        """Prefill and hold the blocks (-> prefill.result.PrefillResult); cancelling this call
        aborts the prefill. (`target_replica` is read by the request router that brought the call here.)"""
        self.arrived(target_replica)
        stream = self.loop.stream(
            request_id, lambda: self._playing("prefill").submit(request_id, prompt_token_ids, sampling, ctx))
        try:
            async for result in stream:
                return result
        finally:
            await stream.aclose()
        raise RuntimeError(f"prefill stream for {request_id} ended without a result")

    async def release(self, request_id: str, target_replica: str | None = None) -> None:
        """End a lease early (the request was cancelled before decode pulled it); its blocks
        wait out kv_transfer.release_grace_s. The ingress sends it to the replica holding the
        lease (`target_replica`, read by the request router). A replica not playing prefill
        holds no lease: nothing to do."""
        self.arrived(target_replica)
        await self.loop.call(lambda: self.role.abort(request_id) if self.role_name == "prefill" else None)

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
            self._playing("decode").submit(request_id, prompt_token_ids, sampling, kv_handle, ctx, generated)

        async for out in self.loop.stream(request_id, submit, merge=merge_outputs):
            yield out

    # ---- role flips ---------------------------------------------------------------------------

    async def set_role(self, role: Role, drain_timeout_s: float = 60.0, target_replica: str | None = None) -> dict:
        """Play `role` from now on: drain, swap, re-register. The replica reports itself draining
        at once (the router chooses it for nothing; calls already on their way are served as
        before), waits until its old role holds no work (prefill: no prompt, no lease, no ended
        lease's blocks in grace; decode: no stream, no READ or notice outstanding), then builds
        the new role over the same engine (weights and prefix cache kept) and transport, and
        reports its new pool at once. No stream is failed or restarted.

        What stays the home deployment's: the engine and its options (blocks, batch, chunking,
        tensor parallelism), the loop thread's niceness, the telemetry's pool label, Serve's
        scaling and autoscaling (a flipped replica's signals count in its home deployment).
        What follows the role: the loop's idle wake-up and stream_interval.

        Past `drain_timeout_s` the flip is called off: the replica keeps its role and its work,
        is no longer draining, and DrainTimeoutError is raised. Returns {"replica_id", "from",
        "to", "drained_s", "drained_requests"} (the old role's requests when the drain began).
        `target_replica` picks the replica (read by the request router); another replica that the
        call reached (the named one gone) refuses it with WrongReplicaError before anything."""
        self.arrived(target_replica)
        if target_replica is not None and target_replica != self.replica_id:
            # Serve's request router falls back to a random live replica when the target is gone:
            # flipping that one instead would move the wrong replica and report success
            raise WrongReplicaError(f"set_role({role!r}) named replica {target_replica} but reached replica "
                                    f"{self.replica_id}; nothing was changed")
        if role not in self.roles:
            raise ValueError(f"replica {self.replica_id} cannot play {role!r} (it knows {sorted(self.roles)})")
        async with self._flip:
            started = time.monotonic()
            old = self.role_name
            if role == old:
                return self._flipped(old, role, 0.0, 0)
            drained_requests, ack = await self.loop.call(lambda: self._drain(True))
            try:
                await self._acked(ack)  # from here no decision names this replica
                while True:
                    swapped, ack = await self.loop.call(lambda: self._swap(role))
                    if swapped:
                        break
                    if time.monotonic() - started >= drain_timeout_s:
                        raise DrainTimeoutError(
                            f"replica {self.replica_id} still held {old} work after {drain_timeout_s:g} s "
                            f"of drain; it stays {old}")
                    await asyncio.sleep(DRAIN_POLL_S)
            except BaseException:
                _, ack = await self.loop.call(lambda: self._drain(False))
                await self._acked(ack)
                raise
            await self._acked(ack)
            log.info("replica %s flipped %s -> %s after %.2f s of drain (%d requests)",
                     self.replica_id, old, role, time.monotonic() - started, drained_requests)
            return self._flipped(old, role, time.monotonic() - started, drained_requests)

    def _flipped(self, old: Role, new: Role, drained_s: float, drained_requests: int) -> dict:
        return {"replica_id": self.replica_id, "from": old, "to": new, "drained_s": round(drained_s, 4),
                "drained_requests": drained_requests}

    def _drain(self, on: bool):
        """Loop thread: start (or call off) a drain; (the old role's requests, the report's call)."""
        self.reporter.draining = on
        return self.role.in_flight(), self.reporter.push(time.monotonic())

    def _swap(self, role: Role):
        """Loop thread: if the old role holds nothing, the new one takes over; (swapped, the report's call)."""
        if not self.role.drained():
            return False, None
        spec = self.roles[role]
        self.role = spec.make(self.engine, self.transport, self.config)
        self.role_name = role
        self.loop.replace_core(self.role, spec.idle_poll_s, getattr(self.config, role).stream_interval)
        self.reporter.flipped(role)
        if self.reporter.feed is not None:  # with cells, the new role's cell (router/cells.py)
            self.reporter.feed.move(cell_router(self.config, self.app, role, self.replica_id))
        return True, self.reporter.push(time.monotonic())

    async def _acked(self, ack) -> None:
        """Wait (bounded) until the router has the report: after a drain's, no new decision names
        this replica. A router that is down or slow delays nothing: a call a stale decision sends
        here anyway is served during the drain, or refused (WrongRoleError) after the swap."""
        if ack is None:
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(ack), ROUTER_ACK_S)
        except Exception as e:  # noqa: BLE001
            log.warning("replica %s: the router did not take its report within %g s: %r",
                        self.replica_id, ROUTER_ACK_S, e)

    async def load(self, target_replica: str | None = None) -> dict:
        """This replica's load (`target_replica`, read by the request router, picks the replica)."""
        self.arrived(target_replica)
        ranks = {} if self.ranks is None else {"rank_nodes": list(self.ranks.nodes)}  # tensor-parallel: rank 0 first
        return {"replica_id": self.replica_id, "pid": os.getpid(), "routed": dict(self.routed),
                "gc_pauses": gc_pauses.PAUSES.summary(),
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
                           target_replica: str | None = None, poison_token: int | None = None) -> None:
        """Chaos tests and drills (only with fault_tolerance.fault_injection): `pull` "drop" |
        "stall" | "none" on this replica's KV transfers, a delay added to every engine step (a
        slow node), one loop turn blocked for `stall_loop_s` (a stuck engine), or the fraction
        of new requests a decode replica fails at once (`fail_requests`: a broken version), or a
        forward whose input holds `poison_token` raises (a poison request; -1 turns it off).
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
            if poison_token is not None:  # -1: off
                self.faults.poison_token = None if poison_token < 0 else poison_token

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
            feed = self.reporter.feed
            router = None if feed is None else lookup(feed.router.name)  # its cell's; a finalizer creates no actor
            if router is not None:
                router.forget.remote(self.replica_id)
        except Exception:  # noqa: BLE001 — best effort while the process ends
            pass
