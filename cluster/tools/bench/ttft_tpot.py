"""Absolute TTFT and TPOT of one engine at 1..N concurrent streams, against transformers' `generate`.

    python -m cluster.tools.bench.ttft_tpot --model smollm2-shape --device cuda --dtype bfloat16 \
        [--streams 1 8 32 128] [--prompt-tokens 512] [--output-tokens 128] [--hf] [--profile FILE]

--model is a checkpoint directory or a named random shape (SHAPES: SmolLM2-135M's, Llama-3.2-1B's),
written once under --cache. Prompts are fresh random tokens (no prefix hits), all --prompt-tokens
long; every request generates exactly --output-tokens (EOS ignored), greedy.

pdserve arm: closed loop. Each of C streams sends a request, waits for its last token and sends the
next (--rounds per stream); the engine steps in this thread. TTFT: from add to the step that returned
the first token; TPOT: (last token - first token) / (tokens - 1). Times are read after each step,
whose sampler has synced the device (the tokens are on the host).
hf arm: `generate` on one static batch of C prompts (equal lengths: no padding). TTFT: the batch's
`max_new_tokens=1` call; TPOT: (the full call - TTFT) / (tokens - 1). Each figure is the median of
--reps calls.
--profile: a torch.profiler trace of 16 decode steps at the largest C, summarised (top kernels by
device time, device busy time against the steps' wall time) into FILE.MODE, per --static-decode arm.
--static-decode off graphs: the same runs with every step built dynamically, then with decode steps
replayed as CUDA graphs (cluster/engine/static_decode.py); in graphs mode a warm-up pass at every
--streams first captures the buckets the measured runs use.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.init_model import init_model
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.bench.replay_timer import ReplayTimer

SHAPES = {
    # a rehearsal model (the script's paths on a CPU in seconds), 4 layers, hidden 64
    "tiny": dict(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, max_positions=2048),
    # SmolLM2-135M-Instruct (the embedded default), 135M parameters
    "smollm2-shape": dict(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152,
                          tie_embeddings=True, max_positions=2048),
    # Llama-3.2-1B, 1.24B parameters
    "llama-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256,
                     tie_embeddings=True, max_positions=4096),
}


def model_dir(name: str, cache: Path, dtype: str) -> Path:
    if name not in SHAPES:
        return Path(name)
    d = cache / f"{name}-{dtype}"
    if not (d / "config.json").is_file():
        init_model(d, dtype=dtype, **SHAPES[name])
    return d


def prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_pdserve(engine: LLMEngine, streams: int, rounds: int, plen: int, olen: int, rng: random.Random) -> dict:
    sp = SamplingParams(max_tokens=olen, temperature=0, ignore_eos=True)
    todo = {s: prompts(rounds, plen, rng) for s in range(streams)}
    added, first, last, count = {}, {}, {}, {}
    ttft, tpot = [], []

    def send(s: int) -> None:
        rid = f"s{s}-{len(todo[s])}"
        engine.add_request(rid, prompt_token_ids=todo[s].pop(), sampling=sp)
        added[rid] = time.perf_counter()

    t0 = time.perf_counter()
    for s in range(streams):
        send(s)
    tokens = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            rid = o.request_id
            if o.token_ids:
                first.setdefault(rid, now)
                last[rid] = now
                count[rid] = count.get(rid, 0) + len(o.token_ids)
            if o.finished:
                assert o.finish_reason == "length" and count[rid] == olen, (o.finish_reason, o.error, count.get(rid))
                tokens += count[rid]
                ttft.append(first[rid] - added[rid])
                tpot.append((last[rid] - first[rid]) / (olen - 1))
                s = int(rid[1:].split("-")[0])
                if todo[s]:
                    send(s)
    wall = time.perf_counter() - t0
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p90_ms": 1e3 * pct(ttft, 0.9),
            "tpot_p50_ms": 1e3 * statistics.median(tpot), "tpot_p90_ms": 1e3 * pct(tpot, 0.9),
            "out_tok_s": tokens / wall, "requests": len(ttft)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf(model, streams: int, plen: int, olen: int, rng: random.Random, device: str, reps: int) -> dict:
    def call(new: int) -> float:
        ids = torch.tensor(prompts(streams, plen, rng), device=device)
        _sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        _sync(device)
        assert out.shape[1] == plen + new
        return time.perf_counter() - t

    call(2)  # warm-up
    ttft = statistics.median(call(1) for _ in range(reps))
    full = statistics.median(call(olen) for _ in range(reps))
    return {"ttft_p50_ms": 1e3 * ttft, "tpot_p50_ms": 1e3 * (full - ttft) / (olen - 1),
            "out_tok_s": streams * olen / full}


def profile_decode(engine: LLMEngine, streams: int, plen: int, olen: int, rng: random.Random, path: Path,
                   device: str) -> str:
    """16 decode steps of `streams` requests under torch.profiler: top ops by device time (CPU time
    on a CPU run) and how much of the steps' wall time the device was busy."""
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(max_tokens=olen, temperature=0, ignore_eos=True)  # >= 33: 32 steps, all decodes
    for i, p in enumerate(prompts(streams, plen, rng)):
        engine.add_request(f"prof{i}", prompt_token_ids=p, sampling=sp)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # prefill everything first: only decode steps are profiled
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    static = engine.runner.static
    # CUDA events around each replay: the device's share of the unprofiled steps
    timer = ReplayTimer(static) if static is not None and static.capture else None
    _sync(device)
    t = time.perf_counter()
    with timer or contextlib.nullcontext():
        for _ in range(16):  # the same steps unprofiled first: the profiler's own cost stretches a step
            engine.step()
        _sync(device)
    plain = (time.perf_counter() - t) / 16
    replays = ""
    if timer is not None:
        replay_ms = sum(s.elapsed_time(e) for _, s, e in timer.events)
        replays = (f"; graph replays on the device {replay_ms / 16:.2f} ms/step = {replay_ms / 16 / (plain * 1e3):.0%} "
                   f"of the unprofiled step")
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(16):
            engine.step()
        _sync(device)
    wall = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    ev = prof.key_averages()
    on_device = device.startswith("cuda")
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    if on_device:  # the kernels' own time (an aten op's device time repeats its kernels')
        try:
            busy_us = sum(e.self_device_time_total for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA)
        except AttributeError:  # an older torch's event fields
            busy_us = float("nan")
    else:
        busy_us = sum(e.self_cpu_time_total for e in ev)
    try:
        table = ev.table(sort_by=key, row_limit=20)
    except (AttributeError, KeyError, ValueError):  # torch before device_time's name
        table = ev.table(sort_by=key.replace("device", "cuda"), row_limit=20)
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    summary = (f"16 decode steps x {streams} streams: unprofiled {plain * 1e3:.2f} ms/step{replays}; profiled: "
               f"wall {wall * 1e3:.1f} ms ({wall / 16 * 1e3:.2f} ms/step); "
               f"{'device busy' if on_device else 'CPU op time'} {busy_us / 1e3:.1f} ms "
               f"({busy_us / 1e6 / wall:.0%} of wall); kernel launches {launches} ({launches / 16:.0f}/step)")
    path.write_text(summary + "\n\n" + table)
    return summary


def graph_device_times(events: list, streams: int) -> str:
    """The device's time for the captured decode steps of the last run (ReplayTimer's CUDA events
    around each replay, the run's own inputs), at the run's full batch, against their wall time."""
    torch.cuda.synchronize()
    full = [s.elapsed_time(e) for n, s, e in events if n == streams]
    if not full:
        return f"no captured step of {streams} rows"
    return (f"captured decode steps of {streams} rows: {len(full)}, device time p50 {statistics.median(full):.2f} ms "
            f"(min {min(full):.2f}, max {max(full):.2f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-shape", help=f"a checkpoint dir or one of {', '.join(SHAPES)}")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "pdserve" / "bench-shapes"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream, one after another")
    ap.add_argument("--reps", type=int, default=3, help="hf arm: calls per figure (median)")
    ap.add_argument("--budget", type=int, default=8192, help="pdserve: tokens per step (chunked prefill)")
    ap.add_argument("--kv-gb", type=float, default=16.0)
    ap.add_argument("--hf", action="store_true", help="also time transformers' generate")
    ap.add_argument("--profile", default=None, help="write a torch.profiler summary here")
    ap.add_argument("--json", default=None, help="append the rows here (JSON lines)")
    ap.add_argument("--static-decode", nargs="+", default=["auto"], choices=["auto", "off", "eager", "graphs"],
                    help="the engine's static_decode, one pdserve arm each (off: every step built dynamically; "
                         "graphs: decode steps replayed as CUDA graphs)")
    ap.add_argument("--async-output", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                    help="the engine's async_output: one arm per static_decode x value (on: a decode step's "
                         "outputs are processed while the next step runs; auto: on with CUDA)")
    args = ap.parse_args(argv)

    d = model_dir(args.model, Path(args.cache), args.dtype)
    top = max(args.streams)
    rows = []
    arms = [(m, a) for m in args.static_decode for a in args.async_output]
    for mode, async_output in arms:
        engine = static = None  # the last arm's engine and its KV pool go before the next is built
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        t = time.perf_counter()
        engine = LLMEngine.from_model(str(d), device=args.device, dtype=args.dtype, kv_cache_memory_gb=args.kv_gb,
                                      max_num_seqs=max(top, 8), max_num_batched_tokens=args.budget,
                                      max_model_len=args.prompt_tokens + max(args.output_tokens, 33) + 8, static_decode=mode,
                                      async_output=async_output)
        params = sum(p.numel() for p in engine.model.parameters())
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU x{torch.get_num_threads()} threads"
        static = engine.runner.static
        path = "dynamic" if static is None else f"static {'graphs' if static.capture else 'eager'}, {static.attention}"
        arm = f"pdserve-{mode}" + ("" if async_output == "auto" else f"-async-{async_output}")
        print(f"{arm}: {args.model}: {params / 1e6:.0f}M parameters, {args.dtype}, {name}, attention "
              f"{engine.runner.backend.name}, decode steps {path}, async output {engine.async_output}; engine ready in {time.perf_counter() - t:.1f} s; "
              f"prompts {args.prompt_tokens}, outputs {args.output_tokens}", flush=True)
        rng = random.Random(0)
        t = time.perf_counter()
        run_pdserve(engine, min(top, 8), 1, args.prompt_tokens, 8, rng)  # warm-up: kernels, allocator
        if static is not None and static.capture:  # every bucket and width the measured runs reach, captured
            for c in args.streams:
                run_pdserve(engine, c, 1, args.prompt_tokens, args.output_tokens, rng)
        print(f"{arm}: warm-up {time.perf_counter() - t:.1f} s"
              + (f", {len(static._graphs)} graphs captured" if static is not None and static.capture else ""), flush=True)
        for c in args.streams:
            timer = ReplayTimer(static) if static is not None and static.capture else None
            with timer or contextlib.nullcontext():
                r = {"model": args.model, "arm": arm, "streams": c,
                     **run_pdserve(engine, c, args.rounds, args.prompt_tokens, args.output_tokens, rng)}
            rows.append(r)
            print(json.dumps(r), flush=True)
            if timer is not None:
                print(f"{arm}: {graph_device_times(timer.events, c)}; TPOT p50 {r['tpot_p50_ms']:.2f} ms", flush=True)
        if args.profile:
            print(profile_decode(engine, top, args.prompt_tokens, max(args.output_tokens, 33), rng,
                                 Path(f"{args.profile}.{arm.removeprefix('pdserve-')}"), args.device), flush=True)
    if args.hf:
        from transformers import AutoModelForCausalLM

        engine = static = None
        gc.collect()
        hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=getattr(torch, args.dtype)).to(args.device).eval()
        for c in args.streams:
            r = {"model": args.model, "arm": "hf-generate", "streams": c,
                 **run_hf(hf, c, args.prompt_tokens, args.output_tokens, rng, args.device, args.reps)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{'arm':<26} {'streams':>7} {'TTFT p50 ms':>11} {'TTFT p90':>9} {'TPOT p50 ms':>11} {'TPOT p90':>9} "
          f"{'out tok/s':>10}")
    for r in rows:
        print(f"{r['arm']:<26} {r['streams']:>7} {r['ttft_p50_ms']:>11.1f} {r.get('ttft_p90_ms', float('nan')):>9.1f} "
              f"{r['tpot_p50_ms']:>11.2f} {r.get('tpot_p90_ms', float('nan')):>9.2f} {r['out_tok_s']:>10.0f}")
    by = {(r["arm"], r["streams"]): r for r in rows}
    arms = [f"pdserve-{m}" + ("" if a == "auto" else f"-async-{a}") for m, a in arms]
    for c in args.streams:
        for a in arms:
            if ("hf-generate", c) in by:
                p, h = by[(a, c)], by[("hf-generate", c)]
                print(f"streams {c}: {a} / hf: TPOT {p['tpot_p50_ms'] / h['tpot_p50_ms']:.2f}x, "
                      f"TTFT {p['ttft_p50_ms'] / h['ttft_p50_ms']:.2f}x, throughput {p['out_tok_s'] / h['out_tok_s']:.2f}x")
        if len(arms) > 1:
            p, q = by[(arms[-1], c)], by[(arms[0], c)]
            print(f"streams {c}: {arms[-1]} / {arms[0]}: TPOT {p['tpot_p50_ms'] / q['tpot_p50_ms']:.2f}x, "
                  f"throughput {p['out_tok_s'] / q['out_tok_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
