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

`--real DIR` also runs the trace on real `pdserve up` clusters on this machine (plan_validation's:
the profile's model, admission off), the starting split twice: planner off (fixed) and on
(dynamic, with `--interval/--patience/--cooldown`; the SLO given to it as telemetry.slo, so its
values must be bucket bounds). Printed: both arms' goodput and its ratio, and every decision the
planner logged (from its replica's log). Run it under the machine's CPU lock.
"""

from __future__ import annotations

import argparse
import glob
import json
from dataclasses import replace
from pathlib import Path

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
    ap.add_argument("--real", metavar="DIR", help="also run both arms on real clusters, writing here")
    ap.add_argument("--start", help="the starting split for --real (NP+MD; default: the best for the first phase)")
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
    if args.real:
        real_arms(profile, ClusterConfig.parse(args.start, base) if args.start else start, trace, slo, opts,
                  Path(args.real))
    return 0


def planner_lines() -> list[str]:
    """What the planner logged in the Ray session still running (its replica's Serve log)."""
    out = []
    for path in sorted(glob.glob("/tmp/ray/session_latest/logs/serve/replica_pdserve_planner_*.log")):
        out += [line.split("planner: ", 1)[1].rstrip() for line in open(path, errors="replace") if "planner: " in line]
    return out


def real_arms(profile: Profile, start: ClusterConfig, trace: list[RequestSpec], slo: SLO, opts: SplitOptions,
              out: Path) -> None:
    from cluster.planner.validation import Metrics  # noqa: PLC0415
    from cluster.tools.bench.plan_validation import run_real  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    path = out / "shift-trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": round(r.arrival_s * 1000.0, 3), "input_length": r.prompt_tokens,
                                        "output_length": r.output_tokens}) + "\n" for r in trace))
    telemetry = {"slo": {"ttft_threshold_s": slo.ttft_s, "itl_threshold_s": slo.tpot_s}}
    planner = {"enabled": True, "interval_s": opts.interval_s, "patience": opts.patience,
               "cooldown_s": opts.cooldown_s}
    got, logs = {}, {}
    for arm, extra in (("fixed", {"telemetry": telemetry}), ("dynamic", {"telemetry": telemetry, "planner": planner})):
        tag = f"real-{arm}-{start.prefill_replicas}P{start.decode_replicas}D"
        result, cpu = run_real(start, profile, path, slo, out, tag, extra=extra,
                               before_stop=lambda arm=arm: logs.__setitem__(arm, planner_lines()))
        got[arm] = Metrics.of_bench(result, slo)
        m = got[arm]
        print(f"  real {arm:<8} {start.prefill_replicas}P+{start.decode_replicas}D  goodput {m.goodput:6.2f} req/s  "
              f"TTFT p50/p90 {m.ttft_p50:.2f}/{m.ttft_p90:.2f} s  TPOT p50/p90 {m.tpot_p50 * 1e3:.1f}/"
              f"{m.tpot_p90 * 1e3:.1f} ms  {result['completed']}/{len(trace)} completed; load generator "
              f"{result['client_cpu_cores']:.2f} cores, p99 send lag {result['client_send_lag_p99_ms']:.1f} ms"
              f"{'' if result['client_kept_up'] else ' FELL BEHIND'}; cores busy: "
              + ", ".join(f"{k} {v / result['duration']:.2f}" for k, v in cpu.items()), flush=True)
    for line in logs.get("dynamic", []):
        print(f"    {line}")
    f, d = got["fixed"].goodput, got["dynamic"].goodput
    print(f"  real dynamic / fixed goodput = {d / f if f else float('inf'):.2f}x (goal >= 1.3x)")


if __name__ == "__main__":
    raise SystemExit(main())
