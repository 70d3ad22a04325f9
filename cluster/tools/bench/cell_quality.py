"""Routing quality in cells against one router, at equal load (issue 50, item 7).

    python -m cluster.tools.bench.cell_quality [--replicas 64 256] [--cell-sizes 32 16]
        [--loads 0.6 0.75] [--popularity uniform zipf] [--seeds 3] [--seconds 20] [--spill-at 32 4]
        [--variants cells balanced two] [--max-choices 4 2] [--first-seed 0] [--placement rank hash]

The capacity-bound shared-prefix workload (docs/benchmarks.md, issue 19) at cluster scale, on the
discrete-event simulation of cluster/tools/bench/cell_sim.py (the real Router classes, fed the real
way; no Ray, no engines). For R replicas (P:D 1:3, as cluster/tools/bench/cells.py; ids drawn per
seed, so each seed places them in cells afresh):
- `systems-per-prefill` x the prefill replicas distinct system prompts of 1,024 tokens (64 blocks),
  each request one of them (uniform, or Zipf with exponent 1: the k-th most popular drawn in
  proportion to 1/k) and a fresh suffix of 64-448 tokens; Poisson arrivals, their rate ramped up
  over the warm-up.
- A prefill replica's cache holds 576 blocks: 9 system prompts, or fewer beside the suffixes'
  blocks; with 4 prompts a prefill replica the pool holds every prompt about twice, one replica
  about a ninth of them: the pool is capacity-bound, as issue 19's was.
- A prompt costs 20 ms + 50 us an uncached token (saturation.py's Deployment: 70B, tp=8 on H200s,
  20,000 prompt tokens a second a replica; the 20 ms fixed part is an assumption); a stream holds its
  decode replica for 10.24 s (256 tokens at 40 ms).
- `load`: arrivals over the prefill pool's capacity with every system prompt cached
  (prefill replicas / (20 ms + 50 us x 256 mean suffix tokens)).
Arms, on the same arrivals and prompts: one router over all replicas, and cells of each
`--cell-sizes` (router/cells.py's cell_count, replica_cell, request_ranking and walk) at each
`--spill-at` (routing.cell_choice "spill", routing.cell_spill_requests; its default is hot_load_cap,
32), and `--variants` beside them (two choices: routing.cell_choice "two", the default, through
Router.price and router/cells.py's prefer, a hot prefix spread over up to each `--max-choices`
cells: routing.cell_max_choices, HotPrefixes, 2 for plain two choices; cells balanced by role,
bench only), each replica placed by each `--placement`: "rank", the product's (a replica's Serve
rank mod the cells, its rank its index among its role's replicas), or "hash", the placement before
ranks (each replica by the hash of its role and id; cell_sim.placed). Seeds `--first-seed` on,
`--seeds` of them (a long run split in parts). Measured over the
requests arriving after `--warmup` seconds: hit rate (cached prompt tokens / prompt tokens; the
ceiling is 1,024 / 1,280 = 0.80), TTFT p50 / p90 (queue + prefill), load imbalance (the busiest prefill
replica's busy time over the mean), the share of requests a second cell decided (and with more
choices, the share of requests of hot prefixes and the cells they spread over), and each figure over
the single router's (mean over seeds, with the range); and the routers' CPU a call, in process (a
decision; a price, with two choices)."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from cluster.engine.kv_cache import hash_request_blocks
from cluster.tools.bench.cell_sim import Params, Request, Simulation, make_arm
from cluster.config.pools import RoutingOptions
from router.cells import SPREAD
from router.policy import PolicyConfig

SALT = b"bench-model"
SYSTEM_TOKENS = 1024
SUFFIX = (64, 448)  # a request's own tokens, uniform (inclusive)


@dataclass(frozen=True)
class Workload:
    replicas: int = 64
    load: float = 0.85  # arrivals / the prefill pool's capacity at full prefix hits
    zipf: float = 0.0  # popularity exponent (0: uniform)
    systems_per_prefill: float = 4.0  # distinct system prompts per prefill replica
    seconds: float = 20.0  # arrivals for this long
    warmup_s: float = 5.0  # requests arriving before this are not measured

    @property
    def prefill_replicas(self) -> int:
        return max(1, self.replicas // 4)

    @property
    def systems(self) -> int:
        return max(1, round(self.systems_per_prefill * self.prefill_replicas))


def pool(replicas: int, rng: random.Random) -> list[tuple[str, str]]:
    """(role, replica id): P:D 1:3, ids of 8 random hex digits (as Serve's replica ids are random)."""
    n_pre = max(1, replicas // 4)
    return [("prefill" if i < n_pre else "decode", f"{'prefill' if i < n_pre else 'decode'}-{rng.getrandbits(32):08x}")
            for i in range(replicas)]


def rate(w: Workload, p: Params) -> float:
    """Arrivals a second: `load` x the prefill pool's requests a second with every prefix cached."""
    mean_suffix = (SUFFIX[0] + SUFFIX[1]) / 2
    return w.load * w.prefill_replicas / (p.service_a + p.service_b * mean_suffix)


def requests(w: Workload, p: Params, rng: random.Random) -> list[Request]:
    """Poisson arrivals for w.seconds, each a system prompt (by popularity) and a fresh suffix. The
    rate ramps up linearly over the warm-up (thinning): a pool started cold at full load computes
    every prompt whole, falls behind, and its queues make the router spread prefixes everywhere."""
    systems = [[rng.randrange(32000) for _ in range(SYSTEM_TOKENS)] for _ in range(w.systems)]
    known = [hash_request_blocks(s, p.block_size, SALT) for s in systems]
    weights = [1.0 / (k + 1) ** w.zipf for k in range(w.systems)]
    lam, t, out = rate(w, p), 0.0, []
    while True:
        t += rng.expovariate(lam)
        if t >= w.seconds:
            return out
        if t < w.warmup_s and rng.random() >= t / w.warmup_s:
            continue
        s = rng.choices(range(w.systems), weights)[0]
        tokens = systems[s] + [rng.randrange(32000) for _ in range(rng.randint(*SUFFIX))]
        out.append(Request(t, s, len(tokens), hash_request_blocks(tokens, p.block_size, SALT, known[s])))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(done: list[Request], sim: Simulation, w: Workload) -> dict:
    """The arm's figures over the requests that arrived after the warm-up."""
    m = [r for r in done if r.arrival >= w.warmup_s]
    ttft = [r.done - r.arrival for r in m]
    busy = [rep.busy_s for rep in sim.replicas.values() if rep.role == "prefill"]
    return {"hit": sum(r.cached for r in m) / sum(r.tokens for r in m),
            "p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9),
            "imbalance": max(busy) / statistics.mean(busy) if statistics.mean(busy) > 0 else float("nan"),
            "spilled": sum(r.spilled for r in m) / len(m), "local": sim.arm.local, "requests": len(m),
            "price_us": per_call_us(sim.arm.price_cpu), "route_us": per_call_us(sim.arm.route_cpu),
            "wide": sim.arm.drawn[0] / max(1, len(done)), "wide_cells": sim.arm.drawn[1] / max(1, sim.arm.drawn[0])}


def per_call_us(acc: list) -> float:
    """Mean CPU microseconds a call over a run ([seconds, calls]; nan without a call)."""
    return acc[0] / acc[1] * 1e6 if acc[1] else float("nan")


def run_arm(w: Workload, p: Params, seed: int, cell_size: int | None, spill_at: int | None,
            config: PolicyConfig, variant: str = "cells", most_choices: int = 2,
            spread: int = SPREAD, placement: str = "rank") -> dict:
    """One arm, one seed: the same pool and requests for every arm of this seed."""
    rng = random.Random(seed)
    replicas = pool(w.replicas, rng)
    reqs = requests(w, p, rng)
    box: list = []
    arm = make_arm(replicas, cell_size, spill_at, config, lambda: box[0].now, seed, variant, most_choices, spread,
                   placement)
    sim = Simulation(replicas, arm, p, seed, (w.warmup_s, w.seconds))
    box.append(sim)
    t0 = time.process_time()
    done = sim.run(reqs)
    out = measure(done, sim, w)
    out.update(cells=arm.cells, cpu_s=time.process_time() - t0)
    return out


ARM_FIGURES = ("hit", "p50", "p90", "imbalance")


def label(cell_size: int | None, spill_at: int | None, variant: str = "cells", most_choices: int = 2,
          spread: int = SPREAD, placement: str = "rank") -> str:
    if cell_size is None:
        return "one router"
    by = ", by hash" if placement == "hash" and variant != "balanced" else ""
    if variant == "two":
        more = f"up to {most_choices} choices{'' if spread == SPREAD else f' x{spread}'}"
        return f"cells of {cell_size}, {'two choices' if most_choices == 2 else more}{by}"
    return f"cells of {cell_size}{' balanced' if variant == 'balanced' else ''}, spill {spill_at}{by}"


def compare(w: Workload, p: Params, seeds: range, arms: list[tuple[int, int, str, int, int, str]],
            config: PolicyConfig) -> list[dict]:
    """Each arm over `seeds`: its figures' means, and each over the single router's (per seed).
    An arm: (cell size, spill bound, variant, most choices, spread, placement)."""
    rows = []
    single = [run_arm(w, p, s, None, None, config) for s in seeds]
    rows.append(summary(label(None, None), single, single))
    for arm in arms:
        runs = [run_arm(w, p, s, arm[0], arm[1], config, *arm[2:]) for s in seeds]
        rows.append(summary(label(*arm), runs, single))
    return rows


def summary(name: str, runs: list[dict], single: list[dict]) -> dict:
    row = {"arm": name, "cells": runs[0]["cells"], "requests": sum(r["requests"] for r in runs),
           "spilled": statistics.mean(r["spilled"] for r in runs), "local": sum(r["local"] for r in runs),
           "cpu_s": sum(r["cpu_s"] for r in runs), "price_us": statistics.mean(r["price_us"] for r in runs),
           "route_us": statistics.mean(r["route_us"] for r in runs), "wide": statistics.mean(r["wide"] for r in runs),
           "wide_cells": statistics.mean(r["wide_cells"] for r in runs)}
    for k in ARM_FIGURES:
        row[k] = statistics.mean(r[k] for r in runs)
        ratios = [r[k] / s[k] for r, s in zip(runs, single)]
        row[k + "_ratio"] = (statistics.mean(ratios), min(ratios), max(ratios))
    return row


def within(row: dict, goal: float = 0.05) -> bool:
    """The issue's goal: hit rate and TTFT (p50 and p90) within 5% of the single router's, every seed."""
    hit_lo = row["hit_ratio"][1]
    ttft_hi = max(row["p50_ratio"][2], row["p90_ratio"][2])
    return hit_lo >= 1 - goal and ttft_hi <= 1 + goal


def print_rows(w: Workload, rows: list[dict], lam: float) -> None:
    pop = "uniform" if w.zipf == 0 else f"Zipf {w.zipf:g}"
    print(f"\n{w.replicas} replicas ({w.prefill_replicas} prefill), {w.systems} system prompts, {pop}, load "
          f"{w.load:.0%} ({lam:,.0f} requests/s)", flush=True)
    for r in rows:
        ratio = " ".join(f"{k} {r[k + '_ratio'][0]:.3f} ({r[k + '_ratio'][1]:.3f}-{r[k + '_ratio'][2]:.3f})"
                         for k in ARM_FIGURES)
        goal = "" if r["arm"] == "one router" else ("  goal met" if within(r) else "  goal NOT met")
        print(f"  {r['arm']:<31} {r['cells']:>2} cells: hit {r['hit']:.3f}, TTFT p50 {r['p50'] * 1e3:6.1f} ms "
              f"p90 {r['p90'] * 1e3:7.1f} ms, imbalance {r['imbalance']:.2f}, spilled {r['spilled']:.1%}, "
              f"local {r['local']}, {r['requests']} requests, {r['cpu_s']:.0f} s CPU", flush=True)
        price = "" if r["price_us"] != r["price_us"] else f", price {r['price_us']:.0f} us"
        if r["wide"]:
            price += (f"; {r['wide']:.1%} of requests of hot prefixes, spread over {r['wide_cells']:.2f} cells "
                      "on average")
        print(f"    router calls (in process): decide {r['route_us']:.0f} us{price}", flush=True)
        if r["arm"] != "one router":
            print(f"    / one router: {ratio}{goal}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--cell-sizes", type=int, nargs="*", default=[32, 16], help="none: the one router alone")
    ap.add_argument("--spill-at", type=int, nargs="+", default=[32], help="routing.cell_spill_requests")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.85])
    ap.add_argument("--popularity", choices=["uniform", "zipf"], nargs="+", default=["uniform", "zipf"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--max-choices", type=int, nargs="+", default=[RoutingOptions().cell_max_choices],
                    help="two: the most cells a hot prefix is spread over (routing.cell_max_choices; 2: its first two always)")
    ap.add_argument("--spread", type=int, nargs="+", default=[SPREAD],
                    help="two: a prefix of share s is spread over ceil(spread x s x cells) cells (HotPrefixes.spread; bench only)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--systems-per-prefill", type=float, default=4.0)
    ap.add_argument("--variants", nargs="+", choices=["cells", "balanced", "two"], default=["cells"],
                    help="cells: router/cells.py's spill walk; balanced: cells balanced by role (cell_sim.balanced_cells); "
                    "two: routing.cell_choice two, the cheaper of a request's first two cells (cell_sim.decide_two)")
    ap.add_argument("--placement", nargs="+", choices=["rank", "hash"], default=["rank"],
                    help="cells and two: a replica's cell by its rank (the product's) or by its hash (before ranks)")
    args = ap.parse_args(argv)
    p, config = Params(), PolicyConfig()
    arms = [(c, s, v, m, k, pl) for c in args.cell_sizes for v in args.variants
            for s in (args.spill_at if v != "two" else [None]) for m in (args.max_choices if v == "two" else [2])
            for k in (args.spread if m > 2 else [SPREAD]) for pl in (args.placement if v != "balanced" else ["rank"])]
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    for r in args.replicas:
        for pop in args.popularity:
            for load in args.loads:
                w = Workload(r, load, 1.0 if pop == "zipf" else 0.0, args.systems_per_prefill, args.seconds,
                             args.warmup)
                print_rows(w, compare(w, p, seeds, arms, config), rate(w, p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
