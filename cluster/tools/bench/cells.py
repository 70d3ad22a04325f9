"""Routers in cells at scale (issue 50, item 6): what one cell's router costs as the cluster grows.

    python -m cluster.tools.bench.cells --replicas 1000 4000 [--cell-size 32] [--sample-cells 4]
    python -m cluster.tools.bench.cells --side-by-side 1 2 4 8 [--cell-size 32]
    python -m cluster.tools.bench.cells --project-only

For R simulated replicas (P:D 1:3, ids `prefill-i` / `decode-i`), the cells are those the app makes
(router/cells.py): ceil(R / cell-size), each replica in the cell rendezvous hashing of its role and
id gives it. Printed: the cells' sizes, and how the first blocks of 65,536 distinct prompts spread
over them (a request asks its first block's cell).

Then cells run side by side as real RouterActors (router/actor.py), each over its own members'
snapshots (blocks-per-replica hashes each, 4 of the cell's system prompts among them) and loads:
`--replicas`: `--sample-cells` of the cells (the largest first; 125 router processes do not fit
this machine, and each cell's work depends only on its own members); `--side-by-side N`: N cells of
N x cell-size replicas, all of them. One driver (this process, the load generator: its CPU is
printed) sends feed calls (8 events + the load, one replica after another over every cell's
members, 64 in flight), then route calls (prompts of each cell's own system prompts, to that
cell). Per cell: its actor's CPU a feed call and a route call (psutil, the actor process), and the
cores it would need at the per-replica traffic of saturation.py's Deployment (70B, tp=8, on H200s):
its members' feed calls plus its share of the decisions. Flat per-cell cost as R grows is the claim.

`--project-only` (also printed after a run, with its measured costs): 1,000 and 10,000 GPUs, the
cores of each component with two choices (a request priced in two cells and decided in one, over
the routers' channels): the cells' routers (the mean cell and the largest), the ingress (its
per-request and per-message CPU, saturation.py, plus the prices' calls and choosing a cell), and
the registry's reports (estimated, not measured here). This bench's own route calls go by Ray: a
run's projection swaps their Ray share for the channel's (saturation.py's two route arms)."""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from collections import Counter
from typing import Callable

from cluster.engine.kv_cache import hash_request_blocks
from cluster.tools.bench.saturation import (CHANNEL_ROUTE_EXTRA_S, INGRESS, INGRESS_CHANNEL_CALL_S, INGRESS_PROCESS_CORES,
                                            MEASURED_DECISIONS, RAY_FEED_CALL_S, RAY_REPORT_CALL_S, RAY_ROUTE_EXTRA_S,
                                            Deployment, ingress_cores, ingress_processes, interpolate, project)
from cluster.tools.bench.saturation_router import SALT
from router.cells import block_key, ranking, replica_cell, request_ranking
from router.policy import ReplicaLoad

SYSTEMS_PER_CELL = 8
SYSTEM_TOKENS = 1024


def cells_of(replicas: int, cell_size: int) -> list[list[tuple[str, str]]]:
    """Each cell's members, (role, replica id), as router/cells.py assigns them."""
    n = max(1, -(-replicas // cell_size))
    n_pre = max(1, replicas // 4)
    cells: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    for i in range(replicas):
        role, rid = ("prefill", f"prefill-{i}") if i < n_pre else ("decode", f"decode-{i - n_pre}")
        cells[replica_cell(role, rid, n)].append((role, rid))
    return cells


def prompt_spread(n_cells: int, prompts: int = 65_536) -> tuple[float, float]:
    """(max, min) requests a cell gets over the mean, for `prompts` distinct first blocks."""
    rng = random.Random(2)
    counts = Counter(ranking(rng.getrandbits(64), n_cells)[0] for _ in range(prompts))
    mean = prompts / n_cells
    return max(counts.values()) / mean, min(counts.get(c, 0) for c in range(n_cells)) / mean


def cell_systems(cell: int, n_cells: int, rng: random.Random) -> list[list[int]]:
    """System prompts whose first block ranks `cell` first: the requests this cell's router decides."""
    out = []
    while len(out) < SYSTEMS_PER_CELL:
        s = [rng.randrange(32000) for _ in range(SYSTEM_TOKENS)]
        if ranking(block_key(hash_request_blocks(s[:16], 16, SALT)[0]), n_cells)[0] == cell:
            out.append(s)
    return out


def start_cell(members, systems, blocks_per_replica: int, rng: random.Random):
    """A RouterActor holding its members' snapshots and loads (as their first feed calls leave it)."""
    import ray

    from router.actor import RouterActor

    actor = RouterActor.remote()
    hashes = [hash_request_blocks(s, 16, SALT) for s in systems]
    loads = []
    for n, (role, rid) in enumerate(members):
        own = [h for k in range(4) for h in hashes[(n + 3 * k) % len(hashes)]][:blocks_per_replica]
        filler = [rng.randbytes(16) for _ in range(blocks_per_replica - len(own))]
        loads.append(ReplicaLoad(rid, role, 2000 + rng.randrange(4000), 8000, rng.randrange(32), rng.randrange(4),
                                 rng.randrange(4096) if role == "prefill" else 0, 0.03 + rng.random() * 0.01,
                                 20000.0))
        ray.get(actor.resync.remote(rid, "inc", 0, own + filler))
    ray.get([actor.report_load.remote(x) for x in loads])
    return actor, loads


def drive(actors: list, call, seconds: float) -> tuple[int, list[float], float, float]:
    """Calls round-robin over the actors, 64 in flight: (calls, each actor's CPU seconds, the
    driver's CPU seconds, wall seconds)."""
    import psutil
    import ray

    procs = [psutil.Process(ray.get(a.__ray_call__.remote(lambda self: os.getpid()))) for a in actors]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    inflight, n = [], 0
    c0, w0 = time.process_time(), time.monotonic()
    while time.monotonic() - w0 < seconds:
        inflight.append(call(n))
        n += 1
        if len(inflight) >= 64:
            ready, inflight = ray.wait(inflight, num_returns=32)
            ray.get(ready)
    ray.get(inflight)
    wall, gen = time.monotonic() - w0, time.process_time() - c0
    return n, [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)], gen, wall


def run_cells(cells: list, which: list[int], blocks_per_replica: int, seconds: float) -> list[dict]:
    """The cells `which` of `cells` side by side as RouterActors: per cell, CPU a feed call and a route call."""
    import ray

    rng = random.Random(0)
    n_cells = len(cells)
    setup = []
    for c in which:
        systems = cell_systems(c, n_cells, rng)
        actor, loads = start_cell(cells[c], systems, blocks_per_replica, rng)
        work = [hash_request_blocks(s + [rng.randrange(32000) for _ in range(rng.randrange(64, 449))], 16, SALT)
                for s in systems for _ in range(8)]
        setup.append((actor, loads, work))
    actors = [a for a, _, _ in setup]
    fresh = iter(rng.randbytes(16) for _ in range(10_000_000))
    slots = [(k, i) for k in range(len(setup)) for i in range(len(setup[k][1]))]  # every member of every cell
    seqs: Counter = Counter()

    def feed(n):
        k, i = slots[n % len(slots)]
        actor, loads, _ = setup[k]
        seqs[k, i] += 1
        return actor.feed.remote(loads[i].replica_id, "inc", seqs[k, i], [("+", next(fresh)) for _ in range(8)],
                                 loads[i], None, time.time())

    def route(n):
        actor, _, work = setup[n % len(setup)]
        h = work[(n // len(setup)) % len(work)]
        return actor.route.remote(h, len(h) * 16, f"s{n % 500}")

    feeds, feed_cpu, feed_gen, feed_wall = drive(actors, feed, seconds)
    ray.get([a.report_load.remote(x) for a, loads, _ in setup for x in loads])  # loads go stale after 3 s
    routes, route_cpu, route_gen, route_wall = drive(actors, route, min(seconds, 2.0))
    out = []
    for k, c in enumerate(which):
        members = len(cells[c])
        out.append({"cell": c, "members": members,
                    "feed_us": feed_cpu[k] / (feeds * members / len(slots)) * 1e6,
                    "route_us": route_cpu[k] / (routes / len(setup)) * 1e6,
                    "loadgen_cores_feed": feed_gen / feed_wall, "loadgen_cores_route": route_gen / route_wall})
    for a in actors:
        ray.kill(a)
    return out


def route_s(replicas: float, extra_s: float = CHANNEL_ROUTE_EXTRA_S) -> float:
    """A route (or price) call's actor CPU at this many replicas: the decision in process plus the
    call's transport (saturation.py's measured figures; the channel, as the ingress calls since
    issue 50, unless `extra_s` says otherwise)."""
    return 1 / interpolate(MEASURED_DECISIONS, replicas) + extra_s


# A request's router calls over its cells (routing.cell_choice): "two" (the default) prices it in
# two cells and the cheaper decides (3 calls, a price costing what a decision does); "spill" asks
# its first cell (1; a second only when that one is hot).
CALLS_PER_REQUEST = {"two": 3, "spill": 1}


def cell_cores(members: float, feed_us: float, route_us: float, d: Deployment = Deployment(),
               calls_per_request: int = 1) -> float:
    """A cell's cores at d's per-replica traffic: its members' feed calls, and their share of the
    requests' router calls (`calls_per_request` of them, each costing `route_us`)."""
    p = project(d)
    per_replica_feeds, per_replica_requests = p["feed_calls_per_s"] / p["replicas"], p["requests_per_s"] / p["replicas"]
    return members * (per_replica_feeds * feed_us + per_replica_requests * calls_per_request * route_us) * 1e-6


def cells_projection(gpus: int, cell_size: int, feed_us: float, route_us: Callable[[float], float], rank_s: float,
                     choice: str = "two") -> dict:
    """Cores of each component for `gpus` H200s of saturation.py's Deployment (70B, tp=8), in
    cells of `cell_size`: the cells' routers (the mean cell and the largest of those router/cells.py
    makes, each at `route_us(its replicas)` a route or price call), the one router they replace
    (for comparison: route over Ray and over the channel), and the ingress (INGRESS a request and
    a message, the prices' further channel calls, `rank_s` to rank the cells), with the processes
    (`ingress_replicas`) that carries at 80% each."""
    d = Deployment(gpus=gpus)
    p = project(d)
    n = max(1, -(-p["replicas"] // cell_size))
    calls = CALLS_PER_REQUEST[choice]
    mean = p["replicas"] / n
    per_cell = cell_cores(mean, feed_us, route_us(mean), d, calls)
    largest = max(len(c) for c in cells_of(p["replicas"], cell_size))
    single = {way: p["feed_calls_per_s"] * RAY_FEED_CALL_S + p["decisions_per_s"] * route_s(p["replicas"], extra)
              for way, extra in (("ray", RAY_ROUTE_EXTRA_S), ("channel", CHANNEL_ROUTE_EXTRA_S))}
    ingress = ingress_cores(p, d, INGRESS) + p["requests_per_s"] * ((calls - 1) * INGRESS_CHANNEL_CALL_S + rank_s)
    return {"gpus": gpus, "replicas": p["replicas"], "requests_per_s": p["requests_per_s"],
            "messages_per_s": p["output_tokens_per_s"] / d.tokens_per_message, "cells": n,
            "cell_cores": per_cell, "routers_cores": n * per_cell, "single_router_cores": single, "largest_cell": largest,
            "largest_cell_cores": cell_cores(largest, feed_us, route_us(largest), d, calls),
            "ingress_cores": ingress, "ingress_processes": ingress_processes(ingress),
            "ranking_cores": p["requests_per_s"] * rank_s, "registry_cores": p["replicas"] * RAY_REPORT_CALL_S}


def ranking_us(n_cells: int, tries: int = 20_000) -> float:
    """The ingress's cost of a request's cell ranking (request_ranking, a 64-block prompt)."""
    rng = random.Random(3)
    h = hash_request_blocks([rng.randrange(32000) for _ in range(1024)], 16, SALT)
    t = time.process_time()
    for _ in range(tries):
        request_ranking(h, None, n_cells, rng)
    return (time.process_time() - t) / tries * 1e6


def projection(cell_size: int, feed_us: float, route_us: Callable[[float], float], measured: str) -> None:
    """Cores of each component at 1,000 and 10,000 H200s (70B, tp=8: 8 GPUs a replica)."""
    print(f"projection: saturation.py's Deployment (70B, tp=8, H200s; its traffic per replica), cell_size "
          f"{cell_size}, two choices (a price and a decision: {CALLS_PER_REQUEST['two']} router calls a request), "
          f"a cell's router at {feed_us:.0f} us a feed call and, at {cell_size} replicas, {route_us(cell_size):.0f} us a "
          f"route or price call ({measured})")
    for gpus in (1000, 10_000):
        n_cells = max(1, -(-Deployment(gpus=gpus).replicas // cell_size))
        rank_s = ranking_us(n_cells) * 1e-6
        c = cells_projection(gpus, cell_size, feed_us, route_us, rank_s)
        mean = c["replicas"] / c["cells"]
        print(f"  {gpus:>6} GPUs, {c['replicas']} replicas, {c['requests_per_s']:,.0f} requests/s, "
              f"{c['messages_per_s']:,.0f} messages/s")
        print(f"    routers: {c['cells']} cells x {c['cell_cores']:.2f} cores = {c['routers_cores']:.2f} cores (one "
              f"core each: {c['cell_cores']:.0%} of it, a cell of {mean:.1f} replicas; the largest, "
              f"{c['largest_cell']}: {c['largest_cell_cores']:.2f}); one router for all would need "
              f"{c['single_router_cores']['channel']:.1f} cores of its one, route over the channel "
              f"({c['single_router_cores']['ray']:.1f} by Ray; at least: a decision's cost measured up to 512 replicas)")
        print(f"    ingress: {c['ingress_cores']:.1f} cores: {c['ingress_processes']} processes (ingress_replicas) at "
              f"{INGRESS_PROCESS_CORES:.0%}, of which the prices' further calls "
              f"{c['requests_per_s'] * (CALLS_PER_REQUEST['two'] - 1) * INGRESS_CHANNEL_CALL_S:.2f}"
              f" and choosing a cell {c['ranking_cores']:.3f} ({rank_s * 1e6:.1f} us a request)")
        print(f"    registry reports (1/s a replica, at report_load's {RAY_REPORT_CALL_S * 1e6:.0f} us: an "
              f"estimate): {c['registry_cores']:.2f} cores")


def report(rows: list[dict], label: str) -> None:
    for r in rows:
        print(f"  {label} cell {r['cell']:>3}: {r['members']:>3} replicas, {r['feed_us']:6.0f} us a feed call, "
              f"{r['route_us']:6.0f} us a decision (Ray) -> {cell_cores(r['members'], r['feed_us'], r['route_us']):.3f} "
              f"cores at the deployment's traffic (a decision a request, no prices); load generator "
              f"{r['loadgen_cores_feed']:.2f} / "
              f"{r['loadgen_cores_route']:.2f} cores (feed / route)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="*", default=[])
    ap.add_argument("--side-by-side", type=int, nargs="*", default=[], help="N cells of N x cell-size replicas")
    ap.add_argument("--cell-size", type=int, default=32)
    ap.add_argument("--sample-cells", type=int, default=4)
    ap.add_argument("--blocks-per-replica", type=int, default=800)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--project-only", action="store_true")
    args = ap.parse_args(argv)
    if args.project_only:
        projection(args.cell_size, RAY_FEED_CALL_S * 1e6, lambda n: route_s(n) * 1e6, "saturation.py's figures")
        return 0
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    measured = []
    try:
        for r in args.replicas:
            cells = cells_of(r, args.cell_size)
            sizes = sorted(len(c) for c in cells)
            hi, lo = prompt_spread(len(cells))
            print(f"{r} replicas: {len(cells)} cells of {sizes[0]}-{sizes[-1]} replicas (median "
                  f"{statistics.median(sizes):g}); 65,536 prompts' first blocks: the busiest cell gets {hi:.2f}x "
                  f"the mean, the idlest {lo:.2f}x", flush=True)
            order = sorted(range(len(cells)), key=lambda c: -len(cells[c]))
            which = order[:1] + random.Random(r).sample(order[1:], min(args.sample_cells - 1, len(order) - 1))
            rows = run_cells(cells, which, args.blocks_per_replica, args.seconds)
            report(rows, f"{r} replicas:")
            measured += rows
        for n in args.side_by_side:
            cells = cells_of(n * args.cell_size, args.cell_size)
            rows = run_cells(cells, list(range(len(cells))), args.blocks_per_replica, args.seconds)
            per = [x["feed_us"] for x in rows]
            print(f"{n} cells side by side, {n * args.cell_size} replicas: feed {statistics.mean(per):.0f} us a call "
                  f"(cells {min(per):.0f}-{max(per):.0f}), decisions {statistics.mean(x['route_us'] for x in rows):.0f} "
                  f"us, cells of {min(x['members'] for x in rows)}-{max(x['members'] for x in rows)} replicas",
                  flush=True)
            report(rows, f"{n} side by side:")
            measured += rows
    finally:
        ray.shutdown()
    if measured:
        feed = statistics.median(x["feed_us"] for x in measured)
        route = statistics.median(x["route_us"] for x in measured) - (RAY_ROUTE_EXTRA_S - CHANNEL_ROUTE_EXTRA_S) * 1e6
        projection(args.cell_size, feed, lambda n: route,
                   f"the medians of this run's {len(measured)} cells; its route calls "
                   "went by Ray, their Ray share swapped for the channel's (saturation.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
