"""What `pdserve profile` and `pdserve plan --validate` run: the calibration a plan needs, and the
plan's pick run for real.

`pdserve profile` (`profile_main`) measures, printing a line per point as it goes:
    1. the engine's step costs, in-process (cluster/planner/calibrate.py), on a replica's torch threads;
    2. CPU: how n engine processes stepping at once slow one another (`--sharing`);
    3. the serving path's own cost and the KV transfer: `python -m cluster.tools.bench.serving_probe`
       (real `pdserve up` runs; the transfer pulled with NIXL where it runs, else stated as assumed),
       run as a child process, as `pdserve bench` is, so the tools stay out of this package.
A profile made with `--engine-only` lacks 3 and is marked so (`Profile.uncalibrated`).

`pdserve plan --validate N` (`validate`): `pdserve up` of the emitted config (on free ports), `N`
replays of the plan's trace by `pdserve bench` (EOS ignored, a few warm-up requests not measured),
then the cluster stopped; predicted against measured, side by side, with the same definitions
(cluster/planner/validation.py) and the latency's trend through the trace (outcome.Trend).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from cluster.engine.distributed.ports import free_port  # below the ephemeral range: no connection takes it

PDSERVE = str(Path(sys.executable).parent / "pdserve")
WARMUP = 3


def _sharing_default(args) -> int:
    if args.sharing is not None:
        return args.sharing
    return min(4, (os.cpu_count() or 1) + 1)


def profile_main(args) -> int:
    from cluster.planner import calibrate as cal  # noqa: PLC0415 — torch, only when profiling

    model = args.model
    if model is None:
        from cluster.engine.model.demo import smollm2_135m_instruct  # noqa: PLC0415

        model = str(smollm2_135m_instruct())
    sharing = _sharing_default(args) if args.device in ("auto", "cpu") else 0
    probe_s = 0.0 if args.engine_only else 3 * (45 + args.probe_groups * args.probe_gap * 1.3) + 30
    stages = ["the engine's steps (in-process)"] + ([f"{sharing} engine processes at once (~{15 * sharing} s)"]
                                                     if sharing else [])
    if not args.engine_only:
        stages.append(f"the serving path and the KV transfer (3 real `pdserve up` runs, ~{probe_s:.0f} s)")
    print("pdserve profile: measuring " + "; ".join(stages), flush=True)

    def announce(grid_s: float) -> None:
        print(f"expected ~{grid_s + 15 * sharing + probe_s:.0f} s in all (engine steps ~{grid_s:.0f} s)", flush=True)

    try:
        prof = cal.calibrate(model, args.prefill_tokens or cal.PREFILL_TOKENS,
                             args.prefill_cached or cal.PREFILL_CACHED,
                             args.decode_batch or cal.DECODE_BATCH, args.decode_context or cal.DECODE_CONTEXT,
                             reps=args.reps, device=args.device, dtype=args.dtype, sharing=sharing,
                             threads=args.threads, announce=announce, log=lambda line: print(line, flush=True))
    except (ValueError, RuntimeError) as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 2
    prof.save(args.out)
    if not args.engine_only:
        rc = _serving_probe(args)
        if rc != 0:
            print(f"pdserve profile: the serving path's runs failed (exit {rc}); {args.out} holds the engine's "
                  "steps only (marked uncalibrated)", file=sys.stderr)
            return rc
    return _summary(args.out)


def _serving_probe(args) -> int:
    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as work:
        cmd = [sys.executable, "-m", "cluster.tools.bench.serving_probe", "--profile", args.out, "--out", args.out,
               "--groups", str(args.probe_groups), "--gap", str(args.probe_gap), "--work", work]
        return subprocess.run(cmd).returncode


def _summary(path: str) -> int:
    from cluster.planner.profile import Profile  # noqa: PLC0415

    prof = Profile.load(path)
    missing = prof.uncalibrated()
    print(f"wrote {path}: {prof.model['path']} on {prof.device['name']}; KV {prof.kv_bytes_per_token:.0f} "
          f"bytes/token; calibrated {prof.range_text()}"
          + (f"; {len(prof.sharing)} engines at once: " + ", ".join(f"{f:.2f}x" for f in prof.sharing)
             if prof.sharing else ""))
    print("calibrated for a plan: " + ("yes" if not missing else "NO, it lacks " + "; ".join(missing)))
    return 0


# ---- pdserve plan --validate N ----------------------------------------------------------------


def write_trace(path: Path, specs) -> None:
    path.write_text("".join(json.dumps({"timestamp": round(s.arrival_s * 1000.0, 3), "input_length": s.prompt_tokens,
                                        "output_length": s.output_tokens}) + "\n" for s in specs))


class Server:
    """`pdserve up --config FILE` until it prints that it serves; SIGINT to stop (it shuts down what
    it started, or leaves the Ray it joined through RAY_ADDRESS)."""

    def __init__(self, config: Path, log: Path, timeout_s: float = 300.0):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([PDSERVE, "up", "--config", str(config), "--no-dashboard"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                if "Ctrl-C to stop." in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"pdserve up did not come up in {timeout_s:g} s (its output: {log})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def bench_command(grpc_port: int, trace: Path, slo, result: Path, requests: int, seed: int) -> list[str]:
    """One replay of the trace. Each replay draws its prompts' tokens from its own `seed`: the same
    prompts again would hit the last replay's prefix cache (a chat trace's 10k prompt tokens fit in
    the pool: three replays measured TTFT p50 63 ms against 362 predicted, the simulator caching nothing)."""
    return [PDSERVE, "bench", "--address", f"localhost:{grpc_port}", "--dataset-name", "trace", "--dataset-path",
            str(trace), "--ignore-eos", "--warmup-requests", str(min(WARMUP, requests)), "--disable-tqdm",
            "--seed", str(seed),
            "--goodput", f"ttft:{slo.ttft_s * 1e3:g}", f"tpot:{slo.tpot_s * 1e3:g}", "--result-file", str(result)]


def _bench(grpc_port: int, trace: Path, slo, result: Path, requests: int, seed: int) -> dict:
    cmd = bench_command(grpc_port, trace, slo, result, requests, seed)
    print("$ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"pdserve bench exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(result.read_text())


def validate(config_doc: dict, specs, slo, runs: int, work: Path) -> list[dict]:
    """`runs` replays of `specs` against one `pdserve up` of `config_doc` on free ports: the bench
    result files."""
    import yaml  # noqa: PLC0415

    grpc_port = free_port()
    doc = {**config_doc, "grpc_port": grpc_port, "http_port": free_port()}
    (work / "validate.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    write_trace(work / "trace.jsonl", specs)
    print(f"validate: pdserve up --config {work / 'validate.yaml'}, then {runs} replay(s) of the trace", flush=True)
    t0 = time.monotonic()
    server = Server(work / "validate.yaml", work / "server.log")
    try:
        print(f"validate: serving after {time.monotonic() - t0:.0f} s", flush=True)
        return [_bench(grpc_port, work / "trace.jsonl", slo, work / f"run{i}.json", len(specs), seed=i)
                for i in range(runs)]
    finally:
        server.stop()


def side_by_side(sim, results: list[dict], slo, specs=(), resimulate=None, spread=None) -> list[str]:
    """The plan's prediction against the runs' (their median per metric), with the error in percent,
    the trend through the trace, and what the runs did not serve. `resimulate(specs, factor) ->
    SimResult` (`specs`: the trace's requests; `factor` on every step time): for a run that refused
    some, the simulator again on the requests it served, against that run: the model's own error,
    apart from the refusals (which the run's figures leave out and the simulator, serving every
    request, prices into the others' waits); and for every run, the simulator at the speed the
    run's TTFT p50 reads (`run_speed`). `spread` (plan.Spread): one run's spread, and each run's
    figures outside it named."""
    from cluster.planner.outcome import Trend  # noqa: PLC0415
    from cluster.planner.validation import LABELS, METRICS, Metrics, ape  # noqa: PLC0415

    measured = [Metrics.of_bench(r, slo) for r in results]
    real, pred = Metrics.median(measured), Metrics.of_sim(sim)
    lines = [f"validate: predicted against measured ({len(results)} run(s); measured = the median over runs)",
             f"  {'metric':<10} {'predicted':>14} {'measured':>14} {'error':>8}"]
    for m in METRICS:
        p, r = getattr(pred, m), getattr(real, m)
        text = (lambda v: f"{v:>8.3f} req/s") if m == "goodput" else (lambda v: f"{v * 1e3:>8.1f} ms   ")
        lines.append(f"  {LABELS[m]:<10} {text(p)} {text(r)} {ape(r, p):>7.1f}%"
                     + (f"   one run: {_span(m, spread)}" if spread is not None and m != "goodput" else ""))
    for i, (r, m) in enumerate(zip(results, measured)):
        ok = [s == "ok" for s in r["statuses"]]
        trend = Trend.of(r["start_times"], [lat if g else None for lat, g in zip(r["latencies"], ok)])
        failed = len(ok) - sum(ok)
        lines.append(f"  run {i + 1}: {sum(ok)}/{len(ok)} served"
                     + (f" ({failed} refused or failed: the simulator serves every request)" if failed else "")
                     + f"; load generator {'kept its schedule' if r.get('client_kept_up', True) else 'FELL BEHIND'}"
                     + (f"; {trend.text()}" if trend else "")
                     + f"; TTFT p50/p90 {m.ttft_p50 * 1e3:.0f}/{m.ttft_p90 * 1e3:.0f} ms, "
                       f"TPOT p50/p90 {m.tpot_p50 * 1e3:.1f}/{m.tpot_p90 * 1e3:.1f} ms")
        lines += [f"    {code} x{n}: {first}" for code, n, first in unserved(r)]
        if spread is not None:
            out = [f"{LABELS[k]} {getattr(m, k) * 1e3:.1f} ms ({_span(k, spread)})"
                   for k in METRICS if k != "goodput" and not spread.holds(k, getattr(m, k))]
            lines.append("    outside one run's spread: " + ", ".join(out) if out else "    within one run's spread")
        served = served_specs(r, specs) if resimulate is not None else []
        if failed and resimulate is not None:
            lines += _served_only(resimulate, served, m)
        if served:
            lines += _at_run_speed(resimulate, served, m)
    if sim.trend is not None:
        lines.append(f"  predicted: {sim.trend.text()}")
    return lines


def _span(metric: str, spread) -> str:
    return f"{getattr(spread.low, metric) * 1e3:.1f}-{getattr(spread.high, metric) * 1e3:.1f} ms"


def _served_only(resimulate, served: list, real) -> list[str]:
    """The simulator on the requests a run served (`real`: the run's metrics)."""
    from cluster.planner.validation import LABELS, METRICS, Metrics, ape  # noqa: PLC0415

    if not served:
        return ["    (not re-simulated on the served requests: the run's requests do not match the trace's)"]
    pred = Metrics.of_sim(resimulate(served, 1.0))
    return [f"    the simulator on the {len(served)} requests it served: " + ", ".join(
        f"{LABELS[m]} {getattr(pred, m) * 1e3:.1f} ms ({ape(getattr(real, m), getattr(pred, m)):.1f}%)"
        for m in METRICS if m != "goodput")]


SPEEDS = (0.7, 1.4)  # the step-time factors a run's speed is looked for between


def run_speed(resimulate, specs: list, ttft_p50_s: float, iterations: int = 12) -> float | None:
    """The factor on every step time at which the simulator's TTFT p50 on `specs` is the run's
    (bisection: TTFT grows with the factor); None: outside SPEEDS. The machine's speed moves between
    runs, and near saturation TPOT moves 5-6x as much; TTFT, the best-predicted figure, says how
    fast the machine ran, so the TPOT at that speed is the model's own error, apart from the speed."""
    lo, hi = SPEEDS
    if not resimulate(specs, lo).ttft.p50 <= ttft_p50_s <= resimulate(specs, hi).ttft.p50:
        return None
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if resimulate(specs, mid).ttft.p50 < ttft_p50_s else (lo, mid)
    return (lo + hi) / 2


def _at_run_speed(resimulate, served: list, real) -> list[str]:
    """The simulator on a run's served requests at the speed its TTFT p50 reads (`run_speed`)."""
    from cluster.planner.validation import Metrics, ape  # noqa: PLC0415

    factor = run_speed(resimulate, served, real.ttft_p50)
    if factor is None:
        return [f"    its TTFT p50 reads a speed outside steps x{SPEEDS[0]:g}-x{SPEEDS[1]:g} the profile's"]
    pred = Metrics.of_sim(resimulate(served, factor))
    return [f"    at the speed its TTFT p50 reads (every step x{factor:.2f} the profile's): the simulator's TPOT p50 "
            f"{pred.tpot_p50 * 1e3:.1f} ms ({ape(real.tpot_p50, pred.tpot_p50):.1f}%), p90 {pred.tpot_p90 * 1e3:.1f} ms "
            f"({ape(real.tpot_p90, pred.tpot_p90):.1f}%), TTFT p90 {pred.ttft_p90 * 1e3:.0f} ms "
            f"({ape(real.ttft_p90, pred.ttft_p90):.1f}%)"]


def served_specs(result: dict, specs: list) -> list:
    """The trace's requests a run served, in trace order (the bench records them in that order, the
    warm-up apart); [] when the run's prompt lengths are not the trace's."""
    statuses, lens = result["statuses"], result.get("input_lens", [])
    if len(statuses) != len(specs) or len(lens) != len(specs) or any(
            status == "ok" and n != s.prompt_tokens for s, status, n in zip(specs, statuses, lens)):
        return []
    return [s for s, status in zip(specs, statuses) if status == "ok"]


def unserved(result: dict) -> list[tuple[str, int, str]]:
    """(code, how many, the first one's message) for each code a run's unserved requests ended with:
    which refusals an operator would have to expect of the config (the simulator refuses none)."""
    seen: dict[str, list] = {}
    for status, code, error in zip(result["statuses"], result.get("error_codes", []), result.get("errors", [])):
        if status != "ok" and code:
            entry = seen.setdefault(code, [0, error or ""])
            entry[0] += 1
    return [(code, n, first[:300]) for code, (n, first) in sorted(seen.items())]
