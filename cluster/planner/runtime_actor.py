"""The run-time planner on a live cluster: every planner.interval_s it reads the replicas' loads
from its app's routers (one per serving group), decides per serving group with `SplitPolicy`
(cluster/planner/runtime.py), and moves the chosen replica by calling `set_role` through the
handle of the deployment it lives in (cluster/serving/replica.py: drain, flip, re-register; weights kept).

Each decision other than a quiet hold is logged (`Decision.log_line`) and kept (`history()`, read
by `pdserve status` and the tests); the pools' pressures are gauges and every decision is counted
(`pdserve_planner_*`). A move is awaited before the next decision (its drain is bounded by
planner.drain_timeout_s; past it the replica keeps its role and the move is recorded as called
off), and the whole call by planner.move_timeout_s (a replica or a router that never answers
cannot hold the planner); reading the loads is bounded by LOADS_TIMEOUT_S. The deployment's health
check fails when no tick has ended for longer than a tick may take (`RuntimePlanner.stalled`), so
Serve restarts a planner whose loop is stuck.

One planner per app: a Serve deployment of one replica, `PlannerServer`, which Serve starts,
restarts and removes with the app.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from cluster.errors import DrainTimeoutError
from cluster.planner.config import SLO
from cluster.planner.runtime import Decision, SplitOptions, SplitPolicy
from router.policy import ReplicaLoad

# Serve's own logger: in a replica its records go to the replica's log file (and the dashboard);
# a module logger's INFO would go nowhere (Ray configures no root handler in its workers)
log = logging.getLogger("ray.serve")

PLANNER_DEPLOYMENT = "planner"
HISTORY = 256  # decisions kept (quiet holds are not kept)
LOADS_TIMEOUT_S = 10.0  # reading the routers' loads
STALL_SLACK_S = 30.0  # beyond the longest a tick may take, before the planner counts as stalled

# (serving group, the replica's deployment, replica id, role to play, drain timeout) -> set_role's answer
Mover = Callable[[str, str, str, str, float], Awaitable[dict]]


@dataclass(frozen=True)
class Record:
    at: float  # time.time()
    group: str
    decision: Decision
    outcome: str  # "" (hold, scale), "moved in 1.2 s", "called off: ...", "timed out: ...", "failed: ..."

    def as_dict(self) -> dict:
        d = self.decision
        return {"at": self.at, "group": self.group, "action": d.action, "replica_id": d.replica_id, "to": d.to,
                "reason": d.reason, "prefill": round(d.prefill.value, 3), "decode": round(d.decode.value, 3),
                "binding": d.decode.binding if d.to == "decode" else d.prefill.binding if d.to else "",
                "outcome": self.outcome}


class RuntimePlanner:
    """The loop's body without Ray: `loads()` gives the router's live loads, `move` flips a
    replica. One SplitPolicy per serving group (model version)."""

    def __init__(self, slo: SLO, opts: SplitOptions, groups: Sequence[str], loads: Callable[[], Awaitable[list]],
                 move: Mover, drain_timeout_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 move_timeout_s: float | None = None):
        """`move_timeout_s`: the longest a move may take, drain included (None: drain_timeout_s + 30 s)."""
        self.opts = opts
        self.policies = {g: SplitPolicy(slo, opts) for g in groups}
        self.loads, self.move = loads, move
        self.drain_timeout_s = drain_timeout_s
        self.move_timeout_s = drain_timeout_s + 30.0 if move_timeout_s is None else move_timeout_s
        self.clock = clock
        self.history: deque[Record] = deque(maxlen=HISTORY)
        self.ticked_at = clock()  # when the last tick ended (or the planner started)

    def stalled(self) -> str | None:
        """Why the planner's loop counts as stuck (None: it is not): no tick has ended for longer
        than one may take (an interval, the loads' read, a move to its timeout) plus STALL_SLACK_S."""
        limit = self.opts.interval_s + LOADS_TIMEOUT_S + self.move_timeout_s + STALL_SLACK_S
        idle = self.clock() - self.ticked_at
        return None if idle <= limit else f"no planner tick has ended for {idle:.0f} s (limit {limit:g} s)"

    async def tick(self) -> list[Decision]:
        try:
            return await self._tick()
        finally:
            self.ticked_at = self.clock()

    async def _tick(self) -> list[Decision]:
        loads: list[ReplicaLoad] = await asyncio.wait_for(self.loads(), LOADS_TIMEOUT_S)
        out = []
        for group, policy in self.policies.items():
            mine = [r for r in loads if r.group == group and not r.draining]
            d = policy.decide(mine, self.clock())
            _count(group, d)
            out.append(d)
            if d.action == "hold" and d.reason in ("within bounds", "no prefill pool"):
                continue
            outcome = ""
            if d.action == "flip":
                deployment = next(r.deployment for r in mine if r.replica_id == d.replica_id)
                outcome = await self._move(group, deployment, d)
                if not outcome.startswith("moved"):
                    policy.not_moved()
            log.info("%s%s", d.log_line(), f" -> {outcome}" if outcome else "")
            self.history.append(Record(time.time(), group, d, outcome))
        return out

    async def _move(self, group: str, deployment: str, d: Decision) -> str:
        try:
            done = await asyncio.wait_for(self.move(group, deployment, d.replica_id, d.to, self.drain_timeout_s),
                                          self.move_timeout_s)
        except DrainTimeoutError as e:  # through Serve: a RayTaskError that is also a DrainTimeoutError
            return f"called off: {_cause(e)}"
        except asyncio.TimeoutError:
            return f"timed out: no answer from {d.replica_id} within move_timeout_s {self.move_timeout_s:g}"
        except Exception as e:  # noqa: BLE001 — a move that fails leaves the split as it was; the next decides again
            return f"failed: {type(e).__name__}: {_cause(e)}"
        return f"moved in {done['drained_s']:.2f} s ({done['drained_requests']} requests drained)"


def _cause(e: BaseException) -> str:
    """The error's own message (a RayTaskError's is the remote traceback: its last line)."""
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


def _count(group: str, d: Decision) -> None:
    m = planner_metrics()
    m.decisions.inc(tags={"group": group or "default", "action": d.action})
    for p in (d.prefill, d.decode):
        m.pressure.set(p.value, tags={"group": group or "default", "pool": p.pool})


@dataclass(frozen=True)
class PlannerMetrics:
    decisions: object
    pressure: object


_METRICS: PlannerMetrics | None = None


def planner_metrics() -> PlannerMetrics:
    global _METRICS
    if _METRICS is None:
        from ray.util.metrics import Counter, Gauge  # noqa: PLC0415

        _METRICS = PlannerMetrics(
            decisions=Counter("pdserve_planner_decisions", "The run-time planner's decisions: action hold|flip|scale "
                              "(scale: both pools over their bounds, nothing to move)", ("group", "action")),
            pressure=Gauge("pdserve_planner_pressure", "A pool's measured load over its bound (1: at the bound; "
                           "prefill: queue wait over its TTFT share; decode: KV or step time)", ("group", "pool")))
    return _METRICS


class PlannerServer:
    """The app's planner as a Serve deployment of one replica (cluster/app/builder.py binds it when
    planner.enabled): Serve starts it with the app, restarts it if it dies and removes it with the
    app. `deployments`: serving group -> (prefill deployment, decode deployment)."""

    async def __init__(self, slo: SLO, opts: SplitOptions, deployments: dict[str, tuple[str, str]],
                       drain_timeout_s: float, app_name: str | None = None, move_timeout_s: float | None = None):
        from router.actor import serve_app  # noqa: PLC0415
        from router.cells import group_loads  # noqa: PLC0415

        self.deployments, self.app_name = deployments, app_name or serve_app()

        async def loads():  # each model version's router, or its cells' (router/cells.py)
            return await group_loads(self.app_name, list(deployments))

        self.planner = RuntimePlanner(slo, opts, list(deployments), loads, self._move, drain_timeout_s,
                                      move_timeout_s=move_timeout_s)
        self._task = asyncio.get_running_loop().create_task(self._run())  # the replica's own loop

    async def _move(self, group: str, deployment: str, replica_id: str, to: str, drain_timeout_s: float) -> dict:
        from ray import serve  # noqa: PLC0415

        prefill_name, decode_name = self.deployments[group]
        handle = serve.get_deployment_handle(prefill_name if deployment == "prefill" else decode_name,
                                             app_name=self.app_name)
        return await handle.set_role.remote(to, drain_timeout_s, target_replica=replica_id)

    async def _run(self) -> None:
        while True:
            try:
                await self.planner.tick()
            except Exception:  # noqa: BLE001 — the router restarting, a replica gone: decide again next time
                log.exception("planner: a decision failed")
            await asyncio.sleep(self.planner.opts.interval_s)

    def history(self) -> list[dict]:
        """The decisions kept (oldest first), each with its outcome."""
        return [r.as_dict() for r in self.planner.history]

    def check_health(self) -> None:
        if self._task.done():
            raise RuntimeError(f"the planner's loop ended: {self._task.exception()!r}")
        stalled = self.planner.stalled()
        if stalled is not None:
            raise RuntimeError(stalled)
