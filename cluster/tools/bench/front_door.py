"""The front door alone: how fast it answers requests it refuses, with the engines idle and busy.

    python -m cluster.tools.bench.front_door [--seconds 10] [--clients 32] [--busy-streams 8]
                                             [--profile DIR] [--served [MAX_TOKENS ...] [--parts DIR]
                                             [--fresh-prompts]]

One app (demo bench model, 1 prefill + 1 decode replica, API keys on) on this machine, over gRPC.
For each refusal kind, `--clients` closed-loop callers send Generate as fast as its answers come
back for `--seconds`:
  bad_key     an unknown API key (UNAUTHENTICATED)
  over_quota  a tenant with requests_per_min 1, spent (RESOURCE_EXHAUSTED)
first with the engines idle, then while `--busy-streams` long generations keep both pools busy.
`--served [MAX_TOKENS ...]` instead: admitted requests (64-token prompt, MAX_TOKENS tokens each,
default 1 then 64) from `--clients` closed-loop callers, with the ingress's CPU per request and
per token (and the router's, the proxy's and the load generator's). `--parts DIR` splits the
ingress's CPU into the request's parts (admit, tokenize, route, prefill call, decode call, relay)
and the layers under them, from outside the process (ingress_parts.py); `--fresh-prompts` gives
every request a new prompt, which the router sends to the prefill pool.
Printed per arm: refusals/s, latency p50/p99/max, wrong answers (any other status), and the
load generator's own CPU use (cores). `--profile DIR`: py-spy records the gRPC proxy, the ingress
replica and the router actor during the busy bad_key arm (collapsed stacks and SVG in DIR) and
prints each process's top self-time frames.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np

from cluster.config import AppConfig
from cluster.tools.bench import ingress_parts

GOOD_KEY, SPENT_KEY, BAD_KEY = "sk-fd-good", "sk-fd-spent", "sk-fd-unknown"
MESSAGES = "messages a request"
IDLE_S = 4.0


def _pct(xs: list[float], p: float) -> float:
    return float(np.percentile(xs, p)) if xs else float("nan")


async def _refusals(address: str, key: str, clients: int, seconds: float) -> dict:
    import grpc

    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.GenerationStub(channel)
    md = (("authorization", f"Bearer {key}"),)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 65))), sampling=pb.SamplingParams(max_tokens=16))
    lat: list[float] = []
    codes: Counter = Counter()
    end = time.monotonic() + seconds

    async def caller():
        while time.monotonic() < end:
            t = time.perf_counter()
            try:
                async for _ in stub.Generate(req, metadata=md, timeout=60.0):
                    pass
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1
            lat.append(time.perf_counter() - t)

    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.gather(*(caller() for _ in range(clients)))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    await channel.close()
    return {"n": len(lat), "rate": len(lat) / wall, "p50_ms": _pct(lat, 50) * 1e3, "p99_ms": _pct(lat, 99) * 1e3,
            "max_ms": max(lat, default=float("nan")) * 1e3, "codes": dict(codes), "client_cores": cpu / wall}


async def _busy(address: str, streams: int, stop: asyncio.Event) -> int:
    """Keep `streams` long generations running until `stop`; returns the tokens received."""
    import grpc

    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.GenerationStub(channel)
    md = (("authorization", f"Bearer {GOOD_KEY}"),)
    tokens = 0

    async def stream(i: int):
        nonlocal tokens
        rng = np.random.default_rng(i)
        while not stop.is_set():
            ids = rng.integers(1, 200, 128).tolist()
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
                max_tokens=256, temperature=0.0, ignore_eos=True))
            call = stub.Generate(req, metadata=md)
            try:
                async for r in call:
                    tokens += len(r.token_ids)
                    if stop.is_set():
                        call.cancel()
                        break
            except grpc.aio.AioRpcError:
                pass

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    await channel.close()
    return tokens


async def _served(address: str, clients: int, seconds: float, max_tokens: int, pids: dict[str, int],
                  fresh: bool = False) -> dict:
    """`clients` closed-loop callers send admitted requests (a 64-token prompt, `max_tokens`
    greedy tokens, EOS ignored) for `seconds`: requests/s, tokens/s, and each front-door
    process's CPU (psutil, all its threads) per request and per token, with the caller's own.
    `fresh`: every request's prompt is new (nothing cached: the router sends it to the prefill
    pool), else one prompt for all (cached on decode: prefilled there)."""
    import grpc
    import psutil

    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.GenerationStub(channel)
    md = (("authorization", f"Bearer {GOOD_KEY}"),)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 65))), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    done, tokens, messages, errors = 0, 0, 0, Counter()
    end = time.monotonic() + seconds

    rng = np.random.default_rng(0)

    async def caller():
        nonlocal done, tokens, messages
        while time.monotonic() < end:
            one = req
            if fresh:  # a message of its own: gRPC serializes it later, on its own task
                one = pb.GenerateRequest(token_ids=pb.TokenIds(ids=rng.integers(1, 256, 64).tolist()),
                                         sampling=req.sampling)
            try:
                async for r in stub.Generate(one, metadata=md, timeout=60.0):
                    tokens += len(r.token_ids)
                    messages += 1
                done += 1
            except grpc.aio.AioRpcError as e:
                errors[e.code().name] += 1

    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    before = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    switched = {name: ingress_parts.switches(pid) for name, pid in pids.items()}
    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.gather(*(caller() for _ in range(clients)))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    cores = {name: (sum(p.cpu_times()[:2]) - before[name]) / wall for name, p in procs.items()}
    switched = {name: ingress_parts.switches(pid) - switched[name] for name, pid in pids.items()}
    await channel.close()
    return {"n": done, "messages": messages, "rps": done / wall, "tokens_per_s": tokens / wall,
            "messages_per_s": messages / wall,
            "errors": dict(errors), "cores": cores, "client_cores": cpu / wall, "switches": switched}


def _pids() -> dict[str, int]:
    """The front door's processes by Ray's process titles."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        for name, title in (("proxy", "ray::ProxyActor"), ("ingress", "ServeReplica:pdserve:ingress"),
                            ("router", "ray::RouterActor")):
            if title in args and name not in found:
                found[name] = int(pid)
    return found


def _profile(pids: dict[str, int], seconds: float, outdir: Path) -> list[subprocess.Popen]:
    spy = shutil.which("py-spy") or str(Path(os.sys.executable).parent / "py-spy")
    procs = []
    for name, pid in pids.items():
        for fmt, ext in (("raw", "txt"), ("flamegraph", "svg")):
            procs.append(subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                                           "--rate", "100", "--nonblocking", "--format", fmt,
                                           "-o", str(outdir / f"{name}.{ext}")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def _top_frames(path: Path, n: int = 8) -> list[tuple[str, float]]:
    """Self time by leaf frame from py-spy's collapsed stacks."""
    self_time: Counter = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        self_time[leaf] += int(count)
        total += int(count)
    return [(f, c / total) for f, c in self_time.most_common(n)] if total else []


def served_arms(address: str, args) -> None:
    """The --served arms; with --parts, the ingress's CPU split into parts (ingress_parts.py)."""
    asyncio.run(_served(address, 4, 2.0, 8, {}))  # warm-up
    pids = _pids()
    print(f"\nfront door, served: {args.clients} closed-loop callers for {args.seconds:g} s per arm "
          f"(processes: {pids})")
    if "ingress" in pids:  # what it spends with no request: not a request's cost
        before = ingress_parts.thread_cpu(pids["ingress"])
        time.sleep(IDLE_S)
        idle = sum(c for _, c in ingress_parts.cpu_between(before, ingress_parts.thread_cpu(pids["ingress"])).values())
        print(f"  idle: ingress {idle / IDLE_S:.3f} cores")
    per_request = None
    for max_tokens in args.served or [1, 64]:
        spied = None
        if args.parts is not None and "ingress" in pids:
            args.parts.mkdir(parents=True, exist_ok=True)
            raw = args.parts / f"ingress-{max_tokens}.txt"
            spied = (ingress_parts.spy(pids["ingress"], args.seconds, raw), raw,
                     ingress_parts.thread_cpu(pids["ingress"]))
        r = asyncio.run(_served(address, args.clients, args.seconds, max_tokens, pids, args.fresh_prompts))
        ing = r["cores"].get("ingress", float("nan"))
        rps = max(r["rps"], 1e-9)
        print(f"  max_tokens {max_tokens:>4}: {r['rps']:7.1f} req/s, {r['tokens_per_s']:8.1f} tokens/s "
              f"({r['messages_per_s']:.1f} messages/s); ingress {ing:.2f} cores = {ing / rps * 1e3:.2f} ms "
              f"a request; " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cores"].items()))
              + f" cores; ingress context switches {r['switches'].get('ingress', 0) / max(r['n'], 1):.1f} a request"
              + f"; load generator {r['client_cores']:.2f} cores; errors {r['errors'] or 0}", flush=True)
        if spied is not None:
            proc, raw, before = spied
            after = ingress_parts.thread_cpu(pids["ingress"])
            proc.wait(timeout=60)
            cpu = ingress_parts.cpu_between(before, after)
            ingress_parts.save(args.parts / f"threads-{max_tokens}.json", cpu, r)
            per_request = print_parts(ingress_parts.split(cpu, ingress_parts.read_samples(raw)), r, args.seconds,
                                      per_request)


def print_parts(s: "ingress_parts.Split", r: dict, seconds: float, first: dict | None) -> dict:
    """Each part's CPU a request and, past the first arm, a further message: (this arm's - the
    first's) / (its messages a request - the first's); returns ms a request by part."""
    n = max(r["n"], 1)
    ms = {p: c / n * 1e3 for p, c in s.parts.items()}
    ms[MESSAGES] = r["messages"] / n
    extra = None if first is None else ms[MESSAGES] - first[MESSAGES]
    print(f"    parts, ms of ingress CPU a request ({ms[MESSAGES]:.1f} messages a request; total "
          f"{sum(s.parts.values()) / n * 1e3:.3f}):")
    for part, v in sorted(((p, v) for p, v in ms.items() if p != MESSAGES), key=lambda kv: -kv[1]):
        line = f"      {part:<34} {v:7.3f}"
        if extra:
            line += f"   {(v - first.get(part, 0.0)) / extra:7.3f} a further message"
        print(line)
    print("    threads (cores): " + ", ".join(f"{t} {c / seconds:.2f}" for t, c in s.threads.most_common(8)))
    print("    other's top frames (ms a request): " + "; ".join(
        f"{f} {c / n * 1e3:.3f}" for f, c in s.others.most_common(10)), flush=True)
    return ms


def main() -> None:
    import ray
    import cluster.app.builder as serve_app
    from cluster.app.builder import ensure_model
    from cluster.tools.netutil import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--busy-streams", type=int, default=8)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--compute-nice", type=int, default=None, help="the pools' compute_nice (default: the config's)")
    ap.add_argument("--throughput-optimized", action="store_true",
                    help="with --direct-ingress: Serve's throughput profile (RAY_SERVE_THROUGHPUT_OPTIMIZED)")
    ap.add_argument("--direct-ingress", action="store_true", help="Serve's direct ingress: no proxy")
    ap.add_argument("--parts", type=Path, default=None, metavar="DIR",
                    help="with --served: the ingress's CPU split into parts (py-spy samples and per-thread CPU "
                         "from outside the process; raw stacks in DIR)")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="with --served: a new prompt for every request (prefilled on the prefill pool)")
    ap.add_argument("--served", type=int, nargs="*", default=None, metavar="MAX_TOKENS",
                    help="instead of refusals: admitted requests of these output lengths (default 1 64), "
                         "with the ingress's CPU per request and per token")
    args = ap.parse_args()

    grpc_port, http_port = free_port(), free_port()
    if args.direct_ingress:
        from cluster.app.builder import direct_ingress_env

        os.environ.update(direct_ingress_env(http_port, args.throughput_optimized))
    ray.init(num_cpus=8, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    nice = {} if args.compute_nice is None else {"compute_nice": args.compute_nice}
    cfg = ensure_model(default="random", config=AppConfig.model_validate({
        "http_port": http_port, "grpc_port": grpc_port,
        "prefill": {"num_cpus": 0.5, **nice}, "decode": {"num_cpus": 0.5, **nice}, "graceful_shutdown_timeout_s": 1.0,
        # served: the queue model and the pace limit off, so the arm measures served requests, not refusals
        **({"admission": {"max_queue_wait_s": "none", "target_itl_s": "none"}} if args.served is not None else {}),
        "tenants": {"good": {"api_keys": [GOOD_KEY]},
                    "spent": {"api_keys": [SPENT_KEY], "requests_per_min": 1}}}))
    serve_app.start(cfg)
    address = f"localhost:{cfg.grpc_port}"
    if args.served is not None:
        served_arms(address, args)
        serve_app.delete_app(cfg)
        ray.shutdown()
        return
    asyncio.run(_refusals(address, SPENT_KEY, 1, 0.5))  # spends the tenant's one request of the minute
    results = {}
    for engines in ("idle", "busy"):
        for kind, key in (("bad_key", BAD_KEY), ("over_quota", SPENT_KEY)):
            async def arm():
                stop = asyncio.Event()
                busy = asyncio.create_task(_busy(address, args.busy_streams, stop)) if engines == "busy" else None
                if busy is not None:
                    await asyncio.sleep(3.0)  # the streams reach their decode phase
                spies = []
                if args.profile is not None and engines == "busy" and kind == "bad_key":
                    args.profile.mkdir(parents=True, exist_ok=True)
                    spies = _profile(_pids(), args.seconds - 1, args.profile)
                r = await _refusals(address, key, args.clients, args.seconds)
                for p in spies:
                    p.wait(timeout=60)
                stop.set()
                r["busy_tokens"] = await busy if busy is not None else 0
                return r

            results[(engines, kind)] = asyncio.run(arm())
    serve_app.delete_app(cfg)
    ray.shutdown()

    print(f"\nfront door: {args.clients} closed-loop callers for {args.seconds:g} s per arm; busy = "
          f"{args.busy_streams} streams of 256 tokens")
    for (engines, kind), r in results.items():
        wrong = {c: n for c, n in r["codes"].items()
                 if c != ("UNAUTHENTICATED" if kind == "bad_key" else "RESOURCE_EXHAUSTED")}
        print(f"  {engines:<5} {kind:<10} {r['rate']:7.1f} refusals/s  p50 {r['p50_ms']:6.1f}  p99 {r['p99_ms']:7.1f}  "
              f"max {r['max_ms']:7.1f} ms  other answers {wrong or 0}  client {r['client_cores']:.2f} cores"
              + (f"  (busy streams got {r['busy_tokens']} tokens)" if engines == "busy" else ""))
    if args.profile is not None:
        for name in ("proxy", "ingress", "router"):
            path = args.profile / f"{name}.txt"
            if path.exists():
                print(f"  {name}: top self time: " + "; ".join(f"{f} {s:.0%}" for f, s in _top_frames(path)))


if __name__ == "__main__":
    main()
