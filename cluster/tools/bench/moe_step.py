"""A mixture-of-experts decode step against dense steps of the same active and the same total size,
in one run (issue 49: MoE is computed as grouped work, only the experts a step routes to are read).

    python -m cluster.tools.bench.moe_step [--batches 1 32] [--steps 20]

Three random float32 checkpoints written by transformers' save_pretrained (so the engine loads them
as it loads any checkpoint), alike but for the MLP:
  - moe:          Qwen3-MoE, 32 experts of intermediate 256, top 4 (Qwen3-30B-A3B's shape, scaled down)
  - dense-active: Qwen3 with intermediate 4 x 256 (the parameters one token's MLP reads in the moe)
  - dense-total:  Qwen3 with intermediate 32 x 256 (every expert's parameters, one dense MLP)
For each batch size B: B requests of 32 prompt tokens are prefilled, then the median of --steps
decode steps (every request running) is timed per arm. Printed: each arm's step time, moe /
dense-active at batch 1 (goal <= 1.5: routing and grouping overhead where one token reads 4 of 32
experts) and moe / dense-total at the largest batch (goal <= 1.2: nearly every expert is touched).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.init_model import write_tokenizer
from cluster.engine.sampling_params import SamplingParams

COMMON = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257, tie_word_embeddings=True)
EXPERTS, TOP_K, EXPERT_I = 32, 4, 256
ARMS = {
    "moe": (Qwen3MoeConfig, dict(intermediate_size=EXPERT_I, moe_intermediate_size=EXPERT_I, num_experts=EXPERTS,
                                 num_experts_per_tok=TOP_K, norm_topk_prob=True)),
    "dense-active": (Qwen3Config, dict(intermediate_size=TOP_K * EXPERT_I)),
    "dense-total": (Qwen3Config, dict(intermediate_size=EXPERTS * EXPERT_I)),
}


def checkpoint(root: Path, arm: str) -> str:
    cls, kwargs = ARMS[arm]
    torch.manual_seed(0)
    out = root / arm
    AutoModelForCausalLM.from_config(cls(**COMMON | kwargs), dtype=torch.float32).save_pretrained(out)
    write_tokenizer(out)
    return str(out)


def decode_step_s(engine: LLMEngine, batch: int, steps: int) -> float:
    """The median decode step with `batch` requests running (their prompts prefilled first)."""
    sp = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    waiting = {f"r{i}" for i in range(batch)}
    for i in range(batch):
        engine.add_request(f"r{i}", prompt_token_ids=[256] + [(7 * i + j) % 250 for j in range(31)], sampling=sp)
    while waiting:  # prefill (chunked) until every request has its first token
        waiting -= {o.request_id for o in engine.step() if o.token_ids}
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; hidden {COMMON['hidden_size']}, "
          f"{COMMON['num_hidden_layers']} layers, {EXPERTS} experts of {EXPERT_I}, top {TOP_K}")
    results: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ARMS:
            engine = LLMEngine.from_model(checkpoint(Path(tmp), arm), num_blocks=512, max_num_seqs=max(args.batches))
            decode_step_s(engine, 1, 3)  # warm-up
            results[arm] = {b: decode_step_s(engine, b, args.steps) for b in args.batches}
            print(f"  {arm:<13} " + "  ".join(f"batch {b}: {s * 1e3:7.2f} ms" for b, s in results[arm].items()))
            del engine
    lo, hi = min(args.batches), max(args.batches)
    active = results["moe"][lo] / results["dense-active"][lo]
    total = results["moe"][hi] / results["dense-total"][hi]
    print(f"moe / dense-active at batch {lo}: {active:.2f}x (goal <= 1.5)")
    print(f"moe / dense-total at batch {hi}: {total:.2f}x (goal <= 1.2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
