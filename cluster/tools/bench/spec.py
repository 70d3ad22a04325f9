"""Speculative decoding (n-gram or draft-model proposer) against plain decoding, both arms in one run.

    python -m cluster.tools.bench.spec [--streams 1 8] [--max-tokens 160] [--rounds 1]
    python -m cluster.tools.bench.spec --method draft --draft-model DIR   # e.g. from cluster.tools.make_draft

The demo model (SmolLM2-135M-Instruct, float32). Three workloads:
  - copy: "repeat/rewrite this paragraph" chat prompts, where the answer quotes the prompt;
  - open: open-ended chat prompts, greedy (answers still quote the question and repeat phrases);
  - sampled: the open prompts sampled at temperature 1 (seeded): nothing to copy, drafts are
    mostly rejected, and the adaptive switch must keep speculation from costing more than it
    saves. Seeded sampling gives the same tokens with and without speculation, so both arms
    produce the same text here too.
For each workload and each stream count C, the workload's requests run through C streams: C
requests in flight, the next one added as soon as one finishes (a closed loop, like a load test's
concurrency: at 1 stream one request after another), on two engines of the same checkpoint and
options but `speculative` (n-gram or draft, k 4) in one and off in the other. The arms alternate
ABBA over the rounds. Prints output tokens/s of each arm (all output tokens over the time from the
first request's add to the last one's end), the ratio, the acceptance rate, whether both arms gave
the same tokens (greedy: they must), and the process's own CPU time (this benchmark drives the
engines in-process: its CPU use is the engines' plus its own).
"""

from __future__ import annotations

import argparse
import itertools
import time

from cluster.engine.chat_template import render_chat
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.demo import smollm2_135m_instruct
from cluster.engine.sampling_params import SamplingParams

PARAGRAPHS = [
    "The river rose slowly through the night, and by morning the lower fields were under a sheet of brown "
    "water. Farmers gathered on the ridge road to watch, counting the fence posts that still showed above "
    "the flood and guessing how long it would take the land to drain.",
    "A good cup of tea starts with fresh water brought just to the boil. Warm the pot first, add one spoon "
    "of leaves for each cup, pour the water over them and wait four minutes before you pour. Milk goes in "
    "last, never first, whatever your grandmother told you.",
    "The library opens at nine on weekdays and at ten on Saturdays. Books may be borrowed for three weeks "
    "and renewed twice online or at the front desk. Late returns cost twenty cents a day, up to the price "
    "of the book, and children's books are never fined.",
    "Our train left the station twenty minutes late because of a signal fault outside the city. The "
    "conductor apologised twice, the coffee trolley ran out of milk before it reached our carriage, and "
    "we finally arrived just as the museum was closing its doors for the evening.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until "
    "the front light turns solid green, which can take up to two minutes. If the light blinks orange, hold "
    "the reset button on the back for ten seconds and set it up again.",
    "The committee met on Tuesday to review the budget for next year. Members agreed to keep the library "
    "hours unchanged, to repair the roof of the community hall before winter, and to ask the council for "
    "a second bus stop near the school on the north side of town.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the "
    "leaves, chlorophyll absorbs sunlight and uses it to combine water and carbon dioxide into sugar, "
    "releasing oxygen into the air as a by-product of the reaction.",
    "The old lighthouse on the point was built in 1871 and kept by the same family for three generations. "
    "Its lamp was replaced by an automatic beacon in 1962, and today the tower is a small museum that "
    "opens every afternoon from May until the end of September.",
]
COPY_ASKS = ["Repeat the following paragraph exactly, word for word:\n\n{p}",
             "Rewrite this paragraph, keeping every sentence as it is:\n\n{p}"]
OPEN_PROMPTS = [
    "Write a short poem about the sea at night.", "Give me three ideas for a birthday party for a ten year old.",
    "Explain why the sky is blue in simple words.", "Write a short story about a robot who learns to paint.",
    "What are some tips for learning a new language?", "Describe a perfect autumn day in the mountains.",
    "Invent a recipe for a new kind of sandwich.", "Write a letter to a friend about a trip to Japan.",
    "How do bees make honey?", "Describe your ideal weekend in three sentences.",
    "What should I pack for a week of camping?", "Explain how a bicycle stays upright.",
    "Write a haiku about winter mornings.", "Give me some advice for a first job interview.",
    "Why do cats purr?", "Suggest a name for a small bakery and explain it.",
]


def chat_prompts(engine: LLMEngine, workload: str) -> list[list[int]]:
    tok = engine.tokenizer
    if workload == "copy":  # every paragraph under both asks, alternating
        texts = [COPY_ASKS[(i + j) % 2].format(p=p) for j in range(2) for i, p in enumerate(PARAGRAPHS)]
    else:
        texts = OPEN_PROMPTS
    return [tok.encode(render_chat(tok, [{"role": "user", "content": t}]), add_special_tokens=False)
            for t in texts]


def sampling(workload: str, max_tokens: int, n: int) -> list[SamplingParams]:
    if workload == "sampled":
        return [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i) for i in range(n)]
    return [SamplingParams(max_tokens=max_tokens, temperature=0)] * n


_ids = itertools.count()


def run(engine: LLMEngine, prompts: list[list[int]], sp: list[SamplingParams], streams: int):
    """All prompts through `streams` streams (closed loop: the next request is added as soon as one
    finishes): (seconds, output tokens, CPU seconds, token lists in prompt order)."""
    t, cpu = time.perf_counter(), time.process_time()
    pending = list(range(len(prompts)))
    live: dict[str, int] = {}
    tokens: list[list[int]] = [[] for _ in prompts]
    while pending or live:
        while pending and len(live) < streams:
            i = pending.pop(0)
            rid = f"spec-bench-{next(_ids)}"
            engine.add_request(rid, prompt_token_ids=prompts[i], sampling=sp[i])
            live[rid] = i
        for o in engine.step():
            tokens[live[o.request_id]] += o.token_ids
            if o.finished:
                del live[o.request_id]
    return time.perf_counter() - t, sum(map(len, tokens)), time.process_time() - cpu, tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=1, help="run each arm this many times (ABBA order)")
    ap.add_argument("--requests", type=int, default=16, help="requests per workload (its prompts, cycled)")
    ap.add_argument("--workloads", nargs="+", default=["copy", "open", "sampled"],
                    choices=["copy", "open", "sampled"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--draft-model", help="--method draft: the draft checkpoint (python -m cluster.tools.make_draft)")
    args = ap.parse_args(argv)
    if (args.method == "draft") != (args.draft_model is not None):
        ap.error("--draft-model goes with --method draft, and only with it")

    model = str(smollm2_135m_instruct())
    opts = dict(num_blocks=1024, max_model_len=2048)
    plain = LLMEngine.from_model(model, **opts)
    speculative = {"method": args.method, "k": args.k}
    if args.method == "draft":
        speculative["draft_model"] = args.draft_model
    spec = LLMEngine.from_model(model, speculative=speculative, **opts)
    warm = chat_prompts(plain, "open")[:1]
    plain.generate(warm, SamplingParams(max_tokens=8, temperature=0))
    spec.generate(warm, SamplingParams(max_tokens=8, temperature=0))

    what = "n-gram" if args.method == "ngram" else f"draft {args.draft_model}"
    print(f"model {model}, max_tokens {args.max_tokens}, {what} k {args.k}")
    print("| workload | streams | requests | plain tok/s | spec tok/s | spec / plain | acceptance | "
          "drafts / token | same tokens | CPU s (plain, spec) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        base = chat_prompts(plain, "copy" if workload == "copy" else "open")
        prompts = [base[i % len(base)] for i in range(args.requests)]
        params = sampling(workload, args.max_tokens, len(prompts))
        for c in args.streams:
            tp = ts = n_p = n_s = cpu_p = cpu_s = 0.0
            same = total = 0
            st0 = (spec.stats.spec_proposed_tokens, spec.stats.spec_accepted_tokens)
            for r in range(args.rounds):  # ABBA: drift hits both arms alike
                order = (plain, spec) if r % 2 == 0 else (spec, plain)
                got = {e: run(e, prompts, params, c) for e in order}
                dp, np_, cp, toks_p = got[plain]
                ds, ns, cs, toks_s = got[spec]
                tp, ts, n_p, n_s, cpu_p, cpu_s = tp + dp, ts + ds, n_p + np_, n_s + ns, cpu_p + cp, cpu_s + cs
                same += sum(a == b for a, b in zip(toks_p, toks_s))
                total += len(prompts)
            proposed = spec.stats.spec_proposed_tokens - st0[0]
            accepted = spec.stats.spec_accepted_tokens - st0[1]
            rate_p, rate_s = n_p / tp, n_s / ts
            print(f"| {workload} | {c} | {total} | {rate_p:.1f} | {rate_s:.1f} | {rate_s / rate_p:.2f}x | "
                  f"{accepted / proposed if proposed else 0:.2f} | {proposed / n_s:.2f} | {same}/{total} | "
                  f"{cpu_p:.1f}, {cpu_s:.1f} |", flush=True)
    for e in (plain, spec):
        e.check_invariants()
        assert e.kv.num_free_blocks == e.kv.num_blocks
    if args.method == "draft":
        draft = spec.speculator.proposer.kv
        draft.check_invariants()
        assert draft.num_free_blocks == draft.num_blocks
    print(f"speculation off events: {spec.stats.spec_off}; proposer time {spec.stats.spec_proposer_s:.3f} s")
    for c in args.streams:  # the adaptive switch's step costs (cluster/engine/spec/cost.py) at each batch
        table = spec.speculator.costs.table(c)
        print(f"batch {c}: decode step T(rows) = " + (", ".join(f"{r}: {_ms(t)}" for r, t in table.items()) or "-"))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


if __name__ == "__main__":
    main()
