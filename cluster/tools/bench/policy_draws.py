"""The cost policy over seeds x tie-breaking draws: does a run fall into the low steady state?

    python -m cluster.tools.bench.policy_draws [--replicas 64] [--popularity uniform] [--load 0.75]
        [--seeds 0 1 ... 7] [--draws 3] [--extra-draws 5:101 5:103] [--out FILE.jsonl]

cluster/tools/bench/cell_quality.py's workload and simulation (the capacity-bound shared-prefix
workload, the real Router classes), each seed's pool, arrivals and prompts fixed, and only the
routers' tie-breaking random streams changed: draw d seeds them as `make_arm`'s `seed` (a seed's
own draw is d = seed, as cell_quality runs it; `--draws 3` adds seed + 100 and seed + 200). Arms:
`one`, one router, and `cells`, cells of 32 with two choices (routing.cell_choice "two", up to
routing.cell_max_choices cells for a hot prefix), as cell_quality's "two". A run is
**collapsed** when its hit rate is under 0.6 or its TTFT p50 over 300 ms (the low steady state:
hit 0.07-0.45, p50 0.3-3 s; the high one: hit 0.70-0.80, p50 60-95 ms). Printed: each run, the
collapsed runs, and per arm the mean hit rate and TTFT p50 / p90 over the runs that did not
collapse. The policy measured is the one importable as `router.policy` (run with PYTHONPATH at
another checkout to measure its policy on the same runs: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from cluster.config.pools import RoutingOptions
from cluster.tools.bench.cell_quality import Workload, measure, pool, requests
from cluster.tools.bench.cell_sim import Params, Simulation, make_arm
from router.policy import PolicyConfig

ARMS = {"one": None, "cells": 32}  # one router; cells of 32 (two choices)
LABELS = {"one": "one router", "cells": "cells of 32"}


def run(w: Workload, seed: int, draw: int, cell_size: int | None) -> dict:
    """One run: seed `seed`'s pool and requests, the routers' tie-breaking streams seeded by `draw`."""
    p = Params()
    rng = random.Random(seed)
    replicas = pool(w.replicas, rng)
    reqs = requests(w, p, rng)
    box: list = []
    arm = make_arm(replicas, cell_size, None, PolicyConfig(), lambda: box[0].now, draw, "two",
                   RoutingOptions().cell_max_choices)
    sim = Simulation(replicas, arm, p, seed, (w.warmup_s, w.seconds))
    box.append(sim)
    out = measure(sim.run(reqs), sim, w)
    return {"hit": out["hit"], "p50": out["p50"] * 1e3, "p90": out["p90"] * 1e3}


def collapsed(r: dict) -> bool:
    return r["hit"] < 0.6 or r["p50"] > 300


def summary(rows: list[dict]) -> list[str]:
    lines = [f"collapsed: {[(r['seed'], r['draw'], r['arm']) for r in rows if collapsed(r)] or 'none'}"]
    for arm in ARMS:
        ok = [r for r in rows if r["arm"] == arm and not collapsed(r)]
        n = sum(r["arm"] == arm for r in rows)
        means = " ".join(f"{k} {statistics.mean(r[k] for r in ok):.3f}" for k in ("hit", "p50", "p90")) if ok else ""
        lines.append(f"{LABELS[arm]}: {len(ok)} of {n} runs not collapsed: {means}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--popularity", choices=["uniform", "zipf"], default="uniform")
    ap.add_argument("--load", type=float, default=0.75)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    ap.add_argument("--draws", type=int, default=3, help="per seed: seed, seed + 100, seed + 200, ...")
    ap.add_argument("--extra-draws", nargs="*", default=[], help="more runs, each SEED:DRAW")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="one: one router; cells: cells of 32")
    ap.add_argument("--out", help="append each run as a JSON line here")
    args = ap.parse_args(argv)
    w = Workload(args.replicas, args.load, 1.0 if args.popularity == "zipf" else 0.0)
    runs = [(s, s + 100 * k) for s in args.seeds for k in range(args.draws)]
    runs += [tuple(map(int, x.split(":"))) for x in args.extra_draws]
    rows = []
    for seed, draw in runs:
        for arm in args.arms:
            row = {"replicas": w.replicas, "popularity": args.popularity, "load": w.load, "seed": seed, "draw": draw,
                   "arm": arm, **run(w, seed, draw, ARMS[arm])}
            rows.append(row)
            print(f"seed {seed} draw {draw:>3} {LABELS[arm]:<11} hit {row['hit']:.3f} TTFT p50 {row['p50']:7.1f} ms "
                  f"p90 {row['p90']:7.1f} ms{'  COLLAPSED' if collapsed(row) else ''}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
