"""Builds the Serve application from one AppConfig: the same builder serves `pdserve up` and
`serve run deploy/serve.yaml` (import path `cluster.app.builder:app_builder`)."""

from __future__ import annotations

import logging
from pathlib import Path

from ray import serve
from ray.serve.config import RequestRouterConfig, gRPCOptions

from cluster.config import AppConfig, PoolOptions
from cluster.serving.autoscaling_policy import serve_autoscaling_config

log = logging.getLogger(__name__)

DEMO_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "demo-model"


def ensure_model(config: AppConfig) -> AppConfig:
    """With no model configured, write (once) and use the demo checkpoint."""
    if config.model is not None:
        return config
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        from cluster.engine.model.init_model import init_model  # noqa: PLC0415

        init_model(DEMO_MODEL_DIR)
        log.info("wrote the demo model to %s", DEMO_MODEL_DIR)
    return config.model_copy(update={"model": str(DEMO_MODEL_DIR), "served_model_name":
                                     config.served_model_name or "pdserve-demo"})


def _pool_options(name: str, config: AppConfig) -> dict:
    pool: PoolOptions = getattr(config, name)
    opts = {
        # Custom resources (e.g. pdserve_decode) keep each pool on its own nodes (deploy/cluster.yaml).
        "ray_actor_options": {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus, "resources": pool.resources},
        "max_ongoing_requests": pool.max_ongoing_requests,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": min(2.0, config.graceful_shutdown_timeout_s),
        "request_router_config": RequestRouterConfig(
            request_router_class="router.serve_router:PrefixAwareRequestRouter"),
        # Serve notices a dead or stuck replica within a period; callers' request routers then drop
        # it (and the router forgets it). Serve's default is 10 s.
        "health_check_period_s": config.health_check_period_s,
    }
    if pool.autoscaling is not None:
        opts["autoscaling_config"] = serve_autoscaling_config(name, pool.autoscaling)
    else:
        opts["num_replicas"] = pool.num_replicas
    return opts


INGRESS_CPUS = 0.5


def cpus_needed(config: AppConfig) -> int:
    """Ray CPU slots the app asks for at its initial size (for sizing a local Ray instance)."""
    def pool(p: PoolOptions) -> float:
        n = p.autoscaling.max_replicas if p.autoscaling else p.num_replicas
        return n * p.num_cpus

    prefill = pool(config.prefill) if config.has_prefill_pool else 0.0
    return int(-(-(prefill + pool(config.decode) + INGRESS_CPUS * config.ingress_replicas) // 1))


def build_app(config: AppConfig):
    from decode.deployment import DecodeServer  # noqa: PLC0415
    from prefill.deployment import PrefillServer  # noqa: PLC0415
    from router.ingress.deployment import Ingress  # noqa: PLC0415

    config.check_startable()  # an open non-loopback bind, a tenant without keys: refuse here
    config = ensure_model(config)
    engine_cfg = engine_config(config)
    decode = serve.deployment(DecodeServer, name="decode", **_pool_options("decode", config)).bind(engine_cfg)
    prefill = None  # colocated: decode replicas prefill locally
    if config.has_prefill_pool:
        prefill = serve.deployment(PrefillServer, name="prefill", **_pool_options("prefill", config)).bind(engine_cfg)
    ingress = serve.deployment(Ingress, name="ingress", num_replicas=config.ingress_replicas,
                               ray_actor_options={"num_cpus": INGRESS_CPUS}, max_ongoing_requests=1024,
                               graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
                               graceful_shutdown_wait_loop_s=min(2.0, config.graceful_shutdown_timeout_s))
    return ingress.bind(config.model_dump(), prefill, decode)


def engine_config(config: AppConfig) -> dict:
    """What the prefill and decode replicas are built from: the app config without any API key or
    key source (keys go to the ingress only)."""
    return config.without_keys().model_dump()


def app_builder(args: dict):
    """`serve run` entry: args are the AppConfig fields, or {"config_file": PATH}."""
    if "config_file" in args:
        return build_app(AppConfig.from_yaml(args["config_file"]))
    return build_app(AppConfig.model_validate(args))


GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"  # the only knob of Serve's gRPC proxy (Ray 2.60)


def grpc_options(config: AppConfig) -> gRPCOptions:
    from router.ingress.deployment import GRPC_SERVICERS  # noqa: PLC0415

    return gRPCOptions(port=config.grpc_port, grpc_servicer_functions=GRPC_SERVICERS)


def start(config: AppConfig, blocking: bool = False):
    """Start Serve's proxies on the configured ports and deploy the app (Ray already running)."""
    serve.start(http_options={"host": config.host, "port": config.http_port}, grpc_options=grpc_options(config))
    return serve.run(build_app(config), name="pdserve", route_prefix="/", blocking=blocking)
