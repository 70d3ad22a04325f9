"""What the audit log costs a request: TTFT p50 and ITL p50 at 16 streams, audit off vs on.

    python -m cluster.tools.bench.audit [--requests 96] [--rounds 16] [--streams 16]

The random demo model (1 prefill + 1 decode replica, 1 ingress) over gRPC, closed loop with 16
requests in flight, random prompts of 64-192 tokens, 32 output tokens, greedy, EOS ignored. A tiny
model makes the request path's fixed costs (where the audit record is made and spooled) the
largest share they can be.

One deployment with the audit log on and two tenants: "on" (audited) and "off" (`audit: false`:
no record). The arms alternate within each round, ABBA over round pairs (off, on | on, off | ...),
each a closed loop of --requests requests, so both arms share the same replicas, warm state and
the shared machine's drift; an "off" phase sends no record, so the shipper and the writer actor
idle through it (their background cost falls on the "on" phases). Printed: each round's p50s and
on/off ratios, the median of the per-round ratios with their spread (min, max, interquartile
range), the pooled p50s, the load generator's CPU use, the records the log holds afterwards
(verified), and the on-path cost of one record (build + spool write) timed in this process.

Besides latency, the cluster's CPU time per request in each phase: every process this benchmark's
`ray.init` started (GCS, raylet, Serve's controller and proxies, the ingress, both engines, the
audit writer; psutil, user + system), the load generator itself apart. On 2 shared cores a p50
moves by 10-30% from round to round, but the CPU the cluster spends per request is what the
audit log adds to the machine's work, and it varies far less: its on/off ratio is printed the same
way (median of rounds, pooled).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import numpy as np

from cluster.config import AppConfig, AuditOptions


async def _closed_loop(address: str, key: str, n: int, seed: int, streams: int):
    from cluster.tools.loadgen.clients import GrpcClient, Sampling
    from cluster.tools.loadgen.datasets import RandomDataset
    from cluster.tools.loadgen.runner import Runner

    client = GrpcClient(address, key, sampling=Sampling(ignore_eos=True))
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


KEYS = {"off": "sk-bench-audit-off", "on": "sk-bench-audit-on"}


def _cluster_cpu_s() -> float:
    """User + system CPU seconds of every process descended from this one (the local Ray cluster):
    processes that are gone by now are not counted, so take it around phases, not across restarts."""
    import psutil

    total = 0.0
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def _spread(v: list[float]) -> str:
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return f"{med:.3f}x (min {min(v):.3f}, max {max(v):.3f}, IQR {q1:.3f}-{q3:.3f})"


def main() -> None:
    import ray
    from ray import serve

    import cluster.app.builder as serve_app
    from cluster.tools.netutil import free_port
    from router.ingress.audit_log import verify

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96, help="per arm per round")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=16, help="each round runs both arms, ABBA over round pairs")
    ap.add_argument("--flush-interval", type=float, default=AuditOptions().flush_interval_s,
                    help="audit.flush_interval_s: how long the ingress gathers records per writer call")
    args = ap.parse_args()

    ray.init(num_cpus=8, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    audit_dir = tempfile.mkdtemp(prefix="pdserve-bench-audit-")
    cfg = serve_app.ensure_model(default="random", config=AppConfig(
        http_port=free_port(), grpc_port=free_port(), prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5},
        graceful_shutdown_timeout_s=5.0, audit={"enabled": True, "dir": audit_dir,
                                                                "flush_interval_s": args.flush_interval},
        tenants={"off": {"api_keys": [KEYS["off"]], "audit": False}, "on": {"api_keys": [KEYS["on"]]}}))
    serve_app.start(cfg)
    address = f"localhost:{cfg.grpc_port}"
    for arm in ("off", "on"):  # warm-up, both tenants
        asyncio.run(_closed_loop(address, KEYS[arm], 2 * args.streams, seed=10_000, streams=args.streams))
    pooled: dict[str, dict[str, list]] = {a: {"ttft": [], "itl": [], "cpu": [], "ok": 0, "n": 0, "cluster_s": 0.0}
                                          for a in KEYS}
    ratios: dict[str, list[float]] = {"ttft": [], "itl": [], "cluster_cpu": []}
    for rnd in range(args.rounds):
        order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
        p50: dict[str, tuple[float, float]] = {}
        per_request_ms: dict[str, float] = {}
        for arm in order:
            cpu0 = _cluster_cpu_s()
            outcome = asyncio.run(_closed_loop(address, KEYS[arm], args.requests, seed=rnd, streams=args.streams))
            spent = _cluster_cpu_s() - cpu0
            pooled[arm]["cluster_s"] += spent
            per_request_ms[arm] = spent / len(outcome.records) * 1e3
            ok = [r for r in outcome.records if r.status == "ok"]
            ttft = [r.ttft_s for r in ok]
            itl = [x for r in ok for x in r.itls_s]
            pooled[arm]["ttft"] += ttft
            pooled[arm]["itl"] += itl
            pooled[arm]["cpu"].append(outcome.client_cpu_share)
            pooled[arm]["ok"] += len(ok)
            pooled[arm]["n"] += len(outcome.records)
            p50[arm] = (float(np.median(ttft)) * 1e3, float(np.median(itl)) * 1e3)
        ratios["ttft"].append(p50["on"][0] / p50["off"][0])
        ratios["itl"].append(p50["on"][1] / p50["off"][1])
        ratios["cluster_cpu"].append(per_request_ms["on"] / per_request_ms["off"])
        print(f"round {rnd + 1}/{args.rounds} ({order[0]} first): TTFT p50 off {p50['off'][0]:7.2f} on "
              f"{p50['on'][0]:7.2f} ms ({ratios['ttft'][-1]:.3f}x)  ITL p50 off {p50['off'][1]:6.2f} on "
              f"{p50['on'][1]:6.2f} ms ({ratios['itl'][-1]:.3f}x)  cluster CPU per request off "
              f"{per_request_ms['off']:.1f} on {per_request_ms['on']:.1f} ms ({ratios['cluster_cpu'][-1]:.3f}x)",
              flush=True)
    serve.shutdown()  # graceful: the ingress drains its spool first
    ray.shutdown()

    print(f"\n{args.streams} streams, {args.requests} requests per arm per round, {args.rounds} rounds, one "
          f"deployment (audit on, flush_interval_s {args.flush_interval}; tenant 'off' has audit: false)")
    for a, m in pooled.items():
        print(f"  audit {a:<3}  TTFT p50 {np.median(m['ttft']) * 1e3:7.2f} ms  ITL p50 {np.median(m['itl']) * 1e3:6.2f} ms"
              f"  ({m['ok']}/{m['n']} ok, {len(m['itl'])} intervals; load generator {np.mean(m['cpu']):.2f} cores)")
    print(f"  on / off, median of the per-round ratios (goal <= 1.02x):\n    TTFT p50 {_spread(ratios['ttft'])}\n"
          f"    ITL p50  {_spread(ratios['itl'])}")
    pooled_ttft = np.median(pooled["on"]["ttft"]) / np.median(pooled["off"]["ttft"])
    pooled_itl = np.median(pooled["on"]["itl"]) / np.median(pooled["off"]["itl"])
    print(f"  on / off, pooled p50s: TTFT {pooled_ttft:.3f}x  ITL {pooled_itl:.3f}x")
    cpu_ms = {a: m["cluster_s"] / m["n"] * 1e3 for a, m in pooled.items()}
    print(f"  the cluster's CPU per request: off {cpu_ms['off']:.2f} ms, on {cpu_ms['on']:.2f} ms; on / off median of "
          f"rounds {_spread(ratios['cluster_cpu'])}; pooled {cpu_ms['on'] / cpu_ms['off']:.3f}x")
    result = verify(audit_dir)
    print(f"  audit log: {result.records} records (expected {pooled['on']['n']} + {2 * args.streams} warm-ups), "
          f"verify {'OK' if result.ok else result.error}")
    print(f"  on the request path: {_spool_cost_us(tempfile.mkdtemp(prefix='pdserve-bench-spool-')):.1f} µs per "
          f"record (build + spool write), measured in this process")


if __name__ == "__main__":
    main()
