"""A step mixing decodes with a prompt chunk, measured, against the planner's model of it
(issue 54): `Profile.mixed_step` prices it as one prefill forward of chunk + batch rows plus the
decodes' own attention, decode(batch, context) - decode(batch, smallest context). Each term is
measured here too, in the same process, so the ratio measured / model does not depend on how fast
the machine runs today; `--profile` adds what a saved profile's curves say for the same shapes.

    flock /tmp/cpu.lock python -m cluster.tools.bench.mixed_step --profile profile.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.planner.calibrate import Calibrator
from cluster.planner.profile import Profile

BUDGET = 256  # max_num_batched_tokens: the plans' chunk


def mixed(cal: Calibrator, batch: int, context: int, chunk_index: int, reps: int) -> float:
    """Median seconds of the step computing chunk `chunk_index` of a fresh prompt beside `batch`
    decodes at `context` (imported, as decode takes a pulled prompt)."""
    eng, chunk = cal.engine, BUDGET - batch
    times = []
    for rep in range(reps + 1):
        ids = cal.import_decodes(batch, context, 64) + [cal.fresh_prompt(3 * chunk + 10, 1)]
        for _ in range(chunk_index + 1):
            t = time.perf_counter()
            eng.step()
            seconds = time.perf_counter() - t
        for rid in ids:
            eng.abort(rid)
        cal.run_out()
        if rep:  # the first is a warm-up
            times.append(seconds)
    return statistics.median(times)


def row(cal: Calibrator, profile: Profile | None, batch: int, context: int, chunk_index: int, reps: int) -> str:
    chunk = BUDGET - batch
    before = chunk_index * chunk
    measured = mixed(cal, batch, context, chunk_index, reps)
    prefill = cal.prefill(chunk + batch, before // 16 * 16)  # a cached prefix is whole blocks
    attention = max(0.0, cal.decode(batch, context) - cal.decode(batch, 128))
    model = prefill + attention
    saved = ""
    if profile is not None:
        saved = f" | the profile's mixed_step {profile.mixed_step(chunk, before + chunk / 2, batch, context) * 1e3:6.1f}"
    return (f"{batch:5d} {context:7d} {chunk_index:5d} ({chunk} after {before:4d}) | measured {measured * 1e3:6.1f} ms | "
            f"model {model * 1e3:6.1f} (prefill {prefill * 1e3:6.1f} + attention {attention * 1e3:5.1f}) | "
            f"measured / model {measured / model:.3f}{saved}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/root/.cache/pdserve/smollm2-135m-instruct")
    p.add_argument("--profile", help="a saved profile: its mixed_step for the same shapes, beside")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 12])
    p.add_argument("--context", type=int, default=600, help="the decodes' context (tokens)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the real runs' engines use 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_model(args.model, block_size=16, max_num_batched_tokens=BUDGET, max_num_seqs=64,
                                  num_blocks=1456, max_model_len=2048)
    cal = Calibrator(engine, reps=args.reps, log=lambda _: None)
    profile = Profile.load(args.profile) if args.profile else None
    print("batch context chunk")
    for batch in args.batches:
        for chunk_index in (0, 1, 2):
            print(row(cal, profile, batch, args.context, chunk_index, args.reps), flush=True)


if __name__ == "__main__":
    main()
