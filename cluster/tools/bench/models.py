"""Model versions (issue 18): what choosing a version costs a request, how fast a manual rollback and
the canary gate take effect, and what a sleeping model's cold start costs.

    python -m cluster.tools.bench.models [--rounds 5] [--model smollm2|random]

One app on a local Ray, colocated: model `m` with versions `base` and `canary` (the same checkpoint
under two labels: the figures are about moving traffic, not about the models), and model `sleepy`
whose decode pool has min_replicas 0 and a short idle_timeout_s.
- select: ModelCatalog.select per call (two versions, a sticky key and none), in process.
- rollback: all traffic on the canary, then `rollback` on the rollout actor; the time until five
  requests in a row (one client, back to back) come from the baseline, per round.
- gate: the canary fails every request (fault injection) under four clients; the time until the
  gate rolls it back, per round (its window and minimum request count set below).
- cold start: a request to the sleeping model, request in -> first token out, against the next
  request's (warm) time to first token; then the pool is left to fall asleep again.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

from cluster.config import AppConfig

WINDOW_S, MIN_REQUESTS, IDLE_S = 5.0, 10, 4.0


def select_cost(model_dir: str, calls: int = 200_000) -> dict[str, float]:
    from router.ingress.versions.catalog import ModelCatalog
    from router.ingress.flow.request_flow import RequestFlow

    cfg = AppConfig.model_validate({"models": {"m": {"versions": {"base": {"model": model_dir, "weight": 9},
                                                                  "canary": {"model": model_dir, "weight": 1}}}}})
    flows = {(v.name, v.label): RequestFlow(v.config, None, None) for v in cfg.served_versions()}
    catalog = ModelCatalog.build(cfg, flows, random.Random(0))
    out = {}
    for what, session in (("random", None), ("sticky", "s:user-1234")):
        t0 = time.perf_counter()
        for _ in range(calls):
            catalog.select("m", "default", session)
        out[what] = (time.perf_counter() - t0) / calls * 1e6
    return out


def main() -> None:
    import grpc
    import ray
    from ray import serve

    import cluster.app.builder as serve_app
    from cluster.app.builder import ensure_model
    from cluster.tools.netutil import free_port
    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
    from router.actor import DEFAULT_APP, NAMESPACE
    from router.ingress.versions.rollout_actor import rollout_name

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", choices=("smollm2", "random"), default="smollm2")
    args = ap.parse_args()

    model = ensure_model(AppConfig(), default=args.model).model
    cost = select_cost(model)
    print(f"select: {cost['random']:.2f} us a request (random draw), {cost['sticky']:.2f} us (sticky key: one "
          f"SHA-256)", flush=True)

    ray.init(num_cpus=8, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    pool = {"num_cpus": 0.5}
    cfg = AppConfig.model_validate({
        "mode": "colocated", "http_port": free_port(), "grpc_port": free_port(), "decode": pool,
        "graceful_shutdown_timeout_s": 1.0, "fault_tolerance": {"fault_injection": True},
        "models": {"m": {"versions": {"base": {"model": model}, "canary": {"model": model}},
                         "rollout": {"window_s": WINDOW_S, "evaluate_s": 0.5, "min_requests": MIN_REQUESTS}},
                   "sleepy": {"versions": {"r1": {"model": model, "decode": {**pool, "autoscaling": {
                       "min_replicas": 0, "max_replicas": 1, "idle_timeout_s": IDLE_S, "look_back_period_s": 2.0,
                       "metrics_interval_s": 0.5}}}}}}})
    serve_app.start(cfg)
    channel = grpc.insecure_channel(f"localhost:{cfg.grpc_port}")
    stub = pb_grpc.GenerationStub(channel)
    rollout = ray.get_actor(rollout_name(DEFAULT_APP), namespace=NAMESPACE)

    def request(model_name: str = "m") -> tuple[str, float]:
        """(version or error code, seconds to the first response) of one short greedy request."""
        req = pb.GenerateRequest(model=model_name, text="The capital of France is", sampling=pb.SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        try:
            stream = stub.Generate(req, timeout=120)
            first = next(stream)
            ttft = time.perf_counter() - t0
            list(stream)
            return first.model_version, ttft
        except grpc.RpcError as e:
            return f"error:{e.code().name}", time.perf_counter() - t0

    def until(pred, timeout_s: float = 60.0, poll_s: float = 0.0) -> float:
        """Until pred() holds (its own requests pace it; a status poll passes poll_s)."""
        t0 = time.perf_counter()
        while not pred():
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError("benchmark step did not complete")
            time.sleep(poll_s)
        return time.perf_counter() - t0

    def streak(version: str, n: int = 5) -> bool:
        return all(request()[0] == version for _ in range(n))

    for _ in range(10):  # warm-up
        request()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rollbacks, gates, cold, warm = [], [], [], []
    for rnd in range(args.rounds):
        ray.get(rollout.set_split.remote("m", {"canary": 1.0}, "bench"))
        until(lambda: streak("canary"))
        t0 = time.perf_counter()
        ray.get(rollout.rollback.remote("m", "bench"))
        until(lambda: streak("base"))
        rollbacks.append(time.perf_counter() - t0)

        ray.get(rollout.set_split.remote("m", {"base": 1.0, "canary": 1.0}, "bench"))
        until(lambda: {request()[0] for _ in range(10)} == {"base", "canary"})
        canary = serve.get_deployment_handle("decode-m-canary", "pdserve")
        canary.inject_fault.remote(fail_requests=1.0).result(timeout_s=30)
        t0, stop = time.perf_counter(), threading.Event()

        def load():
            while not stop.is_set():
                request()

        clients = [threading.Thread(target=load) for _ in range(4)]
        for c in clients:
            c.start()
        seen = len(ray.get(rollout.status.remote())["decisions"])
        until(lambda: any(d["action"] == "rollback" for d in ray.get(rollout.status.remote())["decisions"][seen:]),
              poll_s=0.05)
        gates.append(time.perf_counter() - t0)
        stop.set()
        for c in clients:
            c.join()
        canary.inject_fault.remote(fail_requests=0.0).result(timeout_s=30)

        until(lambda: not serve.status().applications["pdserve"].deployments["decode-sleepy-r1"].replica_states.get(
            "RUNNING"), timeout_s=IDLE_S + 60, poll_s=0.2)
        version, ttft = request("sleepy")
        assert version == "r1", version
        cold.append(ttft)
        warm.append(request("sleepy")[1])
        print(f"round {rnd + 1}/{args.rounds}: rollback {rollbacks[-1]:.2f} s, gate {gates[-1]:.2f} s, cold start "
              f"{cold[-1]:.2f} s (warm TTFT {warm[-1] * 1e3:.0f} ms)", flush=True)
    client_cores = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    channel.close()
    serve.shutdown()
    ray.shutdown()

    def med(v: list[float]) -> str:
        return f"median {statistics.median(v):.2f} s [{min(v):.2f}, {max(v):.2f}]"

    print(f"\nmodel {os.path.basename(model)}, colocated, {args.rounds} rounds; each ingress syncs its split every "
          f"0.5 s (rollout.evaluate_s)")
    print(f"  manual rollback, actor call -> 5 requests in a row on the baseline: {med(rollbacks)} (goal < 60 s)")
    print(f"  gate, canary failing every request under 4 clients -> rolled back: {med(gates)} (window "
          f"{WINDOW_S:g} s, min_requests {MIN_REQUESTS})")
    print(f"  cold start of a sleeping model, request -> first token: {med(cold)}; warm TTFT "
          f"{statistics.median(warm) * 1e3:.0f} ms; ratio {statistics.median(cold) / statistics.median(warm):.0f}x")
    print(f"  load generator: {client_cores:.2f} cores busy (process CPU / wall, {os.cpu_count()} cores here)")


if __name__ == "__main__":
    main()
