"""The KV tiers against the device pool alone, every arm in one run (in-process engines).

    python -m cluster.tools.bench.tiers [--rounds 2] [--sessions 8] [--turns 6] [--num-blocks 80]
        [--host-blocks 512] [--disk-dir DIR [--disk-host-blocks 64] [--disk-gb 1]] [--sync-arm]

The engine benchmark's ~50M random model (cluster/tools/bench/engine.py; `--model smollm2` for the
demo model, 3x the compute per token: too slow for this workload on a 2-core machine), float32,
engines with the same options but `kv_tiers` (device only: none; device+host: a host tier). Two
workloads, each run on every engine:
  - multi-turn: S sessions, each a unique system prompt, then T turns; a turn's prompt is the
    session's whole history (earlier prompts and the replies the engine produced) plus a new user
    message. C sessions are in flight at once, taken round robin, so between two turns of one
    session the others' turns pass through the pool: with the defaults the sessions' KV at the
    last turn is 3.4x the device pool. The device-only engine recomputes the history; the tiered
    one loads it back from the host tier.
  - no-reuse (control): the same prompt lengths in the same order, every prompt new tokens: the
    host tier can only cost (its saves on eviction), never help.
With `--disk-dir DIR` a third arm runs: a small host tier (`--disk-host-blocks`, 64) over a
disk tier in DIR (`--disk-gb`), so most of the sessions' history comes back from disk files.
With `--sync-arm` another arm runs the device+host engine with `async_loads: false` (the copy
back at admission, on the engine's thread, instead of on the loader thread while it steps).
The user messages and prompts come from one seed, so every arm sees the same requests (the
history holds each arm's own replies, greedy, so the same too unless batching changes a token:
"same tokens" counts the requests whose output matched).

Each workload runs `--rounds` times per arm, the arms' order alternating (ABBA); TTFTs are
pooled over the rounds. TTFT: from a request's add to the step that emits its first token (the driver steps the engine
itself, so queueing in the engine counts). Prints hit rate (prompt tokens not computed / prompt
tokens), TTFT p50/p99, output tokens/s, the ratios, the host tier's loads and saves and their cost
per block (saves are synchronous, inside the allocation that evicts; loads run on the loader
thread unless the arm is sync), and this process's CPU time
(the engines run in it: the load generator's own share is the little Python around them).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.demo import smollm2_135m_instruct
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.bench.engine import ensure_bench_model

BENCH_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "bench-model"


@dataclass
class ArmResult:
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    round_walls: list[float] = field(default_factory=list)

    def add(self, other: "ArmResult") -> None:
        self.round_walls.append(other.wall_s)
        self.ttft += other.ttft
        self.outputs += other.outputs
        for name in ("prompt_tokens", "cached_tokens", "output_tokens", "wall_s", "cpu_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass
class Workload:
    sessions: int
    turns: int
    system_tokens: int
    user_tokens: int
    out_tokens: int
    concurrency: int
    reuse: bool
    seed: int
    vocab: int


def run_arm(engine: LLMEngine, w: Workload) -> ArmResult:
    """Drive the engine with C sessions in flight; a session's next turn waits for its reply."""
    sp = SamplingParams(max_tokens=w.out_tokens, temperature=0, ignore_eos=True)
    rng = random.Random(w.seed)
    system = [[rng.randrange(w.vocab) for _ in range(w.system_tokens)] for _ in range(w.sessions)]
    users = [[[rng.randrange(w.vocab) for _ in range(w.user_tokens)] for _ in range(w.turns)]
             for _ in range(w.sessions)]
    fresh = random.Random(w.seed + 1)  # the no-reuse prompts' tokens
    history = [list(s) for s in system]
    turn = [0] * w.sessions
    busy: set[int] = set()
    inflight: dict[str, tuple[int, float, list[int]]] = {}  # rid -> session, added at, prompt
    first_seen: set[str] = set()
    outputs: dict[str, list[int]] = {}
    res = ArmResult()
    rr = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    n_done, n_total = 0, w.sessions * w.turns
    while n_done < n_total:
        for _ in range(w.sessions):  # fill the free slots, round robin over ready sessions
            if len(inflight) >= w.concurrency:
                break
            s = rr % w.sessions
            rr += 1
            if s in busy or turn[s] >= w.turns:
                continue
            prompt = history[s] + users[s][turn[s]]
            if not w.reuse:
                prompt = [fresh.randrange(w.vocab) for _ in range(len(prompt))]
            rid = f"s{s}-t{turn[s]}"
            engine.add_request(rid, prompt_token_ids=prompt, sampling=sp)
            inflight[rid] = (s, time.perf_counter(), prompt)
            busy.add(s)
        for o in engine.step():
            s, added, prompt = inflight[o.request_id]
            if o.token_ids and o.request_id not in first_seen:
                first_seen.add(o.request_id)
                res.ttft.append(time.perf_counter() - added)
            outputs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                del inflight[o.request_id]
                busy.discard(s)
                res.prompt_tokens += o.num_prompt_tokens
                res.cached_tokens += o.num_cached_tokens
                res.output_tokens += o.num_output_tokens
                history[s] = list(history[s] + users[s][turn[s]]) + outputs[o.request_id]
                turn[s] += 1
                n_done += 1
    res.wall_s, res.cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    res.outputs = [outputs[k] for k in sorted(outputs)]
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["bench", "smollm2"], default="bench")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--out-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=80, help="device pool, blocks of 16 tokens")
    ap.add_argument("--host-blocks", type=int, default=512, help="host tier of the device+host arm")
    ap.add_argument("--disk-dir", default=None, help="adds a device+host+disk arm with its disk tier here")
    ap.add_argument("--disk-host-blocks", type=int, default=64, help="host tier of the device+host+disk arm")
    ap.add_argument("--disk-gb", type=float, default=1.0, help="disk tier size of the device+host+disk arm")
    ap.add_argument("--sync-arm", action="store_true", help="adds a device+host arm whose loads run at admission")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each arm per workload, alternating order")
    args = ap.parse_args(argv)
    for name in ("sessions", "turns", "system_tokens", "user_tokens", "out_tokens", "concurrency",
                 "num_blocks", "host_blocks", "disk_host_blocks", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    model = str(smollm2_135m_instruct() if args.model == "smollm2" else ensure_bench_model(BENCH_MODEL_DIR))
    opts = dict(num_blocks=args.num_blocks, max_model_len=1024, block_size=16)
    engines = {"device": LLMEngine.from_model(model, **opts),
               "device+host": LLMEngine.from_model(model, kv_tiers={"host_blocks": args.host_blocks}, **opts)}
    if args.sync_arm:
        engines["device+host sync"] = LLMEngine.from_model(
            model, kv_tiers={"host_blocks": args.host_blocks, "async_loads": False}, **opts)
    if args.disk_dir is not None:
        engines["device+host+disk"] = LLMEngine.from_model(model, kv_tiers={
            "host_blocks": args.disk_host_blocks, "disk_dir": args.disk_dir, "disk_gb": args.disk_gb}, **opts)
    plain = engines["device"]
    vocab = plain.model_config.vocab_size
    for e in engines.values():  # warm-up, then forget its blocks
        e.generate([[1] * 100], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        e.reset_prefix_cache()

    last = args.system_tokens + args.turns * (args.user_tokens + args.out_tokens)
    ws_blocks = args.sessions * (last // 16)
    print(f"model {model}; device pool {args.num_blocks} blocks x 16 tokens "
          f"({args.num_blocks * plain.block_bytes / 2**20:.0f} MiB); "
          + "; ".join(f"{arm}: " + ", ".join(f"{t.name} {t.num_blocks} blocks" for t in e.kv.tiers)
                      for arm, e in engines.items() if e.kv.tiers)
          + f"; {args.sessions} sessions x {args.turns} turns, {args.concurrency} in flight; sessions' KV at the "
          f"last turn {ws_blocks} blocks = {ws_blocks / args.num_blocks:.1f}x the pool")
    print("| workload | arm | requests | hit rate | TTFT p50 ms | TTFT p99 ms | output tok/s | wall s | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = []
    arms = list(engines)
    for reuse in (True, False):
        w = Workload(args.sessions, args.turns, args.system_tokens, args.user_tokens, args.out_tokens,
                     args.concurrency, reuse, args.seed, vocab)
        name = "multi-turn" if reuse else "no-reuse"
        results = {arm: ArmResult() for arm in engines}
        before = {(arm, t.name): (t.stats.loaded, t.stats.stored, t.stats.load_s, t.stats.save_s)
                  for arm, e in engines.items() for t in e.kv.tiers}
        for rnd in range(args.rounds):  # ABBA...: drift on a shared machine hits every arm alike
            for arm in (arms if rnd % 2 == 0 else arms[::-1]):
                e = engines[arm]
                e.reset_prefix_cache()  # each arm starts cold, device and tiers
                results[arm].add(run_arm(e, w))
                e.check_invariants()
                assert e.kv.num_free_blocks == e.kv.num_blocks and e.kv.num_requests() == 0
        for arm, r in results.items():
            print(f"| {name} | {arm} | {len(r.ttft)} | {r.cached_tokens / r.prompt_tokens:.2f} | "
                  f"{1e3 * r.pct(0.5):.0f} | {1e3 * r.pct(0.99):.0f} | {r.output_tokens / r.wall_s:.1f} | "
                  f"{r.wall_s:.1f} | {r.cpu_s:.1f} |", flush=True)
        d = results["device"]
        for arm, e in engines.items():
            if not e.kv.tiers:
                continue
            h = results[arm]
            spent = 0.0
            parts = []
            for t in e.kv.tiers:
                b = before[(arm, t.name)]
                loaded, stored = t.stats.loaded - b[0], t.stats.stored - b[1]
                load_s, save_s = t.stats.load_s - b[2], t.stats.save_s - b[3]
                spent += load_s + save_s
                parts.append(f"{t.name} loaded {loaded} blocks ({1e6 * load_s / max(loaded, 1):.0f} us/block), "
                             f"saved {stored} ({1e6 * save_s / max(stored, 1):.0f} us/block)")
            same = sum(a == b for a, b in zip(d.outputs, h.outputs))
            summary.append(
                f"{name}, {arm}: TTFT p50 device / {arm} = {d.pct(0.5) / h.pct(0.5):.2f}x, p99 "
                f"{d.pct(0.99) / h.pct(0.99):.2f}x; throughput {arm} / device = "
                f"{(h.output_tokens / h.wall_s) / (d.output_tokens / d.wall_s):.2f}x; same tokens {same}/{len(d.outputs)}; "
                + "; ".join(parts) + f"; copies {spent / h.wall_s:.2%} of the arm's wall time; loads "
                + (f"inline {e.kv.loads_inline}, on the loader thread {e.kv.loads_async} (all rounds)"
                   if e.kv.loader.threaded else "all on the engine's thread"))
        summary.append(f"{name}: wall s per round: " + "; ".join(
            f"{arm} " + " ".join(f"{x:.1f}" for x in r.round_walls) for arm, r in results.items()))
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
