"""Disaggregated against colocated serving on the same machine, with `pdserve bench`.

    python -m cluster.tools.bench.colocation [--requests 150] [--rate 1.0] [--out DIR]

Arms, one after the other, each a `pdserve up` of its own (a local Ray instance, stopped after):
  disaggregated  1 prefill + 1 decode replica (`mode: disaggregated`)
  colocated      2 decode replicas that prefill locally (`mode: colocated`)
Same checkpoint (the ~50M bench model, context stretched to 4096), same engine options, same
router; every engine process runs torch with one thread (OMP_NUM_THREADS=1), so each of the two
replicas of an arm has about one core.

Workload: one seeded trace, replayed by `pdserve bench --dataset-name trace` (Poisson arrivals at
`--rate`, EOS ignored): `--long-fraction` of the requests (exactly, at random positions) are long
prompts (2048-3072 tokens, 32-64 output tokens), the rest short chats (32-256 prompt tokens, 64-128
output tokens).

Printed, per arm and as ratios: p50/p99 inter-token latency of the short requests (the goal: p99
at least 3x lower disaggregated), TTFT p50/p99 (short, long, all), goodput under the TTFT and TPOT
SLOs given with --goodput, and for a few other SLO pairs. The result files, `pdserve bench
compare`'s plots and a CDF of the short requests' inter-token latency go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from cluster.tools.bench.engine import ensure_bench_model
from cluster.tools.loadgen.report import parse_goodput
from cluster.tools.netutil import free_port

LONG_PROMPT = 1024  # prompts at least this long are the "long" requests in the report
ARMS = {
    "disaggregated": {"mode": "disaggregated", "prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}},
    "colocated": {"mode": "colocated", "decode": {"num_replicas": 2}},
}


def write_trace(path: Path, n: int, rate: float, long_fraction: float, seed: int) -> None:
    """The mixed workload as a Mooncake-format trace (timestamps in ms, lengths in tokens)."""
    rng = np.random.default_rng(seed)
    long_ids = set(rng.choice(n, size=round(n * long_fraction), replace=False).tolist())  # exactly that share
    t = 0.0
    lines = []
    for i in range(n):
        t += rng.exponential(1.0 / rate)
        if i in long_ids:
            inp, out = int(rng.integers(2048, 3073)), int(rng.integers(32, 65))
        else:
            inp, out = int(rng.integers(32, 257)), int(rng.integers(64, 129))
        lines.append(json.dumps({"timestamp": round(t * 1000.0, 3), "input_length": inp, "output_length": out}))
    path.write_text("\n".join(lines) + "\n")


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {proc.returncode}")
        try:
            with grpc.insecure_channel(address) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"pdserve at {address} did not come up in {timeout_s:g} s")


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C for `pdserve up` (it shuts Serve and its own Ray down); the group is killed if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_arm(name: str, model: Path, trace: Path, args, out: Path) -> dict:
    grpc_port = free_port()
    config = {**ARMS[name], "model": str(model), "served_model_name": "bench", "grpc_port": grpc_port,
              "http_port": free_port(), "default_max_tokens": 128, "graceful_shutdown_timeout_s": 2.0,
              "engine": {"kv_cache_memory_gb": 1.0, "max_num_batched_tokens": args.max_num_batched_tokens}}
    cfg_path = out / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(out / f"{name}-server.log", "w")  # noqa: SIM115 — closed below
    server = subprocess.Popen([str(bin_dir / "pdserve"), "up", "--config", str(cfg_path), "--no-dashboard"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result_file = out / f"{name}.json"
    try:
        wait_serving(f"localhost:{grpc_port}", server)
        cmd = [str(bin_dir / "pdserve"), "bench", "--address", f"localhost:{grpc_port}", "--dataset-name", "trace",
               "--dataset-path", str(trace), "--ignore-eos", "--warmup-requests", "3", "--disable-tqdm",
               "--goodput", *args.goodput, "--label", name, "--result-file", str(result_file),
               "--duration-s", str(args.duration_s)]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=args.duration_s + 300)
    finally:
        stop(server)
        log.close()
    return json.loads(result_file.read_text())


def summary(result: dict, slo_pairs: list[tuple[float, float]]) -> dict:
    ok = [s == "ok" for s in result["statuses"]]
    long_ = [n >= LONG_PROMPT for n in result["input_lens"]]

    def pct(values, p):
        return float(np.percentile(np.asarray(values) * 1000.0, p)) if values else float("nan")

    short_itl = [g for itls, good, lg in zip(result["itls"], ok, long_) if good and not lg for g in itls]
    ttft = {k: [t for t, good, lg in zip(result["ttfts"], ok, long_) if good and sel(lg)]
            for k, sel in (("short", lambda lg: not lg), ("long", lambda lg: lg), ("all", lambda lg: True))}
    tpot = [None if lat is None or n < 2 else (lat - t) / (n - 1)
            for lat, t, n in zip(result["latencies"], result["ttfts"], result["output_lens"])]
    out = {"completed": result["completed"], "failed": result["failed"], "incomplete": result["incomplete"],
           "short": sum(1 for good, lg in zip(ok, long_) if good and not lg),
           "long": sum(1 for good, lg in zip(ok, long_) if good and lg),
           "short_itl_p50_ms": pct(short_itl, 50), "short_itl_p99_ms": pct(short_itl, 99),
           "itl_p99_ms_all": result["p99_itl_ms"], "duration_s": result["duration"],
           "output_tok_s": result["output_throughput"], "goodput": result["request_goodput"]}
    for k, values in ttft.items():
        out[f"ttft_p50_ms_{k}"], out[f"ttft_p99_ms_{k}"] = pct(values, 50), pct(values, 99)
    for ttft_slo, tpot_slo in slo_pairs:
        good = sum(1 for i, g in enumerate(ok) if g and result["ttfts"][i] * 1000 <= ttft_slo
                   and (tpot[i] or 0.0) * 1000 <= tpot_slo)
        out[f"goodput ttft:{ttft_slo:g} tpot:{tpot_slo:g}"] = good / result["duration"]
    return out


def plot_short_itl(results: dict[str, dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ok = [s == "ok" for s in r["statuses"]]
        gaps = np.sort([g * 1000 for itls, good, n in zip(r["itls"], ok, r["input_lens"])
                        if good and n < LONG_PROMPT for g in itls])
        ax.plot(gaps, np.arange(1, len(gaps) + 1) / len(gaps), label=f"{name} (p99 {np.percentile(gaps, 99):.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency of short requests (ms, log)")
    ax.set_ylabel("fraction of token gaps")
    ax.axhline(0.99, color="grey", lw=0.5, ls="--")
    ax.grid(True, which="both", lw=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--long-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=["ttft:3000", "tpot:100"], metavar="NAME:MS")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="engine token budget per step")
    p.add_argument("--duration-s", type=float, default=900.0, help="bound on each arm's measured run")
    p.add_argument("--model-dir", default=str(Path.home() / ".cache" / "pdserve" / "bench-model-4k"))
    p.add_argument("--out", default="/tmp/pdserve-bench-colocation", help="results, plots, server logs")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = ensure_bench_model(args.model_dir, min_positions=4096)
    trace = out / "mixed-trace.jsonl"
    write_trace(trace, args.requests, args.rate, args.long_fraction, args.seed)
    results = {name: run_arm(name, model, trace, args, out) for name in args.arms}

    slo = parse_goodput(args.goodput)
    slo_pairs = [(slo.get("ttft", float("inf")), slo.get("tpot", float("inf"))),
                 (1000.0, 100.0), (3000.0, 50.0), (5000.0, 200.0)]
    table = {name: summary(r, slo_pairs) for name, r in results.items()}
    print(json.dumps(table, indent=1))
    if set(results) == set(ARMS):
        d, c = table["disaggregated"], table["colocated"]
        print(f"short-request p99 ITL: colocated {c['short_itl_p99_ms']:.1f} ms / disaggregated "
              f"{d['short_itl_p99_ms']:.1f} ms = {c['short_itl_p99_ms'] / d['short_itl_p99_ms']:.2f}x")
        for k in ("short", "long", "all"):
            print(f"TTFT p50/p99 {k}: disaggregated {d[f'ttft_p50_ms_{k}']:.0f}/{d[f'ttft_p99_ms_{k}']:.0f} ms, "
                  f"colocated {c[f'ttft_p50_ms_{k}']:.0f}/{c[f'ttft_p99_ms_{k}']:.0f} ms")
        plot_short_itl(results, out / "short-itl-cdf.png")
        subprocess.run([str(Path(sys.executable).parent / "pdserve"), "bench", "compare",
                        str(out / "disaggregated.json"), str(out / "colocated.json"), "--plot-dir", str(out)],
                       check=True)
    (out / "summary.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
