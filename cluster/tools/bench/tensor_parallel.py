"""Step time at tensor_parallel_size 1 and 2 on this machine's CPU, gloo between local processes.

    python -m cluster.tools.bench.tensor_parallel [--batch 1 8] [--prompt-tokens 64] [--steps 32]

A CORRECTNESS CHECK, NOT A SPEED CLAIM. On a 2-core CPU the two ranks share the cores the one
rank had, every layer adds two all-reduces through gloo's TCP loopback and the step's inputs are
pickled and broadcast, and tp ranks run layer by layer (the one-call fused decode stack is off).
tp pays off where each rank has its own device and memory bandwidth (GPUs, NCCL); here the figure
records what the collectives and broadcast cost, and checks both arms give the same tokens.

Arms (each after a discarded warm-up request pair): tp=1 with every core (the default engine), tp=1 with one thread, tp=2 with one thread per
rank (the two ranks together use the cores tp=1 had). Per batch: the prefill step (all prompts in
one step) and the median decode step over --steps steps. The model is a random Llama of ~100M
parameters whose heads tp=2 divides (SmolLM2-135M's 9 query heads refuse tp=2), written once.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from cluster.engine.config import EngineConfig
from cluster.engine.distributed.launch import tensor_parallel_engine
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.init_model import init_model
from cluster.engine.sampling_params import SamplingParams

SHAPE = dict(layers=24, hidden=512, heads=8, kv_heads=4, intermediate=1536, vocab=49152, tie_embeddings=True,
             max_positions=2048)


def measure(engine: LLMEngine, batch: int, prompt_tokens: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", prompt_token_ids=[rng.randrange(256) for _ in range(prompt_tokens)],
                           sampling=sampling)
    tokens: dict[str, list[int]] = {}
    times = []
    while engine.has_unfinished():  # the first step computes every prompt (the budget holds them)
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
    prefill, decode = times[0], times[1:]
    return dict(prefill_ms=prefill * 1e3, decode_ms=statistics.median(decode) * 1e3, tokens=tokens)


def run_arm(model: str, tp: int, threads: int, args) -> dict[int, dict]:
    torch.set_num_threads(threads)
    config = EngineConfig(model=model, tensor_parallel_size=tp, num_blocks=256, max_num_batched_tokens=2048,
                          enable_prefix_caching=False)
    if tp == 1:
        return batches(LLMEngine(config), args)
    with tensor_parallel_engine(config, timeout_s=120, worker_threads=threads) as (engine, _):
        return batches(engine, args)


def batches(engine: LLMEngine, args) -> dict[int, dict]:
    measure(engine, 2, args.prompt_tokens, 4, seed=-1)  # warm-up: first-call costs (connections, kernels)
    return {b: measure(engine, b, args.prompt_tokens, args.steps, b) for b in args.batch}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=".bench/tp-100m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    model = Path(args.model_dir)
    if not (model / "config.json").is_file():
        init_model(model, **SHAPE)
    cores = torch.get_num_threads()
    arms = [(f"tp=1, {cores} threads", 1, cores), ("tp=1, 1 thread", 1, 1), ("tp=2, 1 thread/rank", 2, 1)]
    results = {name: run_arm(str(model), tp, threads, args) for name, tp, threads in arms}
    print("CORRECTNESS CHECK, NOT A SPEED CLAIM: tp=2 over gloo on this CPU's shared cores "
          f"({cores} threads here); see the module docstring.")
    base = results[arms[0][0]]
    print(f"{'arm':<22} {'batch':>5} {'prefill ms':>11} {'decode ms':>10} {'decode vs tp=1':>15}")
    for name, _, _ in arms:
        for b, r in results[name].items():
            print(f"{name:<22} {b:>5} {r['prefill_ms']:>11.1f} {r['decode_ms']:>10.1f} "
                  f"{r['decode_ms'] / base[b]['decode_ms']:>14.2f}x")
    same = all(results[n][b]["tokens"] == base[b]["tokens"] for n, _, _ in arms for b in args.batch)
    print(f"greedy tokens equal across arms: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
