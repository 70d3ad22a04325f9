"""Routing on a capacity-bound shared-prefix workload: the cost router against round robin and
power of two.

    python -m cluster.tools.bench.routing [--requests 64] [--concurrency 4] [--arms cost ...] [--no-control]

One deployment per arm, fresh caches, same machine and checkpoint (the ~50M bench model): 2 prefill
replicas + 1 decode replica. Workload: 8 system prompts of 1024 tokens, each request one of them
(seeded order) + a fresh 64-token suffix, 8 output tokens, closed loop at --concurrency.
Capacity-bound: each prefill replica's KV pool has 320 blocks, room for 4 of the 8 prompts (68
blocks each: 272) and not 5, while the two together hold all 8: only a router that keeps each
prefix on one replica can hit (round robin sends every prefix everywhere: each replica cycles 8
prefixes through room for 4). The decode replica holds all 8, so it pulls only new blocks. The
first 8 requests (one per prefix, one at a time) are warm-up. Control: unique prompts of the same
length (no sharing), cost router against round robin, where routing cannot help: within +-10%.
Printed per arm: TTFT p50/p90, engine-observed prefix hit rate (cached prompt tokens reported in
usage / shared prefix tokens), throughput, and this process's own CPU seconds (the load generator,
and the Ray driver it holds).

`--tiers` (issue 19, tier-aware routing): each prefill replica's device pool holds 2 of the
prompts (184 blocks) and a host tier 2 more (136 blocks): a replica holds 4 prefixes, half of
them in host memory, and the pool all 8. Arm `cost-tier-blind` is the cost router with
`tier_weights: [0, 0]` (host blocks earn nothing: the router sees half of each replica's cache);
run it beside `cost`, e.g. `--tiers --arms cost cost-tier-blind round_robin --no-control`.
`cost` credits a host block at the replica's measured weight (1 - its seconds per block loaded
back x its tokens/s / 16); arm `cost-fixed-weights` at Dynamo's fixed 0.75 / 0.25.

`--kill-router-after N` (issue 50, failover): once N measured requests have finished, the router
actor is killed (Ray restarts it, empty) while the load goes on. Printed besides: requests that
failed, the router's restart time, the hit rate of the requests that finished before the kill, and
how long after the kill the hit rate over the last `--window` finished requests is back within 5%
of that (never: said so).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import threading
import time

from cluster.tools.bench.engine import ensure_bench_model

SYSTEM_TOKENS, SUFFIX_TOKENS, OUTPUT_TOKENS = 1024, 64, 8
NUM_PREFIXES = 8
PREFILL_BLOCKS = 320  # a 1088-token prompt fills 68 blocks: 4 fit (272), 5 do not (340)
TIER_DEVICE_BLOCKS, TIER_HOST_BLOCKS = 184, 136  # --tiers: 2 prompts on the device (+ room), 2 in host memory


def workload(n: int, shared: bool, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(SYSTEM_TOKENS)] for _ in range(NUM_PREFIXES)]
    prompts = []
    for i in range(n):
        head = (systems[i % NUM_PREFIXES] if (shared and i < NUM_PREFIXES) else
                (systems[rng.randrange(NUM_PREFIXES)] if shared else
                 [rng.randrange(32000) for _ in range(SYSTEM_TOKENS)]))
        prompts.append(head + [rng.randrange(32000) for _ in range(SUFFIX_TOKENS)])
    return prompts


def _wait_for_replicas(group: str, n: int, timeout: float = 30.0) -> None:
    import ray

    from router.actor import get_router

    router = get_router(group)  # the app's (`pdserve`) router of its one model
    deadline = time.monotonic() + timeout
    while len(ray.get(router.live_loads.remote())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} replicas reported to the router in {timeout}s")
        time.sleep(0.1)


def recovery(done: list[tuple[float, int, bool]], t_kill: float, window: int) -> dict:
    """`done`: (finished at, cached tokens, ok) per measured request, in finishing order. The hit
    rate before the kill, and the first time after it that the last `window` requests' hit rate
    is back within 5% of it (None: never)."""
    before = [c for t, c, _ in done if t < t_kill]
    level = sum(before) / (SYSTEM_TOKENS * len(before)) if before else float("nan")
    back = None
    for i in range(window, len(done) + 1):
        last = done[i - window:i]
        if last[0][0] >= t_kill and sum(c for _, c, _ in last) / (SYSTEM_TOKENS * window) >= 0.95 * level:
            back = last[-1][0] - t_kill
            break
    return {"hit_rate_before": level, "recovered_s": back, "failed": sum(not ok for _, _, ok in done)}


def _kill_router(group: str) -> float:
    """Kill the app's router of `group` (Ray restarts it); seconds until the restarted one answers."""
    import os

    import ray

    from router.actor import get_router

    router = get_router(group).handle()
    pid = ray.get(router.__ray_call__.remote(lambda self: os.getpid()))
    t0 = time.monotonic()
    ray.kill(router, no_restart=False)
    while True:
        try:
            if ray.get(router.__ray_call__.remote(lambda self: os.getpid()), timeout=5) != pid:
                return time.monotonic() - t0
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.01)


def run_arm(model_dir: str, strategy: str, prompts: list[list[int]], concurrency: int, warmup: int,
            routing: dict | None = None, tiers: bool = False, kill_router_after: int | None = None,
            window: int = 8) -> dict:
    """`routing`: further `routing` options of the app config (an ablation, e.g. evict_block_cost=0).
    `tiers`: the prefill replicas' device pools shrink and a host tier takes the rest (--tiers)."""
    import grpc
    import ray
    from ray import serve

    import cluster.app.builder as serve_app
    from cluster.config import AppConfig
    from cluster.tools.netutil import free_port
    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    blocks_per_prompt = (SYSTEM_TOKENS + SUFFIX_TOKENS) // 16
    prefill_engine = {"num_blocks": PREFILL_BLOCKS, "max_num_batched_tokens": 1024}
    if tiers:
        prefill_engine.update(num_blocks=TIER_DEVICE_BLOCKS, kv_tiers={"host_blocks": TIER_HOST_BLOCKS})
    if strategy == "cost-tier-blind":
        strategy, routing = "cost", {**(routing or {}), "tier_weights": [0.0, 0.0]}
    elif strategy == "cost-fixed-weights":  # Dynamo's weights instead of each replica's measured load-back cost
        strategy, routing = "cost", {**(routing or {}), "tier_weights": [0.75, 0.25]}
    cfg = AppConfig(
        model=model_dir, http_port=free_port(), grpc_port=free_port(), graceful_shutdown_timeout_s=1.0,
        prefill={"num_replicas": 2, "engine": prefill_engine},
        decode={"engine": {"num_blocks": NUM_PREFIXES * blocks_per_prompt + concurrency * 70 + 64}},
        engine={"max_num_batched_tokens": 1024}, routing={"strategy": strategy, **(routing or {})},
    )
    ray.init(num_cpus=serve_app.cpus_needed(cfg) + 2, include_dashboard=False, log_to_driver=False)
    try:
        serve_app.start(cfg)
        channel = grpc.insecure_channel(f"localhost:{cfg.grpc_port}")
        stub = pb_grpc.GenerationStub(channel)
        _wait_for_replicas(cfg.serving_group, 3)  # decisions need every replica's load report

        done: list[tuple[float, int, bool]] = []  # (finished at, cached tokens, ok), measured requests
        kill = {"at": None, "restart_s": None}

        def one(p, measured=True):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
                max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True))
            t0 = time.perf_counter()
            ttft, last = None, None
            try:
                for resp in stub.Generate(req, timeout=600):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    last = resp
            except grpc.RpcError:
                if kill_router_after is None:
                    raise
                done.append((time.monotonic(), 0, False))
                return time.perf_counter() - t0, 0, 0
            if measured:
                done.append((time.monotonic(), last.usage.cached_prompt_tokens, True))
                if len(done) == kill_router_after:  # killed beside the load, which goes on
                    kill["at"] = time.monotonic()
                    kill["thread"] = threading.Thread(
                        target=lambda: kill.update(restart_s=_kill_router(cfg.serving_group)))
                    kill["thread"].start()
            return ttft, last.usage.cached_prompt_tokens, last.usage.completion_tokens

        for p in prompts[:warmup]:
            one(p, measured=False)
        t0, cpu0 = time.perf_counter(), time.process_time()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, prompts[warmup:]))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        channel.close()
    finally:
        serve.shutdown()
        ray.shutdown()
    ttfts = sorted(r[0] for r in results)
    q = lambda f: ttfts[min(len(ttfts) - 1, int(f * len(ttfts)))]  # noqa: E731
    out = {"ttft_p50": q(0.5), "ttft_p90": q(0.9),
           "hit_rate": sum(r[1] for r in results) / (SYSTEM_TOKENS * len(results)),
           "req_s": len(results) / wall, "tok_s": sum(r[2] for r in results) / wall, "client_cpu_s": cpu,
           "wall_s": wall}
    if kill["at"] is not None:
        kill["thread"].join()
        out.update(recovery(sorted(done), kill["at"], window), router_restart_s=kill["restart_s"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=".bench/llama-50m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--arms", nargs="*", default=["cost", "round_robin", "power_of_two"],
                    help="shared-prefix arms to run (none: the control alone)")
    ap.add_argument("--no-control", action="store_true")
    ap.add_argument("--control-requests", type=int, default=32)
    ap.add_argument("--tiers", action="store_true", help="prefill replicas hold half their prefixes in a host tier")
    ap.add_argument("--kill-router-after", type=int, default=None, metavar="N",
                    help="kill the router once N measured requests have finished (failover)")
    ap.add_argument("--window", type=int, default=8, help="--kill-router-after: requests in the rolling hit rate")
    ap.add_argument("--routing-option", action="append", default=[], metavar="NAME=VALUE",
                    help="a routing option for every arm, e.g. evict_block_cost=0 (an ablation)")
    args = ap.parse_args(argv)
    routing = dict(opt.split("=", 1) for opt in args.routing_option)
    d = str(ensure_bench_model(args.model_dir, SYSTEM_TOKENS + SUFFIX_TOKENS + OUTPUT_TOKENS + 8))

    def show(label, r):
        print(f"{label:<28} TTFT p50 {r['ttft_p50'] * 1e3:7.0f} ms  p90 {r['ttft_p90'] * 1e3:7.0f} ms  "
              f"hit rate {100 * r['hit_rate']:5.1f}%  {r['req_s']:.2f} req/s  {r['tok_s']:.1f} tok/s  "
              f"client CPU {r['client_cpu_s']:.1f} s of {r['wall_s']:.1f} s", flush=True)

    shared = workload(args.requests, shared=True, seed=1)
    results = {}
    for arm in args.arms:
        results[arm] = r = run_arm(d, arm, shared, args.concurrency, warmup=NUM_PREFIXES, routing=routing,
                                   tiers=args.tiers, kill_router_after=args.kill_router_after, window=args.window)
        show(f"shared prefixes{', tiers' if args.tiers else ''}, {arm}", r)
        if "recovered_s" in r:
            back = "never" if r["recovered_s"] is None else f"{r['recovered_s']:.2f} s after the kill"
            print(f"  router killed after {args.kill_router_after} requests: {r['failed']} failed; restarted in "
                  f"{r['router_restart_s']:.2f} s; hit rate before {100 * r['hit_rate_before']:.1f}%, back within "
                  f"5% (last {args.window} requests) {back}", flush=True)
    if "cost" in results:
        for arm in results:
            if arm != "cost":
                r, c = results[arm], results["cost"]
                print(f"{arm} / cost: TTFT p50 {r['ttft_p50'] / c['ttft_p50']:.2f}x, "
                      f"p90 {r['ttft_p90'] / c['ttft_p90']:.2f}x  (goal: p50 >= 3x; cost hit rate >= 90%)")
    if not args.no_control:
        control = workload(args.control_requests, shared=False, seed=2)
        ctl = {arm: run_arm(d, arm, control, args.concurrency, warmup=0, routing=routing, tiers=args.tiers)
               for arm in ("cost", "round_robin")}
        for arm, r in ctl.items():
            show(f"no sharing (control), {arm}", r)
        ratio = ctl['cost']['ttft_p50'] / ctl['round_robin']['ttft_p50']
        print(f"control: TTFT p50 cost / round robin = {ratio:.2f} (goal: 0.90-1.10)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
