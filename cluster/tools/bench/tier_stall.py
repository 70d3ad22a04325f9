"""What an asynchronous load is worth: running streams' token gaps while a long prefix comes back
from the KV tiers, the copy at admission (sync) against the loader thread (async).

    python -m cluster.tools.bench.tier_stall [--prefix-tokens 4096] [--streams 4] [--reps 3]
        [--disk-dir DIR]

The engine benchmark's ~50M random model (cluster/tools/bench/engine.py), float32, in process.
Per arm and repetition: a fresh prefix of `--prefix-tokens` tokens is computed, then pushed out
of the device pool into the tier by filler prompts (the host tier; with `--disk-dir`, a disk arm
whose small host tier hands it down to disk files). `--streams` requests then decode; after
WARM_STEPS steps of theirs the prefix comes back as the head of a new request (the prefix + 16
new tokens). Reported per arm: the streams' median gap between tokens before it arrived, the
largest gap from its arrival to its first token (the stall a synchronous copy adds to every
running request), its TTFT, the blocks loaded and what the copies cost per block, the time the
allocation's own evictions spent saving into the tiers (synchronous: host memory, and with a
disk tier the host tier's victims written to files), and where the
engine ran each copy (an async engine runs a copy shorter than its step at admission too:
kv_tiers.async_loads, KVCacheManager.load_inline). Arms run in alternating order (ABBA), each
engine warmed by one repetition that is not counted. This process's CPU time is printed: the
engines and the driver share it (the driver is the little Python around `step()`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.bench.engine import ensure_bench_model

BENCH_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "bench-model"
WARM_STEPS = 10  # the streams' steps before the prefix's request arrives
NEW_TOKENS = 16  # the prefix's request: the prefix, then this many new tokens


def one_rep(engine: LLMEngine, rng: random.Random, prefix_tokens: int, streams: int, vocab: int) -> dict:
    greedy1 = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefix = [rng.randrange(vocab) for _ in range(prefix_tokens)]
    engine.generate([prefix], greedy1)
    fill = engine.kv.num_blocks * engine.block_size // 3
    for _ in range(4):  # 4/3 of the pool in new blocks: every block of the prefix is evicted
        engine.generate([[rng.randrange(vocab) for _ in range(fill)]], greedy1)
    assert not engine.kv.pool.match_prefix(engine.kv.update_hashes(engine.make_request("probe", prompt_token_ids=prefix))[:1])
    tiers0 = [(t.stats.loaded, t.stats.load_s, t.stats.save_s) for t in engine.kv.tiers]
    long_sp = SamplingParams(max_tokens=engine.max_model_len - 33, temperature=0, ignore_eos=True)
    ids = [f"s{i}" for i in range(streams)]
    for rid in ids:
        engine.add_request(rid, prompt_token_ids=[rng.randrange(vocab) for _ in range(32)], sampling=long_sp)
    last: dict[str, float] = {}
    gaps_before: list[float] = []
    gaps_during: list[float] = []
    steps, added, first = 0, None, None
    while first is None or steps < 5:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == "prefix" and o.token_ids and first is None:
                first = now
                steps = 0
            elif o.request_id in last and o.token_ids:
                gap = now - last[o.request_id]
                if added is None:
                    gaps_before.append(gap)
                elif first is None:  # between the prefix's arrival and its first token
                    gaps_during.append(gap)
            if o.token_ids:
                last[o.request_id] = now
        if len(last) == streams and added is None:
            steps += 1
            if steps == WARM_STEPS:
                engine.add_request("prefix", prompt_token_ids=prefix + [rng.randrange(vocab) for _ in range(NEW_TOKENS)],
                                   sampling=greedy1)
                added = time.perf_counter()
        elif first is not None:
            steps += 1
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    loaded = sum(t.stats.loaded - b[0] for t, b in zip(engine.kv.tiers, tiers0))
    load_s = sum(t.stats.load_s - b[1] for t, b in zip(engine.kv.tiers, tiers0))
    save_s = sum(t.stats.save_s - b[2] for t, b in zip(engine.kv.tiers, tiers0))  # the allocation's evictions
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and engine.kv.num_loading == 0
    return {"itl_before": statistics.median(gaps_before), "max_gap": max(gaps_during, default=0.0),
            "ttft": first - added, "loaded": loaded, "load_s": load_s, "save_s": save_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=400, help="device pool, blocks of 16 tokens")
    ap.add_argument("--disk-dir", default=None, help="adds disk arms (a 16-block host tier over a disk tier here)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.prefix_tokens < 16 or args.streams < 1 or args.reps < 1:
        ap.error("--prefix-tokens >= 16, --streams >= 1, --reps >= 1")
    if args.prefix_tokens // 16 + 8 > args.num_blocks:
        ap.error("--num-blocks must hold the prefix and its request")
    max_len = args.prefix_tokens + 64
    model = str(ensure_bench_model(BENCH_MODEL_DIR, min_positions=max_len))
    opts = dict(num_blocks=args.num_blocks, max_model_len=max_len, block_size=16,
                max_num_batched_tokens=max(512, args.prefix_tokens // 4))
    host = {"host_blocks": args.num_blocks * 2}
    arms = {f"host {mode}": {**host, "async_loads": mode == "async"} for mode in ("sync", "async")}
    if args.disk_dir is not None:
        for mode in ("sync", "async"):
            arms[f"disk {mode}"] = {"host_blocks": 16, "disk_dir": args.disk_dir, "disk_gb": 2.0,
                                    "async_loads": mode == "async"}
    engines = {arm: LLMEngine.from_model(model, kv_tiers=t, **opts) for arm, t in arms.items()}
    vocab = next(iter(engines.values())).model_config.vocab_size
    print(f"model {model}; pool {args.num_blocks} blocks x 16 tokens; prefix {args.prefix_tokens} tokens "
          f"({args.prefix_tokens // 16} blocks); {args.streams} streams decoding; {args.reps} reps per arm")
    results: dict[str, list[dict]] = {arm: [] for arm in engines}
    names = list(engines)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for rep in range(args.reps + 1):  # rep 0 warms every engine (its first loads, its step time)
        for arm in (names if rep % 2 == 0 else names[::-1]):
            r = one_rep(engines[arm], random.Random(args.seed * 1000 + rep), args.prefix_tokens, args.streams, vocab)
            if rep:
                results[arm].append(r)
    print("| arm | stream ITL before ms | largest gap while it loads ms | prefix request TTFT ms | blocks loaded "
          "| copy us/block | saves ms (evictions, synchronous) | copies inline / on the loader thread |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, rs in results.items():
        e = engines[arm]

        def med(key: str) -> float:
            return statistics.median(r[key] for r in rs)

        per_block = sum(r["load_s"] for r in rs) / max(1, sum(r["loaded"] for r in rs))
        print(f"| {arm} | {1e3 * med('itl_before'):.1f} | {1e3 * med('max_gap'):.1f} | {1e3 * med('ttft'):.1f} | "
              f"{rs[0]['loaded']} | {1e6 * per_block:.0f} | {1e3 * med('save_s'):.1f} | "
              f"{e.kv.loads_inline} / {e.kv.loads_async} |", flush=True)
    for kind in ("host", "disk"):
        if f"{kind} sync" in results:
            s, a = results[f"{kind} sync"], results[f"{kind} async"]
            gs, ga = statistics.median(r["max_gap"] for r in s), statistics.median(r["max_gap"] for r in a)
            ts, ta = statistics.median(r["ttft"] for r in s), statistics.median(r["ttft"] for r in a)
            print(f"{kind}: largest stream gap sync / async = {gs / ga:.2f}x ({1e3 * gs:.1f} vs {1e3 * ga:.1f} ms); "
                  f"prefix TTFT sync / async = {ts / ta:.2f}x (medians of {args.reps})")
    print(f"process CPU {time.process_time() - cpu0:.1f} s over {time.perf_counter() - wall0:.1f} s wall "
          f"(engines and driver share it)")


if __name__ == "__main__":
    main()
