"""What the prefill and decode deployments share. The stack is flat:

    deployment (prefill/deployment.py, decode/deployment.py: the Serve methods)
      -> EngineLoop (cluster/engine/loop.py: one thread; hooks for reports and telemetry)
        -> role (PrefillEngine / DecodeEngine: first token and leases / KV import)
          -> LLMEngine (the verbs the roles call)

An `EngineReplica` is a shell over parts, each a class of its own: what it is built from
(`EngineStack`, replica_build.py: the engine, its ranks, its NIXL transport, and only with
`fault_tolerance.fault_injection` the fault wrappers), the role it plays (`PlayedRole`,
replica_role.py: a `RoleSpec`'s `make`), the flip (`RoleFlip`, replica_flip.py), the loop with its
hooks (`LoadReporter`, `ReplicaTelemetry`) and its health (`ReplicaHealth`, replica_health.py). The
shell answers Serve's calls, health checks and autoscaler by handing each to its part.

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
from contextlib import aclosing
from typing import AsyncIterator, Mapping, Sequence

import ray

from cluster.config import AppConfig
from cluster.engine.loop import EngineLoop
from cluster.engine.outputs import RequestOutput, merge_outputs
from cluster.engine.request import DEFAULT_CONTEXT, RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import WrongReplicaError
from cluster.serving import faults
from cluster.serving.replica_build import (EngineStack, make_replica_telemetry, rank_of, serve_replica_id,
                                           serve_replica_rank)
from cluster.serving.replica_flip import RoleFlip
from cluster.serving.replica_health import ReplicaHealth
from cluster.serving.replica_role import PlayedRole, Role, RoleSpec
from cluster.serving.reporting import LoadReporter
from cluster.serving.tensor_parallel import RayRanks
from cluster.telemetry import gc_pauses
from kv_transfer.handle import KVHandle
from router.actor import lookup, serve_app
from router.cells import cell_router
from router.replies import ReplyLinks

log = logging.getLogger(__name__)

__all__ = ["EngineReplica", "Role", "RoleSpec"]


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
        self.replica_id = serve_replica_id() or f"{self.pool}-{uuid.uuid4().hex[:8]}"
        # Calls that named a replica (the router's choice, passed as target_replica) and arrived
        # here: on target, or not (Serve's request router handed the replica to another call)
        self.routed = {"on_target": 0, "off_target": 0}
        stack = EngineStack.build(cfg, self.pool, self.replica_id)
        self.engine, self.ranks, self.transport, self.faults = stack.engine, stack.ranks, stack.transport, stack.faults
        self.played = PlayedRole({**(roles or {}), self.pool: self.home_role}, self.pool, self.engine, self.transport,
                                 cfg)
        self.app = serve_app()  # its router: its app's, of its model version
        rank = serve_replica_rank()  # with cells, its rank's cell feeds (router/cells.py)
        self.reporter = LoadReporter(self.engine, self.transport.stats, self.replica_id, self.pool, stack.registry,
                                     cell_router(cfg, self.app, self.pool, self.replica_id, rank),
                                     node_id=ray.get_runtime_context().get_node_id(), group=cfg.serving_group)
        hooks = [self.reporter]
        self.replies = ReplyLinks(ray.get_runtime_context().get_node_id())  # decode outputs to the ingresses
        telemetry = make_replica_telemetry(cfg.telemetry, self.engine, self.transport.stats, self.pool,
                                           self.replica_id, self.reporter.feed, self.replies)
        if telemetry is not None:
            hooks.append(telemetry)
        self.loop = EngineLoop(self.played.obj, idle_poll_s=self.home_role.idle_poll_s, name=f"pdserve-{self.pool}",
                               hooks=hooks, nice=getattr(cfg, self.pool).compute_nice,
                               stream_interval=getattr(cfg, self.pool).stream_interval)
        self.flip = RoleFlip(self.replica_id, self.played, self.loop, self.reporter, self.app, rank)
        self.health = ReplicaHealth(self.pool, self.engine, self.loop, self.ranks, cfg.fault_tolerance.stuck_loop_s,
                                    cfg.fault_tolerance.max_consecutive_step_errors)
        # A full collection holds the GIL, so it stalls the engine's step thread and every stream with
        # it: the model, torch's and transformers' start-up objects are frozen out of the collector,
        # as in the ingress (cluster/telemetry/gc_pauses.py).
        gc_pauses.settle_after_start()

    @property
    def role(self):
        """The role object the loop drives now."""
        return self.played.obj

    @property
    def role_name(self) -> Role:
        """The role it plays now (set_role)."""
        return self.played.name

    async def reconfigure(self, user_config, rank=None) -> None:
        """Serve's call after the replica starts and whenever Serve changes its rank (a
        ReplicaRank; named `rank` so Serve passes it): a new rank may be a new cell, whose router
        it feeds from then on (RoleFlip.reranked). The deployments take no user_config (the app's
        config is their options): one is refused, not ignored."""
        if user_config is not None:
            raise ValueError("pdserve's replicas take no Serve user_config (their options are the app's config)")
        await self.flip.reranked(rank_of(rank))

    def arrived(self, target_replica: str | None) -> None:
        """Count a call against the replica it named (none named: not counted). ~60 ns a call
        (docs/benchmarks.md, issue 53): kept on the call path; `load` returns the counts, which the
        routing tests read."""
        if target_replica is not None:
            self.routed["on_target" if target_replica == self.replica_id else "off_target"] += 1

    # ---- the roles' calls: served by the role played now, refused (WrongRoleError) by the other --

    def _playing(self, role: Role):
        """The role object, if this replica plays `role` now. Loop thread only."""
        return self.played.playing(role, self.replica_id)

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
        reply_to: tuple | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas. With a KV handle the prompt's KV is pulled from prefill
        (the first token was already sent); without one the prompt is prefilled here, after it
        the `generated` tokens (a migrated request's, already sent). Deltas that queue while the
        caller is busy are merged into one message. With `reply_to` (an ingress's inbox and the
        leg's call there: router/replies.py) the deltas go there as frames while its connection
        holds; this call streams what cannot."""
        self.arrived(target_replica)
        if self.faults is not None and self.faults.fails_request():
            raise RuntimeError(f"request {request_id}: failed by fault injection (fail_requests)")

        def submit():
            self._playing("decode").submit(request_id, prompt_token_ids, sampling, kv_handle, ctx, generated)

        async with aclosing(self.replies.send(reply_to, self.loop.stream(request_id, submit, merge=merge_outputs))) \
                as outs:  # closed with this generator (Serve's cancel): the request is aborted now
            async for out in outs:
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
        scaling and autoscaling (a flipped replica's signals count in its home deployment), and
        with cells the cell it feeds (its rank's in the home deployment: router/cells.py).
        What follows the role: the loop's idle wake-up and stream_interval.

        Past `drain_timeout_s` the flip is called off: the replica keeps its role and its work,
        is no longer draining, and DrainTimeoutError is raised. Returns {"replica_id", "from",
        "to", "drained_s", "drained_requests"} (the old role's requests when the drain began).
        `target_replica` picks the replica (read by the request router); another replica that the
        call reached (the named one gone) refuses it with WrongReplicaError before anything."""
        self.arrived(target_replica)
        return await self.flip.set_role(role, drain_timeout_s, target_replica)

    async def load(self, target_replica: str | None = None) -> dict:
        """This replica's load (`target_replica`, read by the request router, picks the replica)."""
        self.arrived(target_replica)
        ranks = {} if self.ranks is None else {"rank_nodes": list(self.ranks.nodes)}  # tensor-parallel: rank 0 first
        return {"replica_id": self.replica_id, "pid": os.getpid(), "routed": dict(self.routed),
                "reply_legs": dict(self.replies.legs),
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
        self.health.check()

    async def inject_fault(self, pull: faults.PullFault | None = None, step_delay_s: float | None = None,
                           stall_loop_s: float | None = None, fail_requests: float | None = None,
                           target_replica: str | None = None, poison_token: int | None = None,
                           notices: faults.NoticeFault | None = None, close_replies: bool = False) -> str:
        """Chaos tests and drills (only with fault_tolerance.fault_injection): `pull` "drop" |
        "stall" | "none" on this replica's KV transfers, a delay added to every engine step (a
        slow node), one loop turn blocked for `stall_loop_s` (a stuck engine), or the fraction
        of new requests a decode replica fails at once (`fail_requests`: a broken version), or a
        forward whose input holds `poison_token` raises (a poison request; -1 turns it off), or
        `notices` "drop": the lease notices this replica sends prefill are lost (as a killed one's), or
        `close_replies`: its connections to the ingresses' reply inboxes closed now (router/replies.py).
        `target_replica` picks the replica (read by the request router); another replica that the
        call reached (the named one gone, or not yet known to the caller's handle) refuses it with
        WrongReplicaError before changing anything. Returns the replica id it was applied on."""
        if self.faults is None:
            raise PermissionError("fault injection is off (fault_tolerance.fault_injection: false)")
        if target_replica is not None and target_replica != self.replica_id:
            raise WrongReplicaError(f"inject_fault named replica {target_replica} but reached replica "
                                    f"{self.replica_id}; nothing was changed")

        def apply():
            if pull is not None:
                self.faults.pull = pull
            if notices is not None:
                self.faults.notices = notices
            if step_delay_s is not None:
                self.faults.step_delay_s = step_delay_s
            if fail_requests is not None:
                self.faults.fail_requests = fail_requests
            if poison_token is not None:  # -1: off
                self.faults.poison_token = None if poison_token < 0 else poison_token

        await self.loop.call(apply)
        if close_replies:
            self.replies.close()
        if stall_loop_s:
            asyncio.ensure_future(self.loop.call(lambda: time.sleep(stall_loop_s)))
        return self.replica_id

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
