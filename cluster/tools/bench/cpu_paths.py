"""Which CPU path `auto` should take: the same requests through LLMEngine with plain torch, the
compiled model ops, and the paged decode attention, arms back to back in one process.

    python -m cluster.tools.bench.cpu_paths [--model-dir DIR] [--streams 1 32] [--output-tokens 64]

Prints tokens/s per arm, the ratio to torch, and whether every arm gave the same greedy tokens.
"""

from __future__ import annotations

import argparse
import random
import time

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams

ARMS = {"torch": dict(attention_backend="torch", model_ops="torch"),
        "cpu_kernels ops": dict(attention_backend="torch", model_ops="cpu_kernels"),
        "cpu_paged attention": dict(attention_backend="cpu_paged", model_ops="torch")}


def run(model: str, streams: int, output_tokens: int, **kw) -> tuple[float, list[list[int]]]:
    rng = random.Random(streams)
    engine = LLMEngine.from_model(model, num_blocks=2048, max_num_seqs=max(64, streams), **kw)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randint(32, 256))] for _ in range(streams)]
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    started = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started), [o.token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="default: SmolLM2-135M-Instruct (the demo model)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    p.add_argument("--output-tokens", type=int, default=64)
    args = p.parse_args()
    model = args.model_dir
    if model is None:
        from cluster.engine.model.demo import smollm2_135m_instruct  # noqa: PLC0415

        model = str(smollm2_135m_instruct())
    for streams in args.streams:
        res = {name: run(model, streams, args.output_tokens, **kw) for name, kw in ARMS.items()}
        base = res["torch"][0]
        arms = ", ".join(f"{name} {tps:.1f} tok/s ({tps / base:.2f}x)" for name, (tps, _) in res.items())
        same = len({str(tokens) for _, tokens in res.values()}) == 1
        print(f"{streams} streams: {arms}; same tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
