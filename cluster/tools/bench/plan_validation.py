"""The planner's simulator against real runs on this machine (issue 42's validation).

    OMP_NUM_THREADS=1 pdserve profile --model DIR --out profile.json [grid]
    python -m cluster.tools.bench.plan_validation --profile profile.json \
        --configs 0P+1D 0P+2D 1P+1D --workloads chat --out DIR
    python -m cluster.tools.bench.plan_validation --merge DIR1/validation.json DIR2/validation.json --out DIR

For each workload a seeded trace (Mooncake JSONL, the load generator's format) is written; for each
configuration, one after the other:
  real       (--also: several runs, the median of each metric) `pdserve up` of the configuration (the profile's model and block size, the same engine
             options the simulator is given, admission control off as the simulator has none;
             every engine process on the torch threads the profile was measured with),
             `pdserve bench --dataset-name trace` replaying the trace (EOS ignored, 3 warm-up
             requests not measured), then the cluster stopped
  simulated  the planner's simulator on the same trace and configuration, priced by the profile
and the two reduced to TTFT p50/p90, TPOT p50/p90 and goodput (cluster/planner/validation.py).
Printed: per case real, simulated and the error; the MAPE per metric; what the load generator said
of itself (cores busy, p99 send lag, whether it kept its schedule) and the CPU each part of the
cluster used. The validation file (--out/validation.json) is what `pdserve plan --validation` reads.
Run it under the machine's CPU lock: the real arm is a timing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.profile import Profile, Transfer
from cluster.planner.simulator import simulate
from cluster.planner.validation import Case, Metrics, Validation, WorkloadRange
from cluster.planner.workload import SyntheticWorkload, read_trace
from cluster.tools.bench.colocation import stop, wait_serving
from cluster.tools.bench.processes import busiest_threads_wait, cpu_seconds, run_delays, serve_pids
from cluster.tools.netutil import free_port

WORKLOADS = {  # name: (workload, goodput SLO); short chat, and long-prompt RAG (inside a 2,048-token profile)
    "chat": ("rate=1.0,n=100,prompt=32:256,output=64:128,seed=1", "ttft=1,tpot=0.1"),
    "long": ("rate=0.25,n=30,prompt=768:1536,output=16:64,seed=2", "ttft=3,tpot=0.1"),
}


WAIT = "engine threads' wait per second on CPU"


def write_trace(path: Path, workload: SyntheticWorkload) -> None:
    lines = [json.dumps({"timestamp": round(r.arrival_s * 1000.0, 3), "input_length": r.prompt_tokens,
                         "output_length": r.output_tokens}) for r in workload.requests()]
    path.write_text("\n".join(lines) + "\n")


def _part(name: str) -> str:
    return name.split("[", 1)[0]


def start_cluster(cfg: ClusterConfig, prof: Profile, out: Path, tag: str, tries: int = 3, extra: dict | None = None):
    """`pdserve up` of the configuration, serving: (process, gRPC port). A start that exits (a free
    port taken before the ingress binds it, seen once) is tried again on new ports. `extra`: more
    top-level sections of the app config (e.g. planner, telemetry)."""
    bin_dir = Path(sys.executable).parent
    # each engine process on the torch threads the profile was measured with (a CPU profile records them)
    env = {**os.environ, "OMP_NUM_THREADS": str(prof.device.get("threads", 1))}
    for attempt in range(1, tries + 1):
        grpc_port = free_port()
        doc = {**cfg.app_doc(prof.model["path"], prof.block_size), "served_model_name": "bench",
               "grpc_port": grpc_port, "http_port": free_port(), "default_max_tokens": 128,
               "graceful_shutdown_timeout_s": 2.0,
               # admission control off: the simulator has none, and a refused request is no latency to compare
               "admission": {"max_queue_wait_s": "none", "target_itl_s": "none"}, **(extra or {})}
        (out / f"{tag}.yaml").write_text(yaml.safe_dump(doc))
        with open(out / f"{tag}-server.log", "a") as log:
            server = subprocess.Popen([str(bin_dir / "pdserve"), "up", "--config", str(out / f"{tag}.yaml"),
                                       "--no-dashboard"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            wait_serving(f"localhost:{grpc_port}", server)
            return server, grpc_port
        except RuntimeError as e:
            stop(server)
            if attempt == tries:
                raise
            print(f"{tag}: {e} (see {tag}-server.log); starting again", flush=True)
        except BaseException:
            stop(server)
            raise
    raise AssertionError("unreachable")


def run_real(cfg: ClusterConfig, prof: Profile, trace: Path, slo: SLO, out: Path, tag: str,
             extra: dict | None = None, before_stop=None) -> tuple[dict, dict]:
    """The bench result and the CPU seconds per part of the machine over the measured run.
    `before_stop()`: called while the cluster still runs, after the load (e.g. to read its logs)."""
    import psutil  # noqa: PLC0415

    result_file = out / f"{tag}.json"
    server, grpc_port = start_cluster(cfg, prof, out, tag, extra=extra)
    try:
        cmd = [str(Path(sys.executable).parent / "pdserve"), "bench", "--address", f"localhost:{grpc_port}",
               "--dataset-name", "trace", "--dataset-path", str(trace), "--ignore-eos", "--warmup-requests", "3",
               "--disable-tqdm", "--goodput", f"ttft:{slo.ttft_s * 1e3:g}", f"tpot:{slo.tpot_s * 1e3:g}",
               "--label", tag, "--result-file", str(result_file), "--duration-s", "900"]
        print("$", " ".join(cmd), flush=True)
        pids = serve_pids()
        cpu0, sys0, sched0 = cpu_seconds(pids), psutil.cpu_times(), run_delays(pids)
        subprocess.run(cmd, check=True, timeout=1200, stdout=subprocess.DEVNULL)
        cpu1, sys1, sched1 = cpu_seconds(pids), psutil.cpu_times(), run_delays(pids)
        if before_stop is not None:
            before_stop()
    finally:
        stop(server)
    result = json.loads(result_file.read_text())
    cpu: dict[str, float] = {}
    for name, t in cpu1.items():  # includes the warm-up's few seconds: a slight over-count
        cpu[_part(name)] = cpu.get(_part(name), 0.0) + t - cpu0.get(name, t)
    cpu["load generator"] = result["client_cpu_cores"] * result["duration"]
    busy = lambda t: t.user + t.nice + t.system + t.irq + t.softirq  # noqa: E731
    cpu["machine (all processes)"] = busy(sys1) - busy(sys0)
    # each engine replica's step thread: seconds on a CPU, and runnable but waiting for one (the
    # profile times a step alone, on a core of its own: what sharing the machine adds)
    on = wait = 0.0
    for name, (t_on, t_wait) in busiest_threads_wait(sched0, sched1).items():
        cpu[f"{_part(name)} engine thread on CPU"] = cpu.get(f"{_part(name)} engine thread on CPU", 0.0) + t_on
        cpu[f"{_part(name)} engine thread waiting for a CPU"] = (
            cpu.get(f"{_part(name)} engine thread waiting for a CPU", 0.0) + t_wait)
        on, wait = on + t_on, wait + t_wait
    if on > 0:
        cpu["engine threads' wait per second on CPU"] = wait / on
    return result, {k: round(v, 3) for k, v in cpu.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", help="a `pdserve profile` file made on this machine (required but with --merge)")
    p.add_argument("--configs", nargs="+", default=["0P+1D", "0P+2D", "1P+1D"],
                   help="NP+MD[:chunk=T,skip=T] (0P: colocated)")
    p.add_argument("--workloads", nargs="+", default=["chat"], help=f"names ({', '.join(WORKLOADS)}) or "
                   "NAME=rate=R,n=N,prompt=LO:HI,output=LO:HI[,seed=S]")
    p.add_argument("--slo", help="for goodput: ttft=SECONDS,tpot=SECONDS (default: the named workload's; "
                   f"{', '.join(f'{k} {v[1]}' for k, v in WORKLOADS.items())})")
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens unless a config says")
    p.add_argument("--skip-prefill", type=int, default=64, help="routing.local_prefill_threshold (the default)")
    p.add_argument("--kv-gb", type=float, default=1.0, help="KV pool per replica, as num_blocks")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--transfer-gbps", type=float, default=None, help="simulated KV transfer (default: free)")
    p.add_argument("--cores", type=float, default=None,
                   help="simulate the engines sharing this many cores (this machine's runs: its CPU count); "
                        "default: a device per replica, no sharing")
    p.add_argument("--sim-only", action="store_true", help="reuse the real results already in --out")
    p.add_argument("--also", nargs="+", default=[], metavar="DIR",
                   help="with --sim-only: more directories holding real runs of the same cases (the same "
                        "trace, checked); each case's real figures are then the median over all its runs")
    p.add_argument("--merge", nargs="+", metavar="FILE", help="no runs: merge these validation files into "
                   "--out/validation.json (e.g. two workloads run with different configurations)")
    p.add_argument("--out", default="/tmp/pdserve-plan-validation")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        v = Validation.merged([Validation.load(f) for f in args.merge])
        v.save(out / "validation.json")
        print("\n".join(v.table()))
        print(f"wrote {out / 'validation.json'}")
        return 0
    if not args.profile:
        p.error("--profile is required (but with --merge)")
    prof = Profile.load(args.profile)
    base = ClusterConfig(0, 1, args.chunk, args.skip_prefill, int(args.kv_gb * 2**30 // prof.engine["kv_block_bytes"]),
                         args.max_num_seqs, args.cores)
    transfer = None if args.transfer_gbps is None else Transfer(0.0, args.transfer_gbps * 1e9, measured=False)
    cases, ranges = [], []
    for w in args.workloads:
        name, _, spec = w.partition("=")
        workload = SyntheticWorkload.parse(spec or WORKLOADS[name][0])
        slo = SLO.parse(args.slo or (WORKLOADS[name][1] if name in WORKLOADS else "ttft=1,tpot=0.1"))
        trace = out / f"{name}-trace.jsonl"
        write_trace(trace, workload)
        specs = read_trace(trace)
        ranges.append(WorkloadRange.of(name, specs))
        for text in args.configs:
            cfg = ClusterConfig.parse(text, base)
            tag = f"{name}-{text.replace('+', '').replace(':', '-').replace(',', '-').replace('=', '')}"
            runs: list[Metrics] = []
            if args.sim_only:
                result, cpu = json.loads((out / f"{tag}.json").read_text()), json.loads(
                    (out / f"{tag}-cpu.json").read_text())
                for d in [out, *map(Path, args.also)]:
                    if d != out and (d / f"{name}-trace.jsonl").read_text() != trace.read_text():
                        raise SystemExit(f"{d}: its {name} trace is not this one")
                    if (d / f"{tag}.json").exists():
                        r = json.loads((d / f"{tag}.json").read_text())
                        runs.append(Metrics.of_bench(r, slo))
                        client_ok = r["client_kept_up"] and result["client_kept_up"]
                        result = {**result, "client_kept_up": client_ok}
            else:
                t = time.monotonic()
                result, cpu = run_real(cfg, prof, trace, slo, out, tag)
                (out / f"{tag}-cpu.json").write_text(json.dumps(cpu))
                print(f"{tag}: real run done in {time.monotonic() - t:.0f} s", flush=True)
            sim = simulate(prof, cfg, specs, slo, transfer=transfer)
            client = {k: result[k] for k in ("client_cpu_cores", "client_send_lag_p99_ms", "client_loop_lag_p99_ms",
                                             "client_kept_up", "duration")}
            real = Metrics.median(runs) if len(runs) > 1 else Metrics.of_bench(result, slo)
            cases.append(Case(cfg.label(), name, slo, real, Metrics.of_sim(sim), result["completed"], len(specs),
                              client, cpu, tuple(runs) if len(runs) > 1 else ()))
    v = Validation(tuple(cases), tuple(ranges),
                   {"path": prof.model.get("path"), "device": prof.device.get("name"), "created": prof.created},
                   datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    v.save(out / "validation.json")
    print("\n".join(v.table()))
    for c in cases:
        d = c.client["duration"]
        print(f"{c.config} {c.workload}: {c.completed}/{c.requests} completed; load generator "
              f"{c.client['client_cpu_cores']:.2f} cores, p99 send lag {c.client['client_send_lag_p99_ms']:.1f} ms, "
              f"loop lag {c.client['client_loop_lag_p99_ms']:.1f} ms, "
              f"{'kept its schedule' if c.client['client_kept_up'] else 'FELL BEHIND'}; cores busy over "
              f"{d:.0f} s: " + ", ".join(f"{k} {v / d:.2f}" for k, v in c.cpu.items() if "per second" not in k)
              + (f"; the engine threads waited {c.cpu[WAIT]:.2f} s for a CPU per second on one" if WAIT in c.cpu
                 else ""))
    print(f"wrote {out / 'validation.json'} (pdserve plan --validation {out / 'validation.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
