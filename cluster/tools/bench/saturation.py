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


# Measured on the development VM (2 vCPUs; docs/benchmarks.md, "Where the router and the ingress
# saturate"): the projection's default inputs. Decisions per CPU-second of Router.route in process
# at 100k blocks (the block count moved them < 20%); the rest per call of the RouterActor over Ray,
# the better of two runs (so the saturation points are upper bounds for this VM's cores).
MEASURED_DECISIONS = [(8, 7231.0), (32, 2883.0), (128, 632.0), (512, 86.0)]
MEASURED_EVENTS_PER_S = 1_000_000.0  # Router.events in process, batches of 8-256 (1.02-1.21M)
RAY_ROUTE_EXTRA_S = 2055e-6 - 1 / 632.0  # route over Ray at 128 replicas minus in process
RAY_EVENTS_CALL_S = 375e-6  # events.remote (batch 8): actor CPU a call
RAY_REPORT_CALL_S = 317e-6  # report_load.remote: actor CPU a call
# feed.remote (8 events + the load, the replica's one call per interval since issue 50): one run,
# in which events cost 261 us and report_load 186 us (docs/benchmarks.md, "The feed").
RAY_FEED_CALL_S = 333e-6
# One ingress process's CPU (front_door --served 1 64, 16 callers, demo model; issue 50's run after
# the legs went by gRPC, docs/benchmarks.md "The front door's parts"): 2.29 ms a one-token request;
# a 64-token one 0.59 cores at 84.1 requests/s and 2,448.7 messages/s: 0.16 ms a relayed message.
# (Issue 42's run: 5.26 ms and 0.67 ms.)
INGRESS_REQUEST_S = 2.29e-3
INGRESS_MESSAGE_S = (0.59 - 84.1 * 2.29e-3) / 2448.7


def saturation_table(d: Deployment = Deployment()) -> list[dict]:
    """Each component's load at d's size, its utilisation of one core there, and the replica
    count at which it reaches one core (traffic per replica held at d's)."""
    decide_s = lambda n: 1 / interpolate(MEASURED_DECISIONS, n)  # noqa: E731
    rows = {
        "router: decisions (policy, in process)":
            lambda n: project(d, n)["decisions_per_s"] * decide_s(n),
        "router: event intake (index, in process)":
            lambda n: project(d, n)["events_per_s"] / MEASURED_EVENTS_PER_S,
        "router actor: event + load calls (before the feed)":
            lambda n: (project(d, n)["event_batches_per_s"] * RAY_EVENTS_CALL_S
                       + project(d, n)["load_reports_per_s"] * RAY_REPORT_CALL_S),
        "router actor: the feed's calls over Ray":
            lambda n: project(d, n)["feed_calls_per_s"] * RAY_FEED_CALL_S,
        "router actor: all of it over Ray":
            lambda n: (project(d, n)["decisions_per_s"] * (decide_s(n) + RAY_ROUTE_EXTRA_S)
                       + project(d, n)["feed_calls_per_s"] * RAY_FEED_CALL_S),
        "one ingress process: requests and messages":
            lambda n: (project(d, n)["requests_per_s"] * INGRESS_REQUEST_S
                       + project(d, n)["output_tokens_per_s"] / d.tokens_per_message * INGRESS_MESSAGE_S),
    }
    return [{"component": name, "cores_at_size": cores(d.replicas),
             "saturates_at": saturation_replicas(lambda n: 1.0, cores)} for name, cores in rows.items()]


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
    args = ap.parse_args(argv)
    if args.project_only:
        d = Deployment()
        print(f"deployment (assumptions): {d}")
        for k, v in project(d).items():
            print(f"  {k}: {v:,.0f}" if isinstance(v, (int, float)) else f"  {k}: {v}")
        for row in saturation_table(d):
            print(f"  {row['component']:<44} {row['cores_at_size']:6.2f} cores at {d.replicas} replicas; "
                  f"one core saturates at {row['saturates_at']} replicas")
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
