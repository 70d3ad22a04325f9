"""End-to-end serving throughput: Serve + gRPC against the in-process engine, same concurrency.

    python -m cluster.tools.bench.serving [--concurrency 1 8 32] [--output-tokens 128]

Arms, one after the other on the same machine and checkpoint (the ~50M bench model):
  in-process     EngineLoop over LLMEngine in this process (the engine alone), torch's default
                 threads (one per core)
  in-process-1t  the same with one torch thread: what a replica with num_cpus 1 runs with (Ray sets
                 OMP_NUM_THREADS from num_cpus), so the like-for-like baseline of the serve arms
  serve       pdserve on Ray Serve with one decode replica and no prefill pool, through the gRPC
              proxy (the engine plus everything the serving path adds)
  serve-pd    the same with one prefill and one decode replica (disaggregated; on one CPU machine
              both pools share the same two cores, so this arm shows the handoff's cost, not a gain)
  serve-di, serve-pd-di   the same two with Serve's direct ingress (the ingress replica is the
              server: no proxy hop)
  serve-tp, serve-pd-tp   direct ingress with Serve's throughput profile (RAY_SERVE_THROUGHPUT_OPTIMIZED)
For each concurrency C, C requests (prompt lengths uniform in [32, 512], 128 output tokens, greedy,
EOS ignored) start at once. Printed: output tokens/s and the ratio to in-process, and at C=1 the
mean inter-chunk interval of both (the difference is the latency the serving path adds per chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import time
import uuid

from cluster.tools.bench.engine import ensure_bench_model, make_prompts


def _stats(results: list[tuple[list[float], list[int]]], wall: float) -> dict:
    """`results`: per request, the arrival time of each chunk and the tokens it carried."""
    gaps = [b - a for times, _ in results for a, b in zip(times, times[1:])]
    # per token: after the first chunk, a chunk of k tokens that took g since the previous one is k
    # intervals of g / k each (merged deltas must not look like faster tokens)
    decode_time = sum(times[-1] - times[0] for times, _ in results if len(times) > 1)
    decode_tokens = sum(sum(sizes[1:]) for times, sizes in results if len(times) > 1)
    tokens = sum(sum(sizes) for _, sizes in results)
    return {"tok_s": tokens / wall, "tokens": tokens,
            "chunk_gap_ms": statistics.mean(gaps) * 1e3 if gaps else float("nan"),
            "token_gap_ms": decode_time / decode_tokens * 1e3 if decode_tokens else float("nan")}


def run_in_process(model_dir: str, prompts_by_c: dict, out_tokens: int, blocks: int, threads: int | None = None) -> dict:
    import torch

    from cluster.engine.loop import EngineLoop
    from cluster.engine.llm_engine import LLMEngine
    from cluster.engine.sampling_params import SamplingParams

    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    engine = EngineLoop(LLMEngine.from_model(model_dir, num_blocks=blocks))
    sp = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)

    async def one(p):
        times, sizes = [], []
        async for out in engine.generate(uuid.uuid4().hex, prompt_token_ids=p, sampling=sp):
            times.append(time.perf_counter())
            sizes.append(len(out.token_ids))
        return times, sizes

    async def batch(prompts):
        t = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return _stats(results, time.perf_counter() - t)

    try:
        asyncio.run(batch(make_prompts(2, seed=99)))  # warm-up
        return {c: asyncio.run(batch(prompts)) for c, prompts in prompts_by_c.items()}
    finally:
        engine.shutdown()
        torch.set_num_threads(default_threads)


def run_served(model_dir: str, prompts_by_c: dict, out_tokens: int, blocks: int, prefill_replicas: int,
               direct_ingress: bool = False, throughput_optimized: bool = False) -> dict:
    import grpc
    import ray
    from ray import serve

    import cluster.app.builder as serve_app
    from cluster.config import AppConfig
    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
    from cluster.tools.netutil import free_port

    cfg = AppConfig(model=model_dir, http_port=free_port(), grpc_port=free_port(), engine={"num_blocks": blocks},
                    prefill={"num_replicas": prefill_replicas}, graceful_shutdown_timeout_s=1.0,
                    # admission control off: C requests start at once, and a refusal is no throughput to compare
                    admission={"max_queue_wait_s": "none", "target_itl_s": "none"})
    env = serve_app.direct_ingress_env(cfg.http_port, throughput_optimized) if direct_ingress else {}
    os.environ.update(env)  # the Ray instance below (its Serve processes) reads it when they start
    ray.init(num_cpus=serve_app.cpus_needed(cfg) + 2, include_dashboard=False, log_to_driver=False)
    try:
        serve_app.start(cfg)
        channel = grpc.insecure_channel(f"localhost:{cfg.grpc_port}")
        stub = pb_grpc.GenerationStub(channel)

        def one(p):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
                max_tokens=out_tokens, temperature=0, ignore_eos=True))
            times, sizes = [], []
            for resp in stub.Generate(req, timeout=600):
                times.append(time.perf_counter())
                sizes.append(len(resp.token_ids))
            return times, sizes

        def batch(prompts):
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                t = time.perf_counter()
                results = list(pool.map(one, prompts))
                return _stats(results, time.perf_counter() - t)

        batch(make_prompts(2, seed=99))  # warm-up
        out = {c: batch(prompts) for c, prompts in prompts_by_c.items()}
        channel.close()
        return out
    finally:
        serve.shutdown()
        ray.shutdown()
        for k in env:
            os.environ.pop(k)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=".bench/llama-50m")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--arms", nargs="+", default=["in-process", "in-process-1t", "serve", "serve-pd"])
    args = ap.parse_args(argv)
    d = ensure_bench_model(args.model_dir)
    prompts_by_c = {c: make_prompts(c, seed=c) for c in args.concurrency}
    results = {}
    for arm in args.arms:
        if arm.startswith("in-process"):
            results[arm] = run_in_process(str(d), prompts_by_c, args.output_tokens, args.blocks,
                                          threads=1 if arm == "in-process-1t" else None)
        else:
            results[arm] = run_served(str(d), prompts_by_c, args.output_tokens, args.blocks,
                                      prefill_replicas=1 if arm.startswith("serve-pd") else 0,
                                      direct_ingress=arm.endswith(("-di", "-tp")),
                                      throughput_optimized=arm.endswith("-tp"))
        print(f"{arm}: " + "  ".join(f"C={c} {r['tok_s']:.1f} tok/s" for c, r in results[arm].items()), flush=True)
    bases = [a for a in results if a.startswith("in-process")]
    served = [a for a in results if not a.startswith("in-process")]
    for c in args.concurrency:
        line = f"C={c:>3}: " + "  ".join(f"{a} {results[a][c]['tok_s']:7.1f} tok/s" for a in results)
        line += "".join(f"  {a}/{b} {results[a][c]['tok_s'] / results[b][c]['tok_s']:.2f}"
                        for a in served for b in bases)
        print(line)
    if 1 in args.concurrency:
        for b in bases:
            for a in served:
                added = results[a][1]["token_gap_ms"] - results[b][1]["token_gap_ms"]
                print(f"C=1 mean interval per token: {b} {results[b][1]['token_gap_ms']:.2f} ms, "
                      f"{a} {results[a][1]['token_gap_ms']:.2f} ms -> added per token {added:+.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
