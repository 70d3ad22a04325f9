"""Cost of response_format: decode step time at C streams with and without a grammar, one run.

    python -m cluster.tools.bench.grammar [--model DIR] [--streams 32] [--steps 16] [--rounds 3]

Both arms run the same C chat prompts greedily on one engine (SmolLM2-135M-Instruct, the embedded
default: a real 49k vocabulary, so the mask costs what it costs in production):
  - plain:   no response_format
  - grammar: each stream with a JSON schema (an object with a free-text list), or --json-object
After every stream has its first token (prefill done), `--steps` decode steps are timed one by
one; only steps with all C streams still running count. Arms alternate for `--rounds`, and the
median step time of each arm is printed with the ratio grammar / plain. The grammar's own work in
a step (the sampler's mask: matchers advanced, bitmasks filled, unpacked and applied) is also
timed inside the grammar arm's steps, wrapped from outside, and printed as a share of that step:
on a shared machine it is the steadier figure of the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cluster.engine.chat_template import render_chat
from cluster.engine.grammar import ResponseFormat
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"},
    "notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "year", "notes"], "additionalProperties": False}
TOPICS = ["a film", "a book", "a song", "a painting", "a city", "a river", "a mountain", "a scientist"]


class MaskTimer:
    """Wraps a sampler's grammar step from outside; `spent` is the seconds inside it since reset."""

    def __init__(self, sampler):
        self.spent = 0.0
        inner = sampler._constrain

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.spent += time.perf_counter() - t
        sampler._constrain = timed


def decode_steps(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams, steps: int, tag: str,
                 timer: MaskTimer) -> list[tuple[float, float]]:
    for i, p in enumerate(prompts):
        engine.add(engine.make_request(f"{tag}-{i}", prompt_token_ids=p, sampling=sp))
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill (chunked), not timed
        started |= {o.request_id for o in engine.step() if o.token_ids}
    times = []  # (step seconds, grammar seconds in it)
    for _ in range(steps):
        timer.spent = 0.0
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if len(outs) == len(prompts) and not any(o.finished for o in outs):
            times.append((dt, timer.spent))
    for i in range(len(prompts)):
        engine.abort(f"{tag}-{i}")
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-object", action="store_true", help="json_object instead of the JSON schema")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    if args.model is None:
        from cluster.engine.model.demo import smollm2_135m_instruct
        args.model = str(smollm2_135m_instruct())
    engine = LLMEngine.from_model(args.model, num_blocks=1024, max_num_seqs=max(64, args.streams),
                                  max_model_len=512, device=args.device)
    tok = engine.tokenizer
    prompts = [tok.encode(render_chat(tok, [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} "
                                             f"(number {i}) as JSON with a title, a year and notes."}]),
                          add_special_tokens=False) for i in range(args.streams)]
    fmt = ResponseFormat("json_object") if args.json_object else engine.validator.response_format("json_schema", SCHEMA)
    max_tokens = args.steps + 2
    arms = {"plain": SamplingParams(max_tokens=max_tokens, temperature=0),
            "grammar": SamplingParams(max_tokens=max_tokens, temperature=0, response_format=fmt)}
    timer = MaskTimer(engine.runner.sampler)
    decode_steps(engine, prompts[:2], arms["grammar"], 2, "warm", timer)  # first schema build, allocations
    runs: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm, sp in arms.items():
            runs[arm] += decode_steps(engine, prompts, sp, args.steps, f"{arm}-{r}", timer)
    times = {a: [dt for dt, _ in r] for a, r in runs.items()}
    med = {a: statistics.median(t) * 1e3 for a, t in times.items()}
    mask_ms = statistics.median(g for _, g in runs["grammar"]) * 1e3
    share = statistics.median(g / dt for dt, g in runs["grammar"])
    print(f"model {args.model}  device {engine.device}  streams {args.streams}  "
          f"format {'json_object' if args.json_object else 'json_schema'}")
    for a, t in times.items():
        print(f"{a:8s} decode step median {med[a]:8.2f} ms  (mean {statistics.mean(t) * 1e3:.2f} ms, {len(t)} steps)")
    print(f"ratio grammar / plain: {med['grammar'] / med['plain']:.3f}  "
          f"(grammar cost {100 * (med['grammar'] / med['plain'] - 1):+.1f} % of the step)")
    print(f"grammar work inside a grammar step: median {mask_ms:.2f} ms, {100 * share:.1f} % of the step "
          f"({mask_ms / args.streams * 1e3:.0f} us per stream)")


if __name__ == "__main__":
    main()
