"""Where the single router and the ingress saturate (issue 42): measured capacities on one core,
and a projection for a large deployment.

    python -m cluster.tools.bench.saturation [--replicas 8 32 128 512] [--blocks 10000 100000 1000000]
                                             [--decisions 2000] [--batches 1 8 64 256] [--ray] [--channel]
    python -m cluster.tools.bench.saturation --project-only

In process (no Ray), on the real classes: `router.router.Router` (PrefixIndex + RoutingPolicy +
session table), the plain class the router actor is a thin shell over (saturation_router.py).
  decisions  Router.route for a prompt of a shared 1024-token system prompt + 64-448 own tokens,
             over R replicas (P:D 1:3, every replica's load reported) and B blocks indexed in all.
             The block hashes are computed before timing: the ingress hashes, the router decides.
  events     Router.events: batches of S events (half "+" a new hash, half "-" an old one: a pool
             in steady state evicts what it stores), as a replica's feed (router/events.py) sends
             them with its load, at most one call in flight and one every 20 ms.
CPU time (time.process_time) of the one thread doing the work: capacity per core.
`--ray` / `--channel`: the same calls to a real RouterActor (router/actor.py) from this process,
at most 64 in flight, over Ray and (route only) over the router's channel, as the ingress sends
it (saturation_actor.py): the actor process's CPU (psutil, all its threads) per call is what one
call costs the router's core; this process is the load generator and its CPU is printed too.
The projection (`project`) turns those capacities and a deployment's shape into the replica count
at which each component saturates; its assumptions are arguments, printed with the answer.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import deque
from dataclasses import dataclass

from cluster.tools.bench.saturation_router import build_router, prompts


def bench_decisions(replicas: int, blocks: int, decisions: int) -> dict:
    rng = random.Random(0)
    router, systems = build_router(replicas, blocks, rng)
    work = prompts(systems, decisions, rng)
    reported = {rid: load for rid, (_, load) in router._loads.items()}
    times = []
    cpu0 = time.process_time()
    for i, (hashes, n) in enumerate(work):
        if i % 64 == 0:  # the replicas report: the router's pending work is cleared as in serving
            for load in reported.values():
                router.report_load(load)
        t = time.perf_counter()
        router.route(hashes, n, session=f"s{i % 500}")
        times.append(time.perf_counter() - t)
    cpu = time.process_time() - cpu0
    times.sort()
    tracked = router.stats().tracked_blocks
    return {"replicas": replicas, "blocks": tracked, "per_s": decisions / cpu,
            "p50_us": times[len(times) // 2] * 1e6, "p99_us": times[int(0.99 * len(times))] * 1e6}


def bench_events(batch: int, replicas: int = 128, blocks: int = 100_000, total_events: int = 600_000) -> dict:
    """Every batch alternates "+" a new hash and "-" the replica's oldest one (FIFO), in order,
    each seq following the last: what the index applies in steady state, nothing refused."""
    rng = random.Random(0)
    router, _ = build_router(replicas, blocks, rng)
    ids = router.index.replicas()
    held = {rid: deque(router.index.hashes(rid)) for rid in ids}
    batches = []  # pre-built: the publisher's list arrives ready-made
    for i in range(max(1, total_events // batch)):
        rid = ids[i % len(ids)]
        ev = []
        for j in range(batch):
            if j % 2 == 0:
                h = rng.randbytes(16)
                held[rid].append(h)
                ev.append(("+", h))
            else:
                ev.append(("-", held[rid].popleft()))
        batches.append((rid, ev))
    seqs = dict.fromkeys(ids, 0)
    calls = []
    for rid, ev in batches:
        seqs[rid] += 1
        calls.append((rid, seqs[rid], ev))
    events = router.events
    cpu0 = time.process_time()
    for rid, seq, ev in calls:
        if not events(rid, "inc", seq, ev):
            raise AssertionError("batch refused")
    cpu = time.process_time() - cpu0
    return {"batch": batch, "batches_per_s": len(calls) / cpu, "events_per_s": len(calls) * batch / cpu}


# ---- the projection ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Deployment:
    """A deployment's shape and traffic; every field is an assumption the caller states."""

    gpus: int = 1000
    gpus_per_replica: int = 8  # tp=8
    prefill_share: float = 0.25  # P:D 1:3
    prompt_tokens: int = 1024
    cached_fraction: float = 0.5  # of the prompt, found cached (multi-turn history, system prompts)
    output_tokens: int = 256
    prefill_tokens_per_s: float = 20_000.0  # one replica's uncached prompt tokens a second
    decode_tokens_per_s: float = 8_000.0  # one replica's output tokens a second, at the SLO
    decode_steps_per_s: float = 25.0  # a decode replica's engine steps a second (ITL ~40 ms)
    prefill_chunk_tokens: int = 8192
    block_size: int = 16
    kv_blocks_per_replica: int = 160_000
    load_reports_per_s: float = 25.0  # per replica, before the feed: on queue changes, at most 50/s, at least 4/s
    feed_min_interval_s: float = 0.02  # the feed (router/events.py): a call per change, at most every 20 ms
    feed_max_interval_s: float = 0.25  # and at least every 0.25 s
    tokens_per_message: float = 8.0  # stream_interval auto at 57+ streams on a decode replica

    @property
    def replicas(self) -> int:
        return self.gpus // self.gpus_per_replica


def project(d: Deployment, replicas: int | None = None) -> dict:
    """The load a deployment of `replicas` (default: d's) puts on the router and the ingress.
    Requests/s is the smaller of what the two pools can serve (the binding pool is named)."""
    n = d.replicas if replicas is None else replicas
    n_pre = max(1, round(n * d.prefill_share))
    n_dec = max(1, n - n_pre)
    uncached = d.prompt_tokens * (1 - d.cached_fraction)
    by_prefill = n_pre * d.prefill_tokens_per_s / uncached
    by_decode = n_dec * d.decode_tokens_per_s / d.output_tokens
    rps = min(by_prefill, by_decode)
    # Stored blocks per request: prefill's uncached prompt blocks; decode's pulled prompt blocks
    # (those it lacks: the uncached part) and its output blocks. In steady state each is evicted
    # later: one "-" per "+".
    stored = (uncached + uncached + d.output_tokens) / d.block_size
    prefill_steps = d.prefill_tokens_per_s / d.prefill_chunk_tokens
    batches = n_dec * d.decode_steps_per_s + n_pre * min(prefill_steps, rps / n_pre * math.ceil(
        uncached / d.prefill_chunk_tokens))
    reports = n * d.load_reports_per_s
    # The feed: one call per change (a decode step storing blocks; a prefill step, or a request
    # arriving or leaving), coalesced to at most one per min interval, at least one per max.
    cap = lambda changes: min(max(changes, 1 / d.feed_max_interval_s), 1 / d.feed_min_interval_s)  # noqa: E731
    feed_calls = n_dec * cap(d.decode_steps_per_s) + n_pre * cap(prefill_steps + 2 * rps / n_pre)
    return {"replicas": n, "prefill": n_pre, "decode": n_dec, "requests_per_s": rps,
            "binding_pool": "prefill" if by_prefill < by_decode else "decode",
            "output_tokens_per_s": rps * d.output_tokens, "decisions_per_s": rps,
            "events_per_s": 2 * stored * rps, "event_batches_per_s": batches, "load_reports_per_s": reports,
            "feed_calls_per_s": feed_calls, "router_calls_per_s": rps + feed_calls,
            "router_calls_per_s_before_feed": rps + batches + reports, "blocks_indexed": n * d.kv_blocks_per_replica}


def saturation_replicas(capacity_at, load_at, lo: int = 2, hi: int = 100_000) -> int | None:
    """The smallest replica count whose load reaches the capacity there (both functions of the
    replica count; load rising, capacity not): None when none up to `hi` does."""
    if load_at(hi) < capacity_at(hi):
        return None
    if load_at(lo) >= capacity_at(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if load_at(mid) >= capacity_at(mid):
            hi = mid
        else:
            lo = mid
    return hi


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log(x) between measured (x, y) points; flat beyond the ends."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + f * (y1 - y0)
    raise AssertionError


# Measured on the development VM (2 vCPUs): the projection's default inputs, every one the better
# (the cheaper) of two runs of this bench, 2026-12-07 13:06-13:07 and 13:10-13:11 UTC under the lock, main 04647e5
# with this bench (docs/benchmarks.md, "Where the router and the ingress saturate"):
#     saturation --replicas 8 32 128 512 --blocks 100000 --decisions 500 --batches 8 64 --ray --channel
# Decisions per CPU-second of Router.route in process at 100k blocks (the block count moved them
# < 20% in issue 42's runs); the rest per call of a RouterActor at 128 replicas, its process's CPU.
MEASURED_DECISIONS = [(8, 14988.0), (32, 8035.0), (128, 3403.0), (512, 1142.0)]
MEASURED_EVENTS_PER_S = 1_562_409.0  # Router.events in process, batches of 8 and 64
RAY_EVENTS_CALL_S = 260e-6  # events.remote (batch 8): actor CPU a call
RAY_REPORT_CALL_S = 215e-6  # report_load.remote: actor CPU a call
RAY_FEED_CALL_S = 331e-6  # feed.remote (8 events + the load: a replica's one call per interval)
ROUTE_MEASURED_AT = 128  # replicas: the route arms'
RAY_ROUTE_CALL_S = 736e-6  # route as a Ray actor call (the ingress's before issue 50's channel)
CHANNEL_ROUTE_CALL_S = 462e-6  # route over the router's channel (the ingress's since)
# What the route call costs the router beyond the decision itself, each way: the actor's CPU a
# call less the decision's in process, both at ROUTE_MEASURED_AT replicas. A price (cells, two
# choices) is the same call with the same arguments (router/channel.py).
RAY_ROUTE_EXTRA_S = RAY_ROUTE_CALL_S - 1 / interpolate(MEASURED_DECISIONS, ROUTE_MEASURED_AT)
CHANNEL_ROUTE_EXTRA_S = CHANNEL_ROUTE_CALL_S - 1 / interpolate(MEASURED_DECISIONS, ROUTE_MEASURED_AT)


@dataclass(frozen=True)
class IngressCost:
    """One ingress process's CPU: a one-token request, and each further relayed message."""

    request_s: float
    message_s: float


# front_door --served 1 64 --seconds 8 --clients 16 --parts (demo model, 1 prefill + 1 decode replica):
# the means of the four alternating pairs P1-P4 of docs/benchmarks.md "The route call on a channel
# of its own" (2026-12-07 09:16-10:24 UTC). Before: main 15c58e5, the route call a Ray actor call
# (2.15-2.38 ms, 0.128-0.164 ms). After: the route call over the channel (1.48-1.61, 0.128-0.162).
# (Issue 50's parts run before the channel: 2.29 and 0.16 ms; issue 42's: 5.26 and 0.67 ms.)
INGRESS_ROUTE_BY_RAY = IngressCost(sum((2.15, 2.17, 2.34, 2.38)) / 4 * 1e-3,
                                   sum((0.149, 0.142, 0.164, 0.128)) / 4 * 1e-3)
INGRESS = IngressCost(sum((1.48, 1.51, 1.61, 1.53)) / 4 * 1e-3, sum((0.128, 0.137, 0.147, 0.162)) / 4 * 1e-3)
INGRESS_REQUEST_S, INGRESS_MESSAGE_S = INGRESS.request_s, INGRESS.message_s
# A further call over the channel (cells, two choices: two prices a request): the caller's CPU a
# route call over the channel, the highest of route_channel's runs (0.016-0.039 ms; same page).
INGRESS_CHANNEL_CALL_S = 0.039e-3
INGRESS_PROCESS_CORES = 0.8  # an ingress process is planned at 80% of its core


def ingress_cores(p: dict, d: Deployment, cost: IngressCost) -> float:
    """The ingress's cores for project()'s traffic `p`: its requests and its relayed messages."""
    return p["requests_per_s"] * cost.request_s + p["output_tokens_per_s"] / d.tokens_per_message * cost.message_s


def ingress_processes(cores: float) -> int:
    """Ingress processes (`ingress_replicas`) that carry `cores` at INGRESS_PROCESS_CORES each."""
    return max(1, math.ceil(cores / INGRESS_PROCESS_CORES - 1e-9))


def saturation_table(d: Deployment = Deployment()) -> list[dict]:
    """Each component's load at d's size, its utilisation of one core there, and the replica
    count at which it reaches one core (traffic per replica held at d's). The route call's two
    transports are two rows each: as a Ray actor call (before issue 50's channel) and over the
    channel (the ingress's since)."""
    decide_s = lambda n: 1 / interpolate(MEASURED_DECISIONS, n)  # noqa: E731
    feeds = lambda n: project(d, n)["feed_calls_per_s"] * RAY_FEED_CALL_S  # noqa: E731
    rows = {
        "router: decisions (policy, in process)":
            lambda n: project(d, n)["decisions_per_s"] * decide_s(n),
        "router: event intake (index, in process)":
            lambda n: project(d, n)["events_per_s"] / MEASURED_EVENTS_PER_S,
        "router actor: event + load calls (before the feed)":
            lambda n: (project(d, n)["event_batches_per_s"] * RAY_EVENTS_CALL_S
                       + project(d, n)["load_reports_per_s"] * RAY_REPORT_CALL_S),
        "router actor: the feed's calls over Ray": feeds,
        "router actor: all of it, route over Ray (before)":
            lambda n: project(d, n)["decisions_per_s"] * (decide_s(n) + RAY_ROUTE_EXTRA_S) + feeds(n),
        "router actor: all of it, route over the channel":
            lambda n: project(d, n)["decisions_per_s"] * (decide_s(n) + CHANNEL_ROUTE_EXTRA_S) + feeds(n),
        "ingress: route over Ray (before)": lambda n: ingress_cores(project(d, n), d, INGRESS_ROUTE_BY_RAY),
        "ingress: route over the channel": lambda n: ingress_cores(project(d, n), d, INGRESS),
    }
    return [{"component": name, "cores_at_size": cores(d.replicas),
             "saturates_at": saturation_replicas(lambda n: 1.0, cores)} for name, cores in rows.items()]


def print_projection(gpus: list[int]) -> None:
    """`--project-only`: the projection's inputs, then each size's traffic and table."""
    print(f"inputs: decisions/s {MEASURED_DECISIONS}; events/s {MEASURED_EVENTS_PER_S:,.0f}; actor CPU a call: "
          f"events {RAY_EVENTS_CALL_S * 1e6:.0f} us, report_load {RAY_REPORT_CALL_S * 1e6:.0f}, feed "
          f"{RAY_FEED_CALL_S * 1e6:.0f}, route at {ROUTE_MEASURED_AT} replicas {RAY_ROUTE_CALL_S * 1e6:.0f} by Ray / "
          f"{CHANNEL_ROUTE_CALL_S * 1e6:.0f} by the channel (beyond the decision: {RAY_ROUTE_EXTRA_S * 1e6:.0f} / "
          f"{CHANNEL_ROUTE_EXTRA_S * 1e6:.0f}); ingress a request / a message: "
          f"{INGRESS_ROUTE_BY_RAY.request_s * 1e3:.3f} / {INGRESS_ROUTE_BY_RAY.message_s * 1e3:.4f} ms by Ray, "
          f"{INGRESS.request_s * 1e3:.4f} / {INGRESS.message_s * 1e3:.4f} ms by the channel")
    for n_gpus in gpus:
        d = Deployment(gpus=n_gpus)
        print(f"deployment (assumptions): {d}")
        for k, v in project(d).items():
            print(f"  {k}: {v:,.0f}" if isinstance(v, (int, float)) else f"  {k}: {v}")
        for row in saturation_table(d):
            more = (f" ({ingress_processes(row['cores_at_size'])} processes at {INGRESS_PROCESS_CORES:.0%})"
                    if row["component"].startswith("ingress") else "")
            print(f"  {row['component']:<50} {row['cores_at_size']:7.2f} cores at {d.replicas} replicas{more}; "
                  f"one core saturates at {row['saturates_at']} replicas")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 32, 128, 512])
    ap.add_argument("--blocks", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--decisions", type=int, nargs="+", default=[2000])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--ray", action="store_true", help="also the RouterActor over Ray (128 replicas, 100k blocks)")
    ap.add_argument("--channel", action="store_true", help="also route over the RouterActor's channel (as --ray)")
    ap.add_argument("--ray-seconds", type=float, default=4.0)
    ap.add_argument("--skip-inprocess", action="store_true")
    ap.add_argument("--project-only", action="store_true", help="print the projection and exit")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1000, 10_000], help="the projection's sizes (8 a replica)")
    args = ap.parse_args(argv)
    if args.project_only:
        print_projection(args.gpus)
        return 0
    if not args.skip_inprocess:
        print("decisions (Router.route in process, one core; hashing excluded: the ingress's)")
        print(f"{'replicas':>8} {'blocks':>9} {'decisions/s':>12} {'p50 us':>8} {'p99 us':>8}")
        for blocks in args.blocks:
            for r in args.replicas:
                m = bench_decisions(r, blocks, args.decisions[0])
                print(f"{m['replicas']:>8} {m['blocks']:>9} {m['per_s']:>12.0f} {m['p50_us']:>8.0f} {m['p99_us']:>8.0f}",
                      flush=True)
        print("events (Router.events in process, one core; 128 replicas, 100k blocks)")
        print(f"{'batch':>6} {'batches/s':>10} {'events/s':>10}")
        for b in args.batches:
            m = bench_events(b)
            print(f"{b:>6} {m['batches_per_s']:>10.0f} {m['events_per_s']:>10.0f}", flush=True)
    if args.ray or args.channel:
        from cluster.tools.bench.saturation_actor import bench_actor

        print("RouterActor (128 replicas, 100k blocks; 64 calls in flight from one driver)")
        for m in bench_actor(128, 100_000, args.ray_seconds, 8, args.ray, args.channel):
            print(f"{m['arm']:>22}: {m['calls']} calls, {m['calls_per_s']:.0f} calls/s, actor {m['actor_cores']:.2f} "
                  f"cores ({m['actor_cpu_us']:.0f} us CPU a call: {m['per_actor_core_s']:.0f} calls per actor "
                  f"core-second), load generator {m['loadgen_cores']:.2f} cores", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
