"""Engine throughput against transformers on the same checkpoint, in one run.

    python -m cluster.tools.bench.engine [--concurrency 1 8 32] [--output-tokens 128]

For each concurrency C, C requests (prompt lengths uniform in [32, 512], 128 output tokens,
greedy, EOS ignored) are submitted at once to each arm:
  - pdserve: LLMEngine.generate (continuous batching, paged KV, chunked prefill)
  - hf-cb:   transformers `generate_batch` (its continuous batching)
  - hf:      transformers `generate` on the padded batch (left padding)
Only generation is timed (model loading and a warm-up are not). Prints output tokens/s per arm,
the ratios, and pdserve's fraction of the CPU matmul roofline: 2 * params FLOP per generated token
(params: every parameter but an untied embedding table, which is a lookup), and per prompt token
too (the issue's count), against the best fp32 matmul rate measured in the run. That count credits
the LM head's FLOP for every prompt token, which no engine computes (only the last one's logits are
needed), so a third figure counts the FLOP a step must do: the LM head for output tokens only.

The roofline is torch's 2048^3 fp32 GEMM, best of three timings of five products, taken before
the runs and again after them; the fractions are against the higher of the two (the host is shared:
a single timing moved 130-195 GFLOP/s, and a low one would flatter the engine).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.init_model import init_model
from cluster.engine.sampling_params import SamplingParams

MODEL_SHAPE = dict(layers=12, hidden=512, heads=8, kv_heads=2, intermediate=1408, vocab=32000,
                   tie_embeddings=True, max_positions=1024)


def ensure_bench_model(model_dir: str | Path, min_positions: int = 0) -> Path:
    """The ~50M benchmark checkpoint, written once; its context stretched to min_positions."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        init_model(d, **MODEL_SHAPE)
    cfg = json.loads((d / "config.json").read_text())
    if cfg["max_position_embeddings"] < min_positions:
        cfg["max_position_embeddings"] = min_positions
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def make_prompts(n: int, seed: int, lo: int = 32, hi: int = 512, vocab: int = 32000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def matmul_gflops(n: int = 2048, reps: int = 5, trials: int = 3) -> float:
    """The best of `trials` timings of `reps` n^3 fp32 products (after two to warm up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    a @ b
    best = 0.0
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t) / 1e9)
    return best


def run_pdserve(engine: LLMEngine, prompts, out_tokens: int) -> tuple[float, list[list[int]]]:
    sp = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t
    assert all(o.finish_reason == "length" for o in outs), {o.finish_reason for o in outs}
    return dt, [o.token_ids for o in outs]


def run_hf_cb(model, prompts, out_tokens: int, budget: int) -> tuple[float, list[list[int]]]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=out_tokens, do_sample=False, eos_token_id=None)
    cb = ContinuousBatchingConfig(num_blocks=4 * len(prompts) + 8, page_size=256, max_batch_tokens=budget)
    t = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    dt = time.perf_counter() - t
    return dt, [outs[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def run_hf(model, prompts, out_tokens: int) -> tuple[float, list[list[int]]]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=out_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    dt = time.perf_counter() - t
    return dt, out[:, longest:].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=".bench/llama-50m")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=1024, help="tokens per step, both continuous batchers")
    ap.add_argument("--arms", nargs="+", default=["pdserve", "hf-cb", "hf"])
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)

    d = ensure_bench_model(args.model_dir)
    engine = LLMEngine.from_model(str(d), num_blocks=4096, max_num_batched_tokens=args.budget)
    mc = engine.model_config
    head = mc.vocab_size * mc.hidden_size  # the LM head's weights
    # Weights a token multiplies by: every parameter but an untied embedding table (a lookup; the
    # norms' few are counted too, as the issue's 2 * params does).
    params = sum(p.numel() for p in engine.model.parameters()) - (0 if mc.tie_word_embeddings else head)
    hf = None
    if {"hf-cb", "hf"} & set(args.arms):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    peak = matmul_gflops()
    print(f"model: {params / 1e6:.1f}M matmul params, fp32, {torch.get_num_threads()} threads; "
          f"matmul roofline before the runs {peak:.1f} GFLOP/s (2048^3 fp32)")

    warm = make_prompts(2, seed=99)
    run_pdserve(engine, warm, 4)
    if hf is not None:
        run_hf(hf, warm, 4)

    results = []
    for c in args.concurrency:
        prompts = make_prompts(c, seed=c)
        row = {"concurrency": c, "output_tokens": c * args.output_tokens}
        ref = None
        for arm in args.arms:
            if arm == "pdserve":
                dt, toks = run_pdserve(engine, prompts, args.output_tokens)
            elif arm == "hf-cb":
                dt, toks = run_hf_cb(hf, prompts, args.output_tokens, args.budget)
            else:
                dt, toks = run_hf(hf, prompts, args.output_tokens)
            row[arm] = c * args.output_tokens / dt
            ref = ref or toks
            row[f"{arm}_matches_pdserve"] = sum(a == b for a, b in zip(toks, ref))
        if "pdserve" in row:
            row["prompt_tokens"] = sum(len(p) for p in prompts)
        results.append(row)
        line = f"C={c:>3}: " + "  ".join(f"{a} {row[a]:8.1f} tok/s" for a in args.arms if a in row)
        for a in args.arms:
            if a != "pdserve" and a in row and "pdserve" in row:
                line += f"  pdserve/{a} {row['pdserve'] / row[a]:5.2f}x"
        line += "  same tokens: " + ", ".join(
            f"{a} {row[f'{a}_matches_pdserve']}/{c}" for a in args.arms if a != "pdserve")
        print(line, flush=True)
    # This host's rate drifts (a shared machine): measured again after the runs, and the higher taken.
    peak_after = matmul_gflops()
    roof = max(peak, peak_after)
    print(f"matmul roofline {roof:.1f} GFLOP/s (before the runs {peak:.1f}, after {peak_after:.1f}; the higher)")
    for row in results:
        if "pdserve" not in row:
            continue
        # Output tokens only (the figure), and all tokens the engine computed
        # (prompt + output): the second says how close the engine is to the hardware.
        row["roofline_gflops"] = roof
        row["roofline_fraction"] = row["pdserve"] * 2 * params / (roof * 1e9)
        row["roofline_fraction_all_tokens"] = row["roofline_fraction"] * (1 + row["prompt_tokens"] / row["output_tokens"])
        row["ceiling_tok_s"] = roof * 1e9 / (2 * params * (1 + row["prompt_tokens"] / row["output_tokens"]))
        row["roofline_fraction_required"] = row["roofline_fraction"] * (
            1 + row["prompt_tokens"] * (params - head) / (row["output_tokens"] * params))
        print(f"C={row['concurrency']:>3}: roofline {100 * row['roofline_fraction']:.0f}% of output-token FLOP, "
              f"{100 * row['roofline_fraction_all_tokens']:.0f}% counting prompt tokens "
              f"(a roofline engine: {row['ceiling_tok_s']:.0f} tok/s), "
              f"{100 * row['roofline_fraction_required']:.0f}% counting prompt tokens without the LM head")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
