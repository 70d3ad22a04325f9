"""Test helpers: bounded waits (poll a condition until it holds or the time runs out, never a bare
sleep), the pools' loads, and the Ray modules' Serve app (ServeApps, grpc_stub, http_base)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.config import AppConfig


def wait_for(predicate, what: str = "condition", timeout: float = 15.0, retry_on: tuple = ()) -> None:
    """Poll `predicate` until true; exceptions of the types in `retry_on` count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except retry_on:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def wait_until(predicate, what: str = "condition", timeout: float = 20.0) -> None:
    """wait_for, through restarts of the actor the predicate asks (Ray answers "unavailable")."""
    import ray

    wait_for(predicate, what, timeout, retry_on=(ray.exceptions.ActorUnavailableError,))


def serve_replica_ids(app: str = "pdserve") -> dict[str, list[str]]:
    """The live replicas of a Serve app, per deployment. Serve names each replica's actor
    SERVE_REPLICA::app#deployment#id (the id a replica reports under), and only live actors are listed."""
    import ray

    ids: dict[str, list[str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"SERVE_REPLICA::{app}#"):
            _, deployment, replica = actor["name"].removeprefix("SERVE_REPLICA::").split("#")
            ids.setdefault(deployment, []).append(replica)
    return {d: sorted(r) for d, r in ids.items()}


def inject_fault(replica: str, deployment: str = "decode", app: str = "pdserve", timeout: float = 30.0,
                 **fault) -> None:
    """Apply `fault` (EngineReplica.inject_fault's keywords) on that one replica. A handle sends a
    call naming a replica it does not know yet (a replacement just started) to another one, which
    refuses it (WrongReplicaError, nothing changed): retried until the named replica applied it."""
    from ray import serve

    from cluster.errors import WrongReplicaError

    handle = serve.get_deployment_handle(deployment, app)
    wait_for(lambda: handle.inject_fault.remote(**fault, target_replica=replica).result(timeout_s=30) == replica,
             f"{deployment} replica {replica} to take the fault {fault}", timeout, retry_on=(WrongReplicaError,))


def pool_loads(pools: tuple[str, ...] = ("prefill", "decode")) -> dict[str, dict]:
    """The load of the `pdserve` app's prefill and decode replica (one each in the tests that ask),
    or of the named deployments' (a model version's pools)."""
    from ray import serve

    return {pool: serve.get_deployment_handle(pool, "pdserve").load.remote().result(timeout_s=30)
            for pool in pools}


def wait_pools_whole(timeout: float = 30.0, pools: tuple[str, ...] = ("prefill", "decode")) -> dict[str, dict]:
    """Until both pools (or the named ones) have every block free and nothing running, waiting,
    importing or held; returns those loads (a leak shows as a timeout naming the last loads seen)."""
    seen: dict[str, dict] = {}

    def whole() -> bool:
        seen.update(pool_loads(pools))
        return all(s["free_blocks"] == s["total_blocks"] and s["running"] == s["waiting"] == s["importing"]
                   == s["held"] == 0 for s in seen.values())

    try:
        wait_for(whole, "both pools back at their totals", timeout)
    except AssertionError as e:  # name the loads last seen (the message is made after the wait)
        raise AssertionError(f"{e} (last seen: {seen})") from None
    return seen


def kill_app_actors(app: str = "pdserve") -> None:
    """The detached control actors an app creates (routers, admission, audit writer, ledger,
    rollout: router/actor.py): a test module's own state, so the next module's app starts them with
    its own config."""
    from router.actor import kill_app_actors as kill  # noqa: PLC0415

    kill(app)


def app_router(app: str = "pdserve"):
    """The router of a single-model test app (router/actor.py names it by app and model version),
    looked up: a test never creates one."""
    from router.actor import ROUTER, app_actor_names, lookup  # noqa: PLC0415

    names = app_actor_names(app, ROUTER)
    assert len(names) == 1, f"app {app!r} has routers {names}, not one"
    return lookup(names[0])


# ---- the Serve app of the Ray tests -------------------------------------------------------------------

# What every test app shares unless a module overrides it: one prefill and one decode replica at half a
# CPU each (so an app fits beside the session's other actors), 64 KV blocks, a 1 s graceful shutdown.
# Admission's load bounds off (they are on by default, `auto` from telemetry.slo): the Ray test apps
# share two cores with each other's pools, and the tests that push load count tokens, cancellations
# or audit records, not refusals; with the default 0.5 s bound the ingress shed a few of their requests
# in some runs (a flaky test), and during a rolling update (tests/serving/test_model_versions.py) it
# predicted 10-20 s waits while the new replicas started and refused those requests. The modules about admission set their bounds; the default itself is
# tested in tests/ingress/gateway/test_capacity.py and measured by the burst benchmark's defaults arm.
APP_DEFAULTS = {"engine": {"num_blocks": 64}, "prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5},
                "admission": {"max_queue_wait_s": "none", "target_itl_s": "none"},
                "graceful_shutdown_timeout_s": 1.0}


def _merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` laid over it, dicts merged key by key (so prefill={"num_replicas": 2}
    keeps the default num_cpus)."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class ServeApps:
    """The Serve app of the Ray test modules, one at a time, named `pdserve` (the tests' handles and
    the builder name it so): `with serve_apps.run(model, **overrides) as cfg` deploys it and deletes it
    with its control actors (routers, admission, audit writer, ledger, rollout) when the block exits.
    The config is APP_DEFAULTS with the overrides merged in, on Serve's ports.

    Serve itself (controller and proxies, on two ports picked when it starts) stays up from the first
    app to the end of the session, or to the next Ray test that runs Serve its own way (conftest stops
    it): starting Serve and shutting it down for every module cost about 3 s a module more than
    deploying and deleting the app on a running Serve.

    Every module deploys its own app: no two modules ask for the same config, and most of them kill
    replicas, scale, or count from a fresh app."""

    def __init__(self):
        self.ports: tuple[int, int] | None = None  # (http, grpc) while Serve runs
        self.running = False  # an app is deployed

    def config(self, model: str | None, **overrides) -> AppConfig:
        """The app config these overrides make, on Serve's ports (Serve is started if it is not up)."""
        from ray import serve  # noqa: PLC0415

        from cluster.app.builder import start_serve  # noqa: PLC0415
        from cluster.config import AppConfig  # noqa: PLC0415
        from cluster.tools.netutil import free_port  # noqa: PLC0415

        fresh = self.ports is None
        if fresh:
            serve.shutdown()  # a Serve that some module left running would keep its own ports
            self.ports = (free_port(), free_port())
        cfg = AppConfig.model_validate(_merged(APP_DEFAULTS, {"model": model, **overrides})
                                       | {"http_port": self.ports[0], "grpc_port": self.ports[1]})
        if fresh:
            start_serve(cfg)
        return cfg

    @contextmanager
    def run(self, model: str | None, deploy=None, **overrides) -> Iterator[AppConfig]:
        """`deploy(cfg)` deploys the app when the module has its own way (default: the builder's start,
        whose serve.start finds Serve up on these ports and keeps it)."""
        import cluster.app.builder as builder  # noqa: PLC0415

        cfg = self.config(model, **overrides)
        self.stop_app()  # one app at a time
        self.running = True  # before the deploy: a start that fails half way is deleted too
        try:
            (deploy or builder.start)(cfg)
            yield cfg
        finally:
            self.stop_app()

    def stop_app(self) -> None:
        """Delete the running app and its detached actors (the next app starts them with its config)."""
        if self.running:
            from ray import serve  # noqa: PLC0415

            serve.delete("pdserve")
            kill_app_actors()
        self.running = False

    def stop(self) -> None:
        """The app, then Serve itself."""
        if self.ports is not None:
            from ray import serve  # noqa: PLC0415

            self.stop_app()
            serve.shutdown()
        self.ports = None


SERVE_APPS = ServeApps()


@contextmanager
def grpc_stub(cfg: AppConfig, options: tuple = ()) -> Iterator:
    """A Generation stub on the app's gRPC port (the channel, with these options, closes with the block)."""
    import grpc  # noqa: PLC0415

    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: PLC0415

    with grpc.insecure_channel(f"localhost:{cfg.grpc_port}", options=list(options)) as channel:
        yield pb_grpc.GenerationStub(channel)


def http_base(cfg: AppConfig) -> str:
    return f"http://localhost:{cfg.http_port}"


def front_door(cfg: "AppConfig", prefill=None, decode=None, **kw):
    """A FrontDoor for `cfg` in this process (local quotas, no Ray actors), every model version
    on the same pools (None: none)."""
    from router.ingress.gateway.front_door import FrontDoor

    return FrontDoor.build(cfg, {v.config.serving_group: (prefill, decode) for v in cfg.served_versions()}, **kw)


async def generate(door, prompt=None, ids=None, tenant: str = "default", **kw):
    """One request's deltas through `door` (kw: SamplingSpec fields, or ClientRequest fields:
    model, messages, tools, n, deadline, session, label)."""
    from router.ingress.request import ClientRequest, SamplingSpec

    request_fields = {"model", "messages", "tools", "n", "deadline", "session", "label"}
    spec = SamplingSpec(**{k: v for k, v in kw.items() if k not in request_fields})
    request = ClientRequest(tenant, spec, prompt=prompt, prompt_token_ids=None if ids is None else tuple(ids),
                            **{k: v for k, v in kw.items() if k in request_fields})
    reply = await door.serve(request)
    stream = reply.choices[0].stream
    try:
        yield reply.choices[0].first
        async for d in stream:
            yield d
    finally:
        await stream.aclose()  # the client's going away: both legs stop
