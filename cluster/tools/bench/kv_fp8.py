"""An fp8 KV pool against a bf16 one on the real SmolLM2-135M-Instruct (issue 49), in one run.

    python -m cluster.tools.bench.kv_fp8 [--prompts 32] [--tokens 64]

Arms, each an in-process engine over the same checkpoint, all prompts batched, greedy:
  - bf16:   run dtype bfloat16, KV bfloat16 (the reference)
  - fp8:    run dtype bfloat16, KV float8 e4m3 with per-layer scales calibrated at load
            (engine.kv_cache_dtype fp8; a bf16 prefill pool feeding an fp8 decode pool stores the same
            bytes, tests/kv_transfer/test_kv_convert.py)
  - fp32:   run dtype float32, KV float32: the floor, how far bf16 itself is from float32
Prompts: 16 open chat prompts and 16 paragraphs to summarise (cluster/tools/bench/spec.py's texts),
in the chat template, each prefilled in one chunk (as a prefill pool computes a prompt before decode
pulls it: over the fp8 pool a prompt attends to its own fresh K/V, every decode step to fp8 values). Printed per arm against bf16:
  - equal: the share of the prompts x tokens greedy tokens equal position by position;
  - prefix: mean tokens before a sequence's first difference;
  - |dlogprob|: mean absolute difference of the chosen token's logprob over the positions before the
    first difference (same context, same token in both arms);
  - the arm's wall time for the whole generation, and its ratio to bf16's.
"""

from __future__ import annotations

import argparse
import time

from cluster.engine.chat_template import render_chat
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.demo import smollm2_135m_instruct
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.bench.spec import OPEN_PROMPTS, PARAGRAPHS

ARMS = {"bf16": dict(dtype="bfloat16"), "fp8": dict(dtype="bfloat16", kv_cache_dtype="fp8"),
        "fp32": dict(dtype="float32")}
SUMMARY_ASKS = ["Summarise this paragraph in one sentence:\n\n{p}", "What is this paragraph about?\n\n{p}"]


def chat_prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    texts = OPEN_PROMPTS + [ask.format(p=p) for ask in SUMMARY_ASKS for p in PARAGRAPHS]
    tok = engine.tokenizer
    return [tok.encode(render_chat(tok, [{"role": "user", "content": t}]), add_special_tokens=False)
            for t in texts[:n]]


def run_arm(model: str, options: dict, prompts: list[list[int]], tokens: int) -> tuple[list, float]:
    # every prompt one chunk (the budget holds them all): as a prefill pool computes it before decode pulls it
    engine = LLMEngine.from_model(model, num_blocks=1024, max_num_seqs=len(prompts), max_num_batched_tokens=8192,
                                  **options)
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=0)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm the kernels
    engine.kv.pool.reset_cache()
    start = time.perf_counter()
    outs = engine.generate(prompts, sp)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs], time.perf_counter() - start


def compare(ref: list, got: list) -> tuple[float, float, float, int]:
    """(share of tokens equal, mean prefix before the first difference, mean |dlogprob| over those
    prefixes, positions in them)."""
    equal = total = prefix = 0
    diffs: list[float] = []
    for (rt, rl), (gt, gl) in zip(ref, got):
        equal += sum(a == b for a, b in zip(rt, gt))
        total += len(rt)
        same = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), len(rt))
        prefix += same
        diffs += [abs(a - b) for a, b in zip(rl[:same], gl[:same])]
    return equal / total, prefix / len(ref), sum(diffs) / max(1, len(diffs)), len(diffs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    model = str(smollm2_135m_instruct())
    prompts = chat_prompts(LLMEngine.from_model(model, num_blocks=16), args.prompts)
    results = {name: run_arm(model, options, prompts, args.tokens) for name, options in ARMS.items()}
    ref, ref_s = results["bf16"]
    print(f"SmolLM2-135M-Instruct, {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens) "
          f"x {args.tokens} greedy tokens, against bf16 KV (run dtype bf16)")
    print(f"{'arm':6} {'equal':>7} {'prefix':>7} {'|dlogprob|':>11} {'positions':>9} {'wall s':>7} {'x bf16':>7}")
    for name, (got, secs) in results.items():
        share, prefix, dlp, n = compare(ref, got)
        print(f"{name:6} {share:7.3f} {prefix:7.1f} {dlp:11.4f} {n:9d} {secs:7.2f} {secs / ref_s:7.2f}")


if __name__ == "__main__":
    main()
