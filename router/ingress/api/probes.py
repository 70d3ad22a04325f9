"""What probes ask the ingress: is a decode replica of the model live (gRPC health Check, HTTP
/health: `Liveness`), which version serves (/version), and this ingress's own gauges (/metrics)."""

from __future__ import annotations

import asyncio
import logging
import time
from importlib import metadata
from typing import Awaitable, Callable

from cluster.telemetry import gc_pauses
from router.ingress.gateway.front_door import FrontDoor

log = logging.getLogger(__name__)

LIVE_TIMEOUT_S = 1.0  # a decode replica that cannot answer its load within this is not serving
LIVE_TTL_S = 1.0  # a probe's answer serves every health call for this long
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Liveness:
    """The answer health calls get (both edges, no key): one `probe` at a time, its answer kept
    `ttl_s`. Calls that arrive while a probe runs wait for that one; none starts another. So a
    flood of unauthenticated health calls costs at most one probe a `ttl_s`, whatever their
    number (each used to call a decode replica of every model version, on its engine's thread).
    A probe that raises answers "not live"."""

    def __init__(self, probe: Callable[[], Awaitable[bool]], ttl_s: float = LIVE_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._probe, self.ttl_s, self._clock = probe, ttl_s, clock
        self._answer: tuple[float, bool] | None = None  # (when, live)
        self._running: asyncio.Future | None = None
        self.probes = 0  # probes started

    async def live(self) -> bool:
        if self._answer is not None and self._clock() - self._answer[0] < self.ttl_s:
            return self._answer[1]
        if self._running is None:
            self.probes += 1
            self._running = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._running)  # a caller that leaves does not cancel it for the others

    async def _run(self) -> bool:
        try:
            live = bool(await self._probe())
        except Exception as e:  # noqa: BLE001 — any failure is "not live"
            log.info("health: the liveness probe failed (%r)", e)
            live = False
        self._answer, self._running = (self._clock(), live), None
        return live


def door_liveness(door: FrontDoor) -> Liveness:
    """The front door's own probe (a bounded call to each version's decode pool), cached: for a
    door outside a Serve app (tests, tools). The ingress gives its edges `serve_liveness`."""
    return Liveness(lambda: door.live(LIVE_TIMEOUT_S))


def serve_liveness(door: FrontDoor, pools: dict, timeout_s: float = LIVE_TIMEOUT_S) -> Liveness:
    """Liveness as Serve's controller knows it, in one call: every model version's decode
    deployment (but those that may sleep: asleep is not down) has a replica in state RUNNING, which
    Serve health-checks (the replicas' check_health: the engine loop alive and moving). No replica,
    and no engine thread, is called. `pools`: serving group -> (prefill, decode) handles."""
    from router.ingress.gateway.front_door import may_sleep  # noqa: PLC0415

    sleepy = {f.group for f in door.catalog.flows if may_sleep(f.config)}
    wanted = [(h.app_name, h.deployment_name) for group, (_, h) in pools.items() if group not in sleepy and h]
    controller = _serve_controller()

    async def probe() -> bool:
        details = await asyncio.wait_for(controller.get_serve_instance_details.remote(), timeout_s)
        apps = details.get("applications", {})
        for app, name in wanted:
            replicas = apps.get(app, {}).get("deployments", {}).get(name, {}).get("replicas", [])
            if not any(r.get("state") == "RUNNING" for r in replicas):
                return False
        return True

    return Liveness(probe)


def _serve_controller():
    import ray  # noqa: PLC0415
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE  # noqa: PLC0415

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


def package_version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def version_info(door: FrontDoor, tenant: str) -> dict:
    """pdserve's version, the first model (as before several models) and every model's versions
    that /v1/models lists to `tenant` (the caller, authorized as for /v1/models)."""
    models = door.model_info(tenant)
    return {"version": package_version(), "model": models[0]["id"], "mode": door.config.mode,
            "models": {m["id"]: m["versions"] for m in models}}


def metrics_text(door: FrontDoor) -> bytes:
    """In-flight requests on this ingress (and per tenant while auth is off: there is only
    `default` then), as a Prometheus scrape (prometheus_client, a registry of its own, so nothing
    global is touched). Served without a key: with keys configured it names no tenant (the
    per-tenant series are on Ray's metrics endpoint, inside the cluster network)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest  # noqa: PLC0415

    registry = CollectorRegistry()
    adm = door.admission
    Gauge("pdserve_ingress_inflight", "Requests in flight on this ingress", registry=registry).set(adm.total_inflight)
    cap = Gauge("pdserve_ingress_max_inflight", "max_inflight of this ingress (auto: as sized now)", registry=registry)
    cap.set(adm.max_inflight())
    if not adm.auth_enabled:
        per = Gauge("pdserve_ingress_tenant_inflight", "Requests in flight per tenant", ["tenant"], registry=registry)
        for tenant, n in adm.inflight_by_tenant().items():
            per.labels(tenant).set(n)
    err = door.capacity.first_tokens.prediction_error()
    if err is not None:  # the queue model's predicted time to first token vs the actual, latest requests
        g = Gauge("pdserve_ingress_ttft_prediction_error_seconds",
                  "Actual minus predicted time to first token (median) and its absolute quantiles, latest "
                  "requests", ["stat"], registry=registry)
        for stat in ("median", "abs_p50", "abs_p90", "abs_p99"):
            g.labels(stat).set(err[stat])
        Gauge("pdserve_ingress_ttft_predictions", "Requests in that comparison",
              registry=registry).set(err["count"])
    gc_gauges(registry)
    shadow = Gauge("pdserve_ingress_shadow_requests", "Mirrored requests by model, candidate version and outcome "
                   "(same / different text than the client got, failed, shed)", ["model", "version", "outcome"],
                   registry=registry)
    shadow_runner = door.catalog.shadow
    for (model, version, outcome), n in sorted(shadow_runner.outcomes.items()):
        shadow.labels(model, version, outcome).set(n)
    mirrors = Gauge("pdserve_ingress_shadow_inflight", "Mirrored requests running or not yet counted, by model",
                    ["model"], registry=registry)
    for model, n in sorted(shadow_runner.inflight.items()):
        mirrors.labels(model).set(n)
    info = Gauge("pdserve_ingress_info", "Version and model", ["version", "model"], registry=registry)
    info.labels(package_version(), door.model_info()[0]["id"]).set(1)
    return generate_latest(registry)


def gc_gauges(registry) -> None:
    """This process's garbage collections (cluster/telemetry/gc_pauses.py): every one, timed by
    generation, and the full ones the ingress ran itself, out of traffic."""
    from prometheus_client import Gauge  # noqa: PLC0415

    pauses = Gauge("pdserve_ingress_gc_pauses", "Garbage collections since start, by generation",
                   ["generation"], registry=registry)
    pause_s = Gauge("pdserve_ingress_gc_pause_seconds", "Wall time in garbage collections since start "
                    "(stat=total) and the longest one (stat=max), by generation", ["generation", "stat"],
                    registry=registry)
    for gen, p in enumerate(gc_pauses.PAUSES.by_generation):
        pauses.labels(str(gen)).set(p.count)
        pause_s.labels(str(gen), "total").set(p.total_s)
        pause_s.labels(str(gen), "max").set(p.max_s)
    full = gc_pauses.FULL  # gen2 collections the ingress ran itself (deferred out of traffic)
    runs = Gauge("pdserve_ingress_gc_full_runs", "Full collections the ingress ran itself: at a quiet moment "
                 "(when=idle), or under load once gen2 held garbage for max_interval_s (when=forced)", ["when"],
                 registry=registry)
    run_s = Gauge("pdserve_ingress_gc_full_run_seconds", "Wall time in those collections (stat=total) and the "
                  "longest one (stat=max)", ["when", "stat"], registry=registry)
    for when, p in (("idle", full.idle), ("forced", full.forced)):
        runs.labels(when).set(p.count)
        run_s.labels(when, "total").set(p.total_s)
        run_s.labels(when, "max").set(p.max_s)
    Gauge("pdserve_ingress_gc_full_deferred", "Times a full collection fell due (the collector's default "
          "threshold) while the ingress was busy, and was put off", registry=registry).set(full.deferred)
    Gauge("pdserve_ingress_gc_full_freed_objects", "Unreachable objects those collections found",
          registry=registry).set(full.freed)
