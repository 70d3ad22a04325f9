"""What the audit log costs a request: TTFT p50 and ITL p50 at 16 streams, audit off vs on.

    python -m cluster.tools.bench.audit [--requests 480] [--rounds 2]

The random demo model (1 prefill + 1 decode replica, 1 ingress) over gRPC, closed loop with 16
requests in flight, random prompts of 64-192 tokens, 32 output tokens, greedy, EOS ignored. The arms
are deployed in turn, ABBA per round (off, on, on, off, ...), so a drift of the shared machine
falls on both; each deployment is warmed up first. A tiny model makes the request path's fixed
costs (where the audit record is made and spooled) the largest share they can be. Printed per
arm: TTFT p50 and ITL p50 pooled over its runs, the ratio on/off, the load generator's CPU use,
and the records the log holds afterwards (verified). Also the on-path cost of one record (build
+ spool write), timed in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import numpy as np

from cluster.config import AppConfig


async def _closed_loop(address: str, n: int, seed: int, streams: int):
    from cluster.tools.loadgen.clients import GrpcClient, Sampling
    from cluster.tools.loadgen.datasets import RandomDataset
    from cluster.tools.loadgen.runner import Runner

    client = GrpcClient(address, None, sampling=Sampling(ignore_eos=True))
    try:
        info = await client.server_info()
        sessions = RandomDataset(128, 32, 0.5, info.vocab_size or 256).sample(n, np.random.default_rng(seed))
        return await Runner(client, max_concurrency=streams, progress=False).run(sessions, [0.0] * n, 600.0)
    finally:
        await client.close()


def _spool_cost_us(directory: str, n: int = 5000) -> float:
    """Microseconds per record on the request path: AuditTrail built, fed a final delta, spooled."""
    from cluster.config import AuditOptions
    from router.ingress.audit import AuditShipper, AuditTrail
    from router.ingress.flow import Delta

    async def run() -> float:
        shipper = AuditShipper(AuditOptions(enabled=True, dir=directory, max_buffered=n + 1), lambda: None)
        shipper._ensure_task = lambda: None  # no writer here: only the on-path part is timed
        d = Delta("x", "text", [1], "length", 100, 32, 16)
        t0 = time.perf_counter()
        for i in range(n):
            trail = AuditTrail(shipper, f"{i:032x}", None, "default", "model", "f" * 16, False)
            trail.delta(d, 0.0)
        return (time.perf_counter() - t0) / n * 1e6

    return asyncio.run(run())


def main() -> None:
    import ray
    from ray import serve

    import cluster.app.builder as serve_app
    from cluster.tools.netutil import free_port
    from router.ingress.audit_log import verify

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=480, help="per run")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="each round runs off, on, on, off")
    args = ap.parse_args()

    ray.init(num_cpus=8, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    base = serve_app.ensure_model(default="random", config=AppConfig(
        http_port=free_port(), grpc_port=free_port(), prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5},
        graceful_shutdown_timeout_s=1.0))
    audit_dir = tempfile.mkdtemp(prefix="pdserve-bench-audit-")
    arms = {"off": base, "on": base.model_copy(update={"audit": base.audit.model_copy(
        update={"enabled": True, "dir": audit_dir})})}
    pooled: dict[str, dict[str, list[float]]] = {a: {"ttft": [], "itl": [], "cpu": [], "ok": []} for a in arms}
    order = [name for _ in range(args.rounds) for name in ("off", "on", "on", "off")]
    for run, name in enumerate(order):
        cfg = arms[name]
        serve_app.start(cfg)
        address = f"localhost:{cfg.grpc_port}"
        asyncio.run(_closed_loop(address, 2 * args.streams, seed=1000 + run, streams=args.streams))  # warm-up
        outcome = asyncio.run(_closed_loop(address, args.requests, seed=run, streams=args.streams))
        serve.delete("pdserve")
        ok = [r for r in outcome.records if r.status == "ok"]
        ttft = [r.ttft_s for r in ok]
        itl = [x for r in ok for x in r.itls_s]
        pooled[name]["ttft"] += ttft
        pooled[name]["itl"] += itl
        pooled[name]["cpu"].append(outcome.client_cpu_share)
        pooled[name]["ok"].append(len(ok))
        print(f"run {run + 1}/{len(order)} audit {name:<3}: {len(ok)}/{len(outcome.records)} ok  TTFT p50 "
              f"{np.median(ttft) * 1e3:7.2f} ms  ITL p50 {np.median(itl) * 1e3:6.2f} ms  load generator "
              f"{outcome.client_cpu_share:.2f} cores", flush=True)
    ray.shutdown()

    print(f"\n{args.streams} streams, {args.requests} requests per run, {args.rounds} ABBA round(s)")
    p50 = {a: (float(np.median(m["ttft"])) * 1e3, float(np.median(m["itl"])) * 1e3) for a, m in pooled.items()}
    for a, m in pooled.items():
        print(f"  audit {a:<3}  TTFT p50 {p50[a][0]:7.2f} ms  ITL p50 {p50[a][1]:6.2f} ms  "
              f"({sum(m['ok'])} requests, {len(m['itl'])} intervals; load generator {np.mean(m['cpu']):.2f} cores)")
    print(f"  on / off   TTFT p50 {p50['on'][0] / p50['off'][0]:.3f}x  ITL p50 {p50['on'][1] / p50['off'][1]:.3f}x "
          f"(goal <= 1.02x)")
    result = verify(audit_dir)
    print(f"  audit log: {result.records} records (expected {sum(pooled['on']['ok'])} + warm-ups), "
          f"verify {'OK' if result.ok else result.error}")
    print(f"  on the request path: {_spool_cost_us(tempfile.mkdtemp(prefix='pdserve-bench-spool-')):.1f} µs per "
          f"record (build + spool write), measured in this process")


if __name__ == "__main__":
    main()
