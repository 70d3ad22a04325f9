"""`pdserve up`: start (or join RAY_ADDRESS) a Ray cluster, deploy the app, serve until Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import threading


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="start (or join RAY_ADDRESS) a Ray cluster, deploy, serve until Ctrl-C")
    p.add_argument("--config", help="app config YAML (see deploy/pdserve.yaml)")
    p.add_argument("--model", help="HF checkpoint directory or Hub repo id (org/name; default: SmolLM2-135M-Instruct, "
                   "fetched and converted once)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"],
                    help="colocated: no prefill pool, decode replicas prefill locally (default: disaggregated)")
    p.add_argument("--prefill-replicas", type=int)
    p.add_argument("--decode-replicas", type=int)
    p.add_argument("--num-blocks", type=int, help="KV blocks per replica")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="engine.expert_parallel for both pools: a mixture of experts' routed experts partitioned "
                        "whole over each replica's tensor_parallel_size ranks (docs/architecture.md)")
    p.add_argument("--host")
    p.add_argument("--http-port", type=int)
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--direct-ingress", action="store_true",
                    help="the ingress replica serves the ports itself (Serve's direct ingress, no proxy hop; one "
                         "ingress replica per node); the Ray started here gets the environment it needs "
                         "(docs/architecture.md, 'Direct ingress')")
    p.add_argument("--throughput-profile", action="store_true",
                    help="with --direct-ingress: Serve's throughput profile (RAY_SERVE_THROUGHPUT_OPTIMIZED): more "
                         "refusals/s and tokens/s under load, but more latency per token at one stream "
                         "(docs/benchmarks.md)")
    p.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                    help="start the local Ray instance without its dashboard")
    p.set_defaults(func=up)


def load_app_config(args):
    """The app config: the YAML of --config (or the defaults) with the command line's overrides."""
    from cluster.config import AppConfig  # noqa: PLC0415

    data = AppConfig.from_yaml(args.config).model_dump() if args.config else {}
    overrides = {"model": args.model, "http_port": args.http_port, "grpc_port": args.grpc_port, "host": args.host,
                 "mode": args.mode}
    data.update({k: v for k, v in overrides.items() if v is not None})
    for pool, n in (("prefill", args.prefill_replicas), ("decode", args.decode_replicas)):
        if n is not None:
            data.setdefault(pool, {})["num_replicas"] = n
            data[pool]["autoscaling"] = None
    if args.num_blocks is not None:
        data.setdefault("engine", {})["num_blocks"] = args.num_blocks
    if args.enable_expert_parallel:
        data.setdefault("engine", {})["expert_parallel"] = True
    return AppConfig.model_validate(data)


def up(args) -> int:
    import cluster.app.builder as serve_app  # noqa: PLC0415
    from cluster.manifest import ManifestError, resolve_manifests  # noqa: PLC0415

    config = serve_app.ensure_model(load_app_config(args))
    config.check_startable()  # before Ray starts: an open non-loopback bind is refused
    try:  # before Ray starts too: a version whose checkpoint changed since its manifest is refused
        config = resolve_manifests(config)  # what is deployed and printed: each version's checkpoint
        serve_app.check_checkpoints(config)  # a Hub name resolved (downloaded once) before Ray starts
    except (ManifestError, ValueError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    joined = os.environ.get("RAY_ADDRESS") is not None

    def interrupt(*_):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # during start-up: abort, and clean up below
        signal.signal(sig, interrupt)
    if not _start_ray(args, config, joined):
        return 2
    stop = threading.Event()
    try:
        serve_app.start(config)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        _print_endpoints(args, config, joined)
        stop.wait()
    except KeyboardInterrupt:
        print("pdserve: interrupted during start-up", flush=True)
    finally:
        _shut_down(joined)
    print("pdserve: stopped", flush=True)
    return 0


def _start_ray(args, config, joined: bool) -> bool:
    """Join RAY_ADDRESS, or start a local instance; False (said why) where it cannot."""
    import ray  # noqa: PLC0415

    import cluster.app.builder as serve_app  # noqa: PLC0415

    if joined:
        if args.direct_ingress and not serve_app.direct_ingress_on():
            print("pdserve up: --direct-ingress needs the cluster started with it: run `ray start` on every node "
                  "with the environment of cluster.app.builder.direct_ingress_env (deploy/cluster.yaml)",
                  file=sys.stderr)
            return False
        ray.init(address=os.environ["RAY_ADDRESS"], namespace="pdserve")
        return True
    # Ray's CPUs are scheduling slots: give the local instance enough for every replica
    # even on a small machine (the engines share the real cores through torch's threads).
    # The dashboard runs jobs: loopback only (README).
    if args.direct_ingress:  # the ingress replica is the HTTP server: no proxy hop (docs/architecture.md)
        os.environ.update(serve_app.direct_ingress_env(config.http_port,
                                                       throughput_optimized=args.throughput_profile))
    ray.init(namespace="pdserve", num_cpus=max(os.cpu_count() or 1, serve_app.cpus_needed(config)),
             include_dashboard=args.dashboard, dashboard_host="127.0.0.1", dashboard_port=8265)
    return True


def _print_endpoints(args, config, joined: bool) -> None:
    host = "localhost" if config.host in ("0.0.0.0", "::") else config.host
    served = ", ".join(f"{v.name}@{v.label} ({v.config.model})" if not v.single else f"{v.name} ({v.config.model})"
                       for v in config.served_versions())
    print(f"pdserve is serving {served}, "
          f"{'disaggregated' if config.has_prefill_pool else 'colocated (no prefill pool)'}", flush=True)
    print(f"  gRPC    {host}:{config.grpc_port}   (pdserve.v1.Generation, grpc.health.v1.Health)", flush=True)
    print(f"  HTTP    http://{host}:{config.http_port}/v1   (OpenAI-compatible)", flush=True)
    if not joined and args.dashboard:
        print("  Ray dashboard   http://127.0.0.1:8265   (this machine only: README, \"Exposure\")", flush=True)
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":  # Ray's default for a local instance
        print("  Ray token auth  on: `pdserve status`, or `RAY_AUTH_MODE=token serve status` "
              "(Ray's CLIs send the token only with it set)", flush=True)
    print(f"  {config.admission_bounds.describe()}", flush=True)
    print("Ctrl-C to stop.", flush=True)


def _shut_down(joined: bool) -> None:
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    print("pdserve: shutting down", flush=True)
    serve.shutdown()
    if joined:  # the app's detached control actors go with it (router/actor.py)
        from router.actor import kill_app_actors  # noqa: PLC0415

        kill_app_actors("pdserve")
    else:
        ray.shutdown()
