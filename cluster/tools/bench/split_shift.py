"""When does a run-time P:D split pay? The planner's simulator, priced by a profile, on a trace
whose mix shifts (issue 42, "Acting at run time").

    python -m cluster.tools.bench.split_shift --profile docs/bench-plan-validation/profile.json

The trace is two phases back to back, each a seeded synthetic workload (`--first`, `--second`,
the `pdserve plan --workload` syntax). With `--budget` replicas in all:
  fixed-first  the split with the best goodput on the first phase alone (what an operator sizing
               for the traffic of the morning picks), run on the whole trace;
  dynamic      the same starting split with the run-time planner (cluster/planner/runtime.py, its
               default options unless given) moving replicas between the pools;
  fixed-best   the best fixed split for the whole trace, found by trying every split (hindsight:
               no operator has it, the upper bound of what a fixed split can do).
Then the control: the first phase twice over (no shift), fixed-first against dynamic, where the
planner must not cost anything. Printed: goodput, SLO attainment, TTFT/TPOT p90 per arm, each
move with its reason, and the ratios.

The cluster is a GPU cluster's shape by default (each replica its own device); `--cores N`
prices this machine's sharing instead (every replica on N cores: moving a replica between
pools then moves no compute, only batching and KV).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.outcome import SimResult
from cluster.planner.profile import Profile
from cluster.planner.runtime import SplitOptions, SplitPolicy
from cluster.planner.simulator import Simulator
from cluster.planner.workload import RequestSpec, SyntheticWorkload


def shifted(first: list[RequestSpec], second: list[RequestSpec]) -> list[RequestSpec]:
    """`second` after `first` (its times offset by the first phase's last arrival)."""
    t0 = first[-1].arrival_s if first else 0.0
    return first + [replace(r, arrival_s=t0 + r.arrival_s) for r in second]


def run(profile: Profile, config: ClusterConfig, specs: list[RequestSpec], slo: SLO,
        split: SplitOptions | None = None, flip_s: float = 0.5) -> SimResult:
    policy = SplitPolicy(slo, split) if split is not None else None
    return Simulator(profile, config, slo, split=policy, flip_s=flip_s).run(specs)


def splits(base: ClusterConfig, budget: int) -> list[ClusterConfig]:
    return [replace(base, prefill_replicas=p, decode_replicas=budget - p) for p in range(1, budget)]


def best_fixed(profile: Profile, base: ClusterConfig, budget: int, specs: list[RequestSpec],
               slo: SLO) -> tuple[ClusterConfig, SimResult]:
    results = [(c, run(profile, c, specs, slo)) for c in splits(base, budget)]
    return max(results, key=lambda cr: (cr[1].goodput, -cr[0].prefill_replicas))


def line(name: str, r: SimResult) -> str:
    return (f"  {name:<12} {r.config.prefill_replicas}P+{r.config.decode_replicas}D  goodput {r.goodput:6.2f} req/s  "
            f"attained {r.attainment:5.1%}  TTFT p90 {r.ttft.p90:7.2f} s  TPOT p90 {r.tpot.p90 * 1e3:6.1f} ms  "
            f"over {r.duration_s:6.1f} s")


def moves(r: SimResult) -> list[str]:
    return [f"    {t:7.1f} s  {rid} -> {to}: {why}" for t, rid, to, why in r.flips]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--first", default="rate=10,n=1000,prompt=32:128,output=64:256,seed=1",
                    help="the first phase (chat-heavy by default)")
    ap.add_argument("--second", default="rate=3.5,n=350,prompt=300:600,output=16:48,seed=2",
                    help="the second phase (long prompts, short answers by default)")
    ap.add_argument("--slo", default="ttft=2,tpot=0.1")
    ap.add_argument("--budget", type=int, default=4, help="replicas in all")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--skip-prefill", type=int, default=64)
    ap.add_argument("--decode-blocks", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--cores", type=float, default=None)
    ap.add_argument("--interval", type=float, default=SplitOptions.interval_s)
    ap.add_argument("--patience", type=int, default=SplitOptions.patience)
    ap.add_argument("--cooldown", type=float, default=SplitOptions.cooldown_s)
    ap.add_argument("--flip-s", type=float, default=0.5, help="a move's own cost once drained (weights kept)")
    args = ap.parse_args(argv)

    profile = Profile.load(args.profile)
    slo = SLO.parse(args.slo)
    base = ClusterConfig(1, 1, chunk_tokens=args.chunk, skip_prefill_tokens=args.skip_prefill,
                         decode_blocks=args.decode_blocks, max_num_seqs=args.max_num_seqs, cores=args.cores)
    opts = SplitOptions(interval_s=args.interval, patience=args.patience, cooldown_s=args.cooldown)
    first = SyntheticWorkload.parse(args.first).requests()
    second = SyntheticWorkload.parse(args.second).requests()
    trace = shifted(first, second)

    start, _ = best_fixed(profile, base, args.budget, first, slo)
    fixed = run(profile, start, trace, slo)
    dynamic = run(profile, start, trace, slo, opts, args.flip_s)
    _, best = best_fixed(profile, base, args.budget, trace, slo)
    print(f"shift: {args.first} then {args.second}; SLO {args.slo}; {args.budget} replicas; "
          f"{'each on its own device' if args.cores is None else f'sharing {args.cores:g} cores'}")
    print(line("fixed-first", fixed))
    print(line("dynamic", dynamic))
    print("\n".join(moves(dynamic)) or "    (no moves)")
    print(line("fixed-best", best))
    ratio = dynamic.goodput / fixed.goodput if fixed.goodput else float("inf")
    print(f"  dynamic / fixed-first goodput = {ratio:.2f}x (goal >= 1.3x); "
          f"dynamic / fixed-best = {dynamic.goodput / best.goodput if best.goodput else float('inf'):.2f}x")

    control = shifted(first, first)
    c_fixed = run(profile, start, control, slo)
    c_dynamic = run(profile, start, control, slo, opts, args.flip_s)
    print("control: the first phase twice (no shift)")
    print(line("fixed-first", c_fixed))
    print(line("dynamic", c_dynamic))
    print("\n".join(moves(c_dynamic)) or "    (no moves)")
    print(f"  dynamic / fixed-first goodput = "
          f"{c_dynamic.goodput / c_fixed.goodput if c_fixed.goodput else float('inf'):.2f}x (a fixed split is as good: ~1.0x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
