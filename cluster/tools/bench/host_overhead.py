"""The host's share of a decode step, measured on the CPU (issue 40's first deliverable).

    python -m cluster.tools.bench.host_overhead --streams 1 32 128 256 [--layers 16|30] [--steps 30]
        [--device cuda --static-decode off graphs]
    python -m cluster.tools.bench.host_overhead --static-decode eager --no-forward --streams 128 256 [--profile 25]

Runs the engine's GPU code path (attention_backend torch, model_ops torch: the ops a CUDA step
launches, not the fused CPU kernels) on a random Llama checkpoint whose compute is negligible: the
real layer count (16: Llama-3.2-1B; 30: SmolLM2-135M), hidden 64, vocabulary 512, one torch
thread. What a step then costs is what the host spends on it: per-op dispatch, the step's inputs and
metadata, sampling, outputs. A GPU cannot hide that cost; a captured step has none of it.

Per N: N requests with 32-token random prompts (greedy, EOS ignored, max_tokens large enough that
none ends) are added and prefilled, then `--warmup` decode steps run untimed and `--steps` decode
steps are timed one by one (engine.step(), wall clock). Reported: the median decode step; the step's
cost per request, (step(N) - step(1)) / N, i.e. what each request adds on top of the one-stream
step (the launches); and the process's CPU time per step (time.process_time over the timed steps:
the load generator is this same thread, so it is the engine's and the generator's together; with
one torch thread it should equal the wall time, a check that nothing else ran).

On a GPU (--device cuda) the same steps measure the host directly: the device's work is a few
microseconds a kernel, so a step's wall time is the host's (and, with --static-decode graphs, what
a captured step leaves of it: one input copy, one replay, the sampler's read, the engine's Python).

--no-forward (with --static-decode eager, on the CPU) removes the device's work from the step: the
static path's forward is replaced by a no-op that leaves fixed logits in its buffer (row i's argmax
a printable byte token, so every step detokenizes real text), so a decode step's time is the host's
alone: scheduler, block tables, staging, the sampler's read, update, outputs and detokenization.
That is what a captured step on a GPU still spends on the host. --profile N prints cProfile's top N
functions (by own time) over a second run of the timed steps.

No Ray, no router: LLMEngine directly.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.init_model import init_model
from cluster.engine.sampling_params import SamplingParams

LAYERS = {"llama-1b": 16, "smollm2": 30}


def checkpoint(cache: Path, layers: int, hidden: int, vocab: int) -> Path:
    d = cache / f"host-overhead-l{layers}-h{hidden}-v{vocab}"
    if not (d / "config.json").is_file():
        init_model(d, layers=layers, hidden=hidden, heads=4, kv_heads=2, vocab=vocab, max_positions=4096)
    return d


def make_engine(model: Path, max_seqs: int, max_len: int, device: str = "cpu", static_decode: str = "off",
                async_output: str = "auto") -> LLMEngine:
    return LLMEngine.from_model(
        str(model), device=device, dtype="float32", attention_backend="torch", model_ops="torch",
        max_num_seqs=max_seqs, max_num_batched_tokens=max(8192, 32 * max_seqs), max_model_len=max_len,
        kv_cache_memory_gb=0.5, static_decode=static_decode, async_output=async_output,
    )


def remove_forward(engine: LLMEngine) -> None:
    """The static decode step without the model: its logits buffer is filled once (row i's
    argmax is byte token 33 + i % 94, printable ASCII) and the forward leaves it as it is."""
    static = engine.runner.static
    if static is None or static.capture:
        raise ValueError("--no-forward needs --static-decode eager")
    rows = torch.arange(static._logits.shape[0])
    static._logits.zero_()
    static._logits[rows, 33 + rows % 94] = 1.0
    static._forward = lambda bucket, width: None


def measure(engine: LLMEngine, n: int, prompt_tokens: int, warmup: int, steps: int, rng: random.Random,
            profile: int = 0) -> dict:
    """Median decode step of n requests, and the CPU time per step. profile > 0: then the same
    number of steps again under cProfile, its top `profile` functions printed."""
    sp = SamplingParams(max_tokens=warmup + steps * (2 if profile else 1) + 8, temperature=0, ignore_eos=True)
    ids = [f"n{n}-{i}" for i in range(n)]
    for rid in ids:
        engine.add_request(rid, prompt_token_ids=[rng.randrange(256) for _ in range(prompt_tokens)], sampling=sp)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # the prompts (and their first tokens): only decode steps are timed
    for _ in range(warmup):
        engine.step()
    times = []
    cpu0 = time.process_time()
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        assert len(outs) == n and not any(o.finished for o in outs), "a request ended or skipped a step"
    cpu = (time.process_time() - cpu0) / steps
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            engine.step()
        prof.disable()
        print(f"cProfile, {steps} decode steps of {n} streams (own time first):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    for rid in ids:
        engine.abort(rid)
    assert not engine.has_unfinished()
    return {"streams": n, "step_ms": 1e3 * statistics.median(times), "step_min_ms": 1e3 * min(times),
            "cpu_ms_per_step": 1e3 * cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--layers", type=int, default=LAYERS["llama-1b"],
                    help="16: Llama-3.2-1B's layer count (the issue's table); 30: SmolLM2-135M's")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the issue's setup)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "pdserve-host-overhead"))
    ap.add_argument("--json", default=None, help="append the rows here (JSON lines)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the same steps with a GPU doing the ops")
    ap.add_argument("--static-decode", nargs="+", default=["off"], choices=["off", "eager", "graphs"],
                    help="one run per mode (graphs: CUDA only)")
    ap.add_argument("--no-forward", action="store_true",
                    help="static decode steps without the model (fixed logits): the step's host time alone")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="per stream count, cProfile the timed steps again and print the top N functions")
    ap.add_argument("--async-output", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                    help="the engine's async_output: one run per static_decode x value (auto: on with CUDA)")
    args = ap.parse_args(argv)
    for mode in args.static_decode:
        for async_output in args.async_output:
            run_mode(args, mode, async_output)
    return 0


def run_mode(args, mode: str, async_output: str = "auto") -> None:
    torch.set_num_threads(args.threads)
    model = checkpoint(Path(args.cache), args.layers, args.hidden, args.vocab)
    top = max(args.streams)
    steps = args.warmup + args.steps * (2 if args.profile else 1)
    engine = make_engine(model, max(top, 1), args.prompt_tokens + steps + 64, args.device, mode, async_output)
    if args.no_forward:
        remove_forward(engine)
    rng = random.Random(0)
    measure(engine, min(top, 8), args.prompt_tokens, 2, 3, rng)  # warm-up: allocator, first-call paths
    if mode == "graphs":  # every bucket the measured runs use, captured first
        for n in args.streams:
            measure(engine, n, args.prompt_tokens, args.warmup, 2, rng)
    load = os.getloadavg()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"static_decode={mode}, async_output={engine.async_output}{' (no forward: host only)' if args.no_forward else ''} on {name}: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.prompt_tokens}-token prompts, greedy; attention {engine.runner.backend.name}, ops {engine.model.ops.name}, "
          f"{torch.get_num_threads()} torch thread(s); nproc {os.cpu_count()}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    print(f"{'streams':>7} {'step p50 ms':>11} {'step min ms':>11} {'cpu ms/step':>11} {'(step-step1)/N us':>17} "
          f"{'step/N us':>9}", flush=True)
    rows, base = [], None
    for n in args.streams:
        r = measure(engine, n, args.prompt_tokens, args.warmup, args.steps, rng, args.profile)
        base = r["step_ms"] if n == 1 else base
        r["per_request_us"] = None if base is None or n == 1 else 1e3 * (r["step_ms"] - base) / n
        r["step_per_n_us"] = 1e3 * r["step_ms"] / n
        rows.append(r)
        per = "—" if r["per_request_us"] is None else f"{r['per_request_us']:.0f}"
        print(f"{n:>7} {r['step_ms']:>11.2f} {r['step_min_ms']:>11.2f} {r['cpu_ms_per_step']:>11.2f} {per:>17} "
              f"{r['step_per_n_us']:>9.0f}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab,
                                    "device": args.device, "static_decode": mode, "async_output": engine.async_output,
                                    "no_forward": args.no_forward}) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
