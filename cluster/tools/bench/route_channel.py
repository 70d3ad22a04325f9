"""The router's `route` call as a Ray actor call against on the router's channel (router/channel.py):
latency and CPU a call at both ends, from an event loop as the front door calls it.

    python -m cluster.tools.bench.route_channel [--calls 3000] [--concurrency 1 16] [--replicas 8]

One RouterActor (unnamed, on this machine) knows `--replicas` replicas (half prefill, half decode)
and a 4-block prefix on one of them; a uvloop event loop in this process calls `route` for a
64-token prompt, `--calls` times per arm, with `--concurrency` calls in flight. Printed per arm:
latency p50/p99, calls/s, and the CPU a call of this process (every thread: Ray's C++ ones
included) and of the router's process (/proc)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _arm(call, calls: int, concurrency: int, router_pid: int) -> dict:
    lat: list[float] = []

    async def caller(n: int) -> None:
        for _ in range(n):
            t = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t)

    for _ in range(50):  # warm-up
        await call()
    cpu, rcpu, wall = time.process_time(), _proc_cpu_s(router_pid), time.perf_counter()
    await asyncio.gather(*(caller(calls // concurrency) for _ in range(concurrency)))
    wall, n = time.perf_counter() - wall, len(lat)
    return {"p50_ms": 1e3 * float(np.percentile(lat, 50)), "p99_ms": 1e3 * float(np.percentile(lat, 99)),
            "calls_per_s": n / wall, "caller_cpu_ms": 1e3 * (time.process_time() - cpu) / n,
            "router_cpu_ms": 1e3 * (_proc_cpu_s(router_pid) - rcpu) / n}


async def _main(args) -> None:
    import ray

    from cluster.engine.kv_cache import hash_request_blocks
    from router.actor import RouterActor, RouterRef
    from router.policy import ReplicaLoad

    router = RouterActor.remote(stale_after_s=1e9)
    half = args.replicas // 2
    for i in range(args.replicas):
        role = "prefill" if i < half else "decode"
        await router.report_load.remote(ReplicaLoad(f"r{i}", role, 1000, 1000, 0, 0, 0, 0.01))
    prefix = list(range(64))
    await router.resync.remote("r0", "i1", 0, hash_request_blocks(prefix, 16, b"m"))
    hashes = hash_request_blocks(prefix + [1] * 16, 16, b"m")
    pid = await router.__ray_call__.remote(lambda self: os.getpid())
    ref = RouterRef("bench-router", lambda: router)
    ref.channel.usable()  # starts the connect
    for _ in range(200):
        if ref.channel.usable():
            break
        await asyncio.sleep(0.05)  # polling the background connect, bounded
    assert ref.channel.usable(), "the channel did not connect"
    arms = {"ray": lambda: router.route.remote(hashes, 80, None, None),
            "channel": lambda: ref.route.remote(hashes, 80, None, None)}
    for rnd in range(args.rounds):
        for conc in args.concurrency:
            for name, call in arms.items():
                r = await _arm(call, args.calls, conc, pid)
                print(f"round {rnd} {name:8s} x{conc:<3d} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
                      f"{r['calls_per_s']:,.0f} calls/s  caller CPU {r['caller_cpu_ms']:.3f} ms  "
                      f"router CPU {r['router_cpu_ms']:.3f} ms a call", flush=True)
    ray.kill(router)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    import ray
    import uvloop

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        uvloop.run(_main(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
