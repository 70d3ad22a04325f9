"""`pdserve profile` and `pdserve plan` (cluster/planner/): calibrate an engine, then plan a cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_planner_parsers(sub) -> None:
    _add_profile_parser(sub)
    _add_plan_parser(sub)


def _add_profile_parser(sub) -> None:
    pr = sub.add_parser("profile", help="measure what `pdserve plan` needs on this machine: the engine's step costs "
                                        "(in-process), the engine processes' sharing of the cores, the serving "
                                        "path's own cost and the KV transfer (real `pdserve up` runs); ~7 minutes "
                                        "with the defaults on 2 CPU cores, printed as it goes")
    pr.add_argument("--model", help="checkpoint directory (default: the demo model, SmolLM2-135M-Instruct)")
    pr.add_argument("--out", default="pdserve-profile.json", help="profile file to write")
    pr.add_argument("--prefill-tokens", type=_ints, default=None, help="prompt tokens per step (default 16,64,256,512,1024)")
    pr.add_argument("--prefill-cached", type=_ints, default=None, help="cached tokens before them, e.g. 0,1024")
    pr.add_argument("--decode-batch", type=_ints, default=None, help="decode batch sizes, e.g. 1,8,32")
    pr.add_argument("--decode-context", type=_ints, default=None, help="decode contexts, e.g. 128,1024")
    pr.add_argument("--reps", type=int, default=3, help="timed steps per point (median)")
    pr.add_argument("--threads", type=int, default=1,
                    help="torch threads while timing steps: a replica's (its pool's num_cpus, 1 by default)")
    pr.add_argument("--sharing", type=int, default=None, metavar="N",
                    help="CPU: how N engine processes stepping at once slow one another (default: the cores + 1, "
                         "at most 4; 0: not measured; ~15 s per process count)")
    pr.add_argument("--engine-only", action="store_true",
                    help="only the engine's steps (and --sharing): no serving path, no transfer; `pdserve plan` "
                         "then refuses it without --uncalibrated")
    pr.add_argument("--probe-groups", type=int, default=12, help="the serving path's runs: groups of requests")
    pr.add_argument("--probe-gap", type=float, default=3.0, help="the serving path's runs: seconds between groups")
    pr.add_argument("--device", default="auto")
    pr.add_argument("--dtype", default="auto")
    pr.set_defaults(func=_profile)


def _add_plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="simulate P:D splits, chunk sizes and skip-prefill thresholds on a workload "
                                     "and print the cheapest that meets an SLO, with the simulator's error against "
                                     "real runs when --validation is given")
    pl.add_argument("--profile", required=True, help="a file from `pdserve profile`")
    src = pl.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a load generator trace (JSONL: timestamp ms, input_length, output_length)")
    src.add_argument("--workload", help="synthetic: rate=R,n=N,prompt=LO:HI,output=LO:HI[,burstiness=B][,seed=S]")
    pl.add_argument("--slo", required=True, help="ttft=SECONDS,tpot=SECONDS (or 500ms)")
    pl.add_argument("--attain", type=float, default=0.9, help="fraction of requests that must meet the SLO")
    pl.add_argument("--budget", type=int, default=6, help="most replicas (prefill + decode)")
    pl.add_argument("--chunks", type=_ints, default=None,
                    help="chunk sizes (max_num_batched_tokens) to try (default: 256,512,1024 within the profile)")
    pl.add_argument("--skip-prefill", type=_ints, default=[0, 64, 256],
                    help="skip-prefill thresholds (routing.local_prefill_threshold) to try")
    pl.add_argument("--kv-gb", type=float, default=1.0, help="KV pool per decode replica (engine.kv_cache_memory_gb)")
    pl.add_argument("--max-num-seqs", type=int, default=None, help="per decode replica (default: the profile's "
                                                                   "largest batch, at most 64)")
    pl.add_argument("--transfer-gbps", type=float, default=None,
                    help="KV transfer bandwidth, GB/s, when the profile has no measured transfer (default: free)")
    pl.add_argument("--transfer-latency-ms", type=float, default=0.0)
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--cores", type=float, default=None,
                    help="the replicas share this many cores (every replica on one machine, as in this repo's "
                         "validation runs); default: a device per replica")
    pl.add_argument("--validation", help="a validation file (python -m cluster.tools.bench.plan_validation): its "
                                         "MAPE per metric is reported and widens the plan's predicted figures")
    pl.add_argument("--emit-config", help="write the plan as an app config (pdserve up --config FILE)")
    pl.add_argument("--uncalibrated", action="store_true",
                    help="plan on a profile that lacks the serving path's cost, the cores' sharing or the transfer "
                         "(refused without it): the first line says so and the figures are widened")
    pl.add_argument("--validate", type=int, default=0, metavar="N",
                    help="run the plan's pick for real: `pdserve up` of the emitted config and N `pdserve bench` "
                         "replays of the same trace (each with prompts of its own), then predicted against measured "
                         "side by side")
    pl.add_argument("--validate-dir", metavar="DIR",
                    help="with --validate: keep its files here (the config served, the trace, the server's log, each "
                         "replay's bench result); default: a temporary directory, removed")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=_plan)


def _profile(args) -> int:
    from cluster.app.plan_runs import profile_main  # noqa: PLC0415

    return profile_main(args)


def _plan(args) -> int:
    from cluster.planner.plan import search  # noqa: PLC0415
    from cluster.planner.profile import OutOfRange, Profile, Transfer  # noqa: PLC0415
    from cluster.planner.config import SLO  # noqa: PLC0415
    from cluster.planner.validation import Validation  # noqa: PLC0415
    from cluster.planner.workload import SyntheticWorkload, read_trace  # noqa: PLC0415

    try:
        prof = Profile.load(args.profile)
        validation = Validation.load(args.validation) if args.validation else None
        slo = SLO.parse(args.slo)
        specs = read_trace(args.trace) if args.trace else SyntheticWorkload.parse(args.workload).requests()
    except (OSError, ValueError, KeyError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    if not specs:
        print("pdserve plan: the workload has no requests", file=sys.stderr)
        return 2
    missing = _calibration(args, prof)
    if missing is None:
        return 2
    transfer, transfer_note = prof.transfer, "measured"
    if args.transfer_gbps is not None:
        transfer = Transfer(args.transfer_latency_ms / 1000, args.transfer_gbps * 1e9, measured=False)
        transfer_note = f"given: {args.transfer_gbps:g} GB/s + {args.transfer_latency_ms:g} ms"
    elif transfer is None:
        transfer_note = "NOT MODELLED (not in the profile; give --transfer-gbps): transfers are free"
    chunks = args.chunks or [c for c in (256, 512, 1024) if c <= prof.prefill.xs[-1]] or [int(prof.prefill.xs[-1])]
    max_num_seqs = args.max_num_seqs or int(min(64, prof.decode.xs[-1]))
    decode_blocks = int(args.kv_gb * 2**30 // prof.engine["kv_block_bytes"])
    t0 = time.process_time()
    try:
        plan = search(prof, specs, slo, args.budget, chunks, args.skip_prefill, decode_blocks, max_num_seqs,
                      args.attain, transfer, args.seed, args.cores)
    except OutOfRange as e:
        print(f"pdserve plan: refused: {e}", file=sys.stderr)
        return 3
    cpu_s = time.process_time() - t0
    simulated = (plan.evaluated + _extra_runs(plan)) * len(specs)
    vlines, vjson = _validation_report(validation, plan, prof, specs, slo)
    if args.json:
        doc = _plan_json(plan, prof, specs, slo, transfer_note, cpu_s, simulated)
        print(json.dumps({**doc, "validated": validation is not None, "validation": vjson, "uncalibrated": missing},
                         indent=1))
    else:
        _print_plan(plan, prof, specs, slo, args.attain, transfer_note, cpu_s, simulated)
        print("\n".join(vlines + (_uncalibrated_lines(plan, slo) if missing else [])))
    if args.emit_config and plan.best is not None:
        _emit_config(plan.best.config, prof, slo, Path(args.emit_config))
        print(f"wrote {args.emit_config} (pdserve up --config {args.emit_config})")
    if args.validate and plan.best is not None:
        return _validate(plan.best, prof, specs, slo, args.validate, args.validate_dir, plan.spread)
    return 0 if plan.best is not None else 1


# what an engine-only plan missed by on issue 54's trace (TTFT p50/p90, TPOT p50/p90): its band
UNCALIBRATED_ERROR_PCT = {"ttft_p50": 61.0, "ttft_p90": 82.0, "tpot_p50": 80.0, "tpot_p90": 86.0}


def _uncalibrated_lines(plan, slo) -> list[str]:
    from cluster.planner.validation import band  # noqa: PLC0415

    if plan.best is None:
        return []
    r = plan.best
    sims = {"ttft_p50": r.ttft.p50, "ttft_p90": r.ttft.p90, "tpot_p50": r.tpot.p50, "tpot_p90": r.tpot.p90}
    bands = {m: (v, *band(v, UNCALIBRATED_ERROR_PCT[m])) for m, v in sims.items()}
    lines = ["UNCALIBRATED: the plan's figures widened by an engine-only plan's errors on issue 54's trace "
             "(61-86%): " + ", ".join(_band_text(m, *b) for m, b in bands.items())]
    if bands["ttft_p90"][2] > slo.ttft_s or bands["tpot_p90"][2] > slo.tpot_s:
        lines.append("  WARNING: the upper end of a p90 band is past the SLO: calibrate before trusting the pick")
    return lines


def _validate(best, prof, specs, slo, runs: int, keep: str | None, spread=None) -> int:
    import contextlib  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from cluster.app.plan_runs import side_by_side, validate  # noqa: PLC0415

    doc = {**best.config.app_doc(prof.model.get("path"), prof.block_size), **slo_sections(slo)}
    if keep is not None:
        Path(keep).mkdir(parents=True, exist_ok=True)
    where = contextlib.nullcontext(keep) if keep is not None else tempfile.TemporaryDirectory(prefix="pdserve-validate-")
    with where as work:
        try:
            results = validate(doc, specs, slo, runs, Path(work))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"pdserve plan: --validate: {e}", file=sys.stderr)
            return 4
    def resimulate(served, factor: float):
        from cluster.planner.plan import at_speed  # noqa: PLC0415
        return at_speed(prof, factor, best.config, served, slo)
    print("\n".join(side_by_side(best, results, slo, list(specs), resimulate, spread)))
    return 0


def _calibration(args, prof) -> list[str] | None:
    """What the profile lacks for a plan (printed first, with --uncalibrated); None: refused."""
    if args.validate_dir is not None and not args.validate:
        print("pdserve plan: --validate-dir needs --validate N", file=sys.stderr)
        return None
    if not 0 <= args.validate <= 10:
        print(f"pdserve plan: --validate: at most 10 runs, got {args.validate}", file=sys.stderr)
        return None
    missing = [m for m in prof.uncalibrated()  # --transfer-gbps states the transfer
               if not (args.transfer_gbps is not None and m.startswith("the KV transfer"))]
    if missing and not args.uncalibrated:
        print(f"pdserve plan: refused: {args.profile} is not calibrated for a plan: it lacks " + "; ".join(missing)
              + ". Run `pdserve profile` without --engine-only on the machine that will serve (or give "
              "--uncalibrated to plan anyway, with widened figures)", file=sys.stderr)
        return None
    if missing and not args.json:
        print("UNCALIBRATED: the profile lacks " + "; ".join(missing) + ": the figures below are the engine's "
              "alone, widened by the errors such a plan had against a real run", flush=True)
    if args.cores is None and prof.device.get("kind") == "cpu" and prof.device.get("cores"):
        args.cores = float(prof.device["cores"])  # the replicas share the machine the profile was made on
    return missing


def _row(r) -> str:
    util = ", ".join(f"{k} {v:.0%}" for k, v in r.utilisation.items())
    return (f"{r.config.label():<32} goodput {r.goodput:7.2f} req/s  attainment {r.attainment:6.1%}  "
            f"TTFT p50/p90 {r.ttft.p50:.3f}/{r.ttft.p90:.3f} s  TPOT p50/p90 {r.tpot.p50 * 1e3:.1f}/"
            f"{r.tpot.p90 * 1e3:.1f} ms  busy: {util}  preemptions {r.preemptions}"
            + ("" if r.keeps_up else f"  CANNOT KEEP UP: latency +{r.trend.growth_s:.1f} s through the trace"))


def _print_plan(plan, prof, specs, slo, attain, transfer_note, cpu_s, simulated) -> None:
    span = specs[-1].arrival_s - specs[0].arrival_s
    prompts = sorted(s.prompt_tokens for s in specs)
    outputs = sorted(s.output_tokens for s in specs)
    print(f"profile: {prof.model.get('path')} on {prof.device.get('name')} (torch {prof.versions.get('torch')}); "
          f"calibrated {prof.range_text()}")
    print(f"workload: {len(specs)} requests over {span:.1f} s ({len(specs) / span if span else float('inf'):.2f} req/s); "
          f"prompt p50 {prompts[len(prompts) // 2]} max {prompts[-1]}; output p50 {outputs[len(outputs) // 2]} "
          f"max {outputs[-1]}")
    print(f"SLO: TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s * 1e3:g} ms for >= {attain:.0%} of requests; "
          f"KV transfer: {transfer_note}")
    print(f"simulated {plan.evaluated} configurations (+{len(plan.relaxations)} what-ifs, +{_extra_runs(plan) - len(plan.relaxations)} "
          f"runs of the pick for its speed band and one run's spread) in {cpu_s:.1f} CPU-s "
          f"({simulated / cpu_s if cpu_s else 0:.0f} requests/CPU-s)")
    print("plan:" if plan.best else "plan: NONE within the budget meets the SLO (best attainment shown below)")
    if plan.best:
        print("  " + _row(plan.best))
    for line in _band_lines(plan, slo):
        print(line)
    print("Pareto front (replicas -> best goodput):")
    for r in plan.front:
        print(f"  {r.config.replicas:>3}  " + _row(r))
    if plan.probed is not None:
        what = "one replica fewer" if plan.best is not None and plan.best.config.replicas > 1 else "the best attempt"
        print(f"binding constraint ({what}: {plan.probed.config.label()}, attainment {plan.probed.attainment:.1%}): "
              f"{' / '.join(plan.binding) or 'none that a single 2x relaxation fixes'}")
        for x in plan.relaxations:
            print(f"  relaxed {x.constraint:<16} attainment {x.attainment:6.1%}  goodput {x.goodput:.2f} req/s")
    shown = {id(r): r for r in (*plan.front, *((plan.best,) if plan.best else ()))}
    clamped = sum(r.step_lookups_clamped for r in shown.values())
    if clamped:
        print(f"note: {clamped} step times were read below the profile's first grid point and priced at it "
              "(an over-estimate): profile smaller points to remove it")
    print("note: prefix caching, admission control and the router's stale loads are not simulated"
          + ("" if prof.serving is not None else "; nor the serving path's cost (not in the profile)"))


def _extra_runs(plan) -> int:
    """Simulations beside the grid's: the what-ifs, the speed band, one run's spread."""
    return len(plan.relaxations) + len(plan.band) + (plan.spread.draws if plan.spread is not None else 0)


def _band_lines(plan, slo) -> list[str]:
    """The pick at SPEED_BAND slower and faster steps (planner/plan.py: the speed band), and one
    run's spread (planner/plan.py `run_spread`)."""
    from cluster.planner.plan import RUN_JITTER, SPEED_BAND, STEP_JITTER  # noqa: PLC0415

    if not plan.band:
        return []
    slow, fast = plan.band
    pct = f"{SPEED_BAND:.0%}"
    lines = [f"  at {pct} slower / faster steps: attainment {slow.attainment:.1%} / {fast.attainment:.1%}  "
             f"TTFT p50 {slow.ttft.p50:.3f} / {fast.ttft.p50:.3f} s, p90 {slow.ttft.p90:.3f} / {fast.ttft.p90:.3f} s  "
             f"TPOT p50 {slow.tpot.p50 * 1e3:.1f} / {fast.tpot.p50 * 1e3:.1f} ms, p90 {slow.tpot.p90 * 1e3:.1f} / "
             f"{fast.tpot.p90 * 1e3:.1f} ms"]
    if slow.attainment < plan.attain or not slow.keeps_up:
        lines.append(f"  WARNING: with {pct} slower steps the pick misses the SLO (attainment {slow.attainment:.1%}"
                     + ("" if slow.keeps_up else ", cannot keep up") + "): it has no margin for a slower machine")
    if plan.spread is not None:
        lo, hi = plan.spread.low, plan.spread.high
        lines.append(f"  one run's spread (an 80% band: 10th-90th percentile of {plan.spread.draws} simulations with noise, "
                     f"the run's speed sigma {RUN_JITTER:.0%}, each step's {STEP_JITTER:.0%}): TTFT p50 {lo.ttft_p50:.3f}-"
                     f"{hi.ttft_p50:.3f} s, p90 {lo.ttft_p90:.3f}-{hi.ttft_p90:.3f} s  TPOT p50 {lo.tpot_p50 * 1e3:.1f}-"
                     f"{hi.tpot_p50 * 1e3:.1f} ms, p90 {lo.tpot_p90 * 1e3:.1f}-{hi.tpot_p90 * 1e3:.1f} ms")
    return lines


def _plan_json(plan, prof, specs, slo, transfer_note, cpu_s, simulated) -> dict:
    from dataclasses import asdict  # noqa: PLC0415

    def res(r):
        return None if r is None else {**asdict(r), "goodput": r.goodput, "attainment": r.attainment}

    return {"best": res(plan.best), "front": [res(r) for r in plan.front], "evaluated": plan.evaluated,
            "probed": res(plan.probed), "binding": list(plan.binding),
            "relaxations": [asdict(x) for x in plan.relaxations], "speed_band": [res(r) for r in plan.band],
            "one_run_spread": None if plan.spread is None else {"draws": plan.spread.draws, "p10": asdict(plan.spread.low),
                                                                "p90": asdict(plan.spread.high)},
            "slo": asdict(slo), "requests": len(specs),
            "transfer": transfer_note, "cpu_s": cpu_s, "requests_per_cpu_s": simulated / cpu_s if cpu_s else None,
            "profile": {"model": prof.model, "device": prof.device, "range": prof.range_text()}}


def _validation_report(v, plan, prof, specs, slo) -> tuple[list[str], dict | None]:
    """What the validation says of this plan: the MAPE per metric, whether it was made with this
    profile and covers this workload, and the plan's figures widened by it."""
    from cluster.planner.validation import LABELS, METRICS  # noqa: PLC0415

    if v is None:
        return (["validation: NONE given (--validation FILE; python -m cluster.tools.bench.plan_validation makes "
                 "one): the simulator's error on this machine is unknown"], None)
    mape = v.mape()
    configs = sorted({c.config.split(" ")[0] for c in v.cases})
    lines = [f"validation: {len(v.cases)} real runs ({', '.join(configs)} on {', '.join(w.name for w in v.workloads)}) "
             f"on {v.profile.get('device')}: MAPE " + ", ".join(f"{LABELS[m]} {mape[m]:.0f}%" for m in METRICS)]
    if len(v.workloads) > 1:
        lines.append("  by workload: " + "; ".join(
            f"{w.name} " + ", ".join(f"{LABELS[m]} {x:.0f}%" for m, x in v.mape(w.name).items()) for w in v.workloads))
    same = v.same_profile(prof.created, prof.model.get("path"))
    if not same:
        lines.append(f"  note: the validation was simulated with another profile (created {v.profile.get('created')}, "
                     f"this one {prof.created}): its errors may not carry over")
    outside = v.covers(specs)
    if outside:
        lines.append("  note: this workload lies outside what was validated (" + "; ".join(outside)
                     + "): the error figures do not cover it")
    bands = v.bands(plan.best) if plan.best is not None else {}
    if bands:
        lines.append("  the plan's figures, widened by the MAPE (the real value, were the simulation off by it): "
                     + ", ".join(_band_text(m, *bands[m]) for m in METRICS))
        if bands["ttft_p90"][2] > slo.ttft_s or bands["tpot_p90"][2] > slo.tpot_s:
            lines.append("  WARNING: the upper end of a p90 band is past the SLO: at the validated error the plan "
                         "may miss it for real")
    return lines, {"mape": mape, "cases": len(v.cases), "same_profile": same, "outside": outside,
                   "bands": {m: list(b) for m, b in bands.items()}}


def _band_text(metric: str, sim: float, lo: float, hi: float) -> str:
    from cluster.planner.validation import LABELS  # noqa: PLC0415

    if metric == "goodput":
        return f"{LABELS[metric]} {sim:.2f} ({lo:.2f}-{hi:.2f}) req/s"
    return f"{LABELS[metric]} {sim * 1e3:.0f} ({lo * 1e3:.0f}-{hi * 1e3:.0f}) ms"


def slo_sections(slo) -> dict:
    """The plan's SLO as the app config's: admission derives its bounds from the objectives exactly
    (so the app refuses only what the plan said it would miss), and telemetry.slo takes the
    smallest histogram bucket bounds at or above them (its rules read buckets; never tighter)."""
    from cluster.config import LATENCY_BUCKETS_S, TOKEN_INTERVAL_BUCKETS_S  # noqa: PLC0415

    def bucket(value: float, bounds: tuple[float, ...]) -> float:
        return next((b for b in bounds if b >= value), bounds[-1])
    return {"admission": {"ttft_objective_s": slo.ttft_s, "itl_objective_s": slo.tpot_s},
            "telemetry": {"slo": {"ttft_threshold_s": bucket(slo.ttft_s, LATENCY_BUCKETS_S),
                                  "itl_threshold_s": bucket(slo.tpot_s, TOKEN_INTERVAL_BUCKETS_S)}}}


def _emit_config(cfg, prof, slo, path: Path) -> None:
    """The plan as an app config with the SLO it was planned for, checked by AppConfig before it is written."""
    import yaml  # noqa: PLC0415

    from cluster.config.app import AppConfig  # noqa: PLC0415

    doc = {**cfg.app_doc(prof.model.get("path"), prof.block_size), **slo_sections(slo)}
    AppConfig.model_validate(doc)
    path.write_text(f"# pdserve plan: {cfg.label()} (simulated; see the plan's validation line for its error)\n"
                    + yaml.safe_dump(doc, sort_keys=False))
