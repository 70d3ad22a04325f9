"""What the guardrail's built-in rules cost a stream, beyond their hold-back window.

    python -m cluster.tools.bench.guardrails [--streams 16] [--requests 64] [--rounds 2] [--window 64]

One server (--model: SmolLM2-135M-Instruct, whose text is text, or the random demo model, whose
"text" is byte noise at under one character a token; 1 prefill + 1 decode replica), two tenants:
"plain" (no policy) and "guarded" (a policy of 200 random words and 4 bounded regexes on input and
output; a request they flag is counted and left out of the figures). Arms alternate in rounds (plain,
guarded, plain, guarded...), each a closed loop of --streams concurrent gRPC streams over the same
prompts (random token ids, greedy, EOS ignored: both arms produce the same text).

The guarded arm's first token is held until --window characters follow it. That delay is the
window's, not the checks': it is measured on the plain arm's own streams (when the text had grown
`window` characters past the first message: "TTFT + window") and reported separately. The
checks' cost is then guarded TTFT p50 / (plain TTFT + window) p50, and ITL p50 guarded / plain
(deltas released together go out as one message, so the window's text at the end is one gap).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np

from cluster.config import AppConfig

KEYS = {"plain": "sk-bench-plain", "guarded": "sk-bench-guarded"}
REGEXES = [r"\d{3}-\d{2}-\d{4}", r"\d{4}[ -]\d{4}[ -]\d{4}[ -]\d{4}",
           r"[A-Za-z0-9._%+-]{1,20}@[A-Za-z0-9.-]{1,20}\.[A-Za-z]{2,6}", r"(?i)ignore (all|any) previous instructions"]


def _words(n: int) -> list[str]:
    rng = np.random.default_rng(7)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return sorted({"".join(rng.choice(letters, int(rng.integers(5, 12)))) for _ in range(n)})


def policy(window: int) -> dict:
    rules = [{"name": "words", "words": _words(200)}]
    rules += [{"name": f"regex{i}", "pattern": p} for i, p in enumerate(REGEXES)]
    return {"rules": rules, "holdback_chars": window}


async def _one(stub, pb, key: str, ids: list[int], max_tokens: int) -> dict:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    sent = time.perf_counter()
    msgs = []  # (time, text) of token-carrying messages
    async for resp in stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),)):
        if resp.token_ids:
            msgs.append((time.perf_counter(), resp.text))
        last = resp
    return {"sent": sent, "msgs": msgs, "tokens": last.usage.completion_tokens,
            "flagged": last.finish_reason == pb.FINISH_REASON_CONTENT_FILTER}


async def _phase(address: str, key: str, prompts: list[list[int]], streams: int, max_tokens: int) -> list[dict]:
    import grpc

    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        queue = list(reversed(prompts))
        out: list[dict] = []

        async def worker():
            while queue:
                out.append(await _one(stub, pb, key, queue.pop(), max_tokens))

        await asyncio.gather(*(worker() for _ in range(streams)))
    return out


def _stats(records: list[dict], window: int) -> dict:
    ttft, ttft_window, itl, e2e, chars, tokens = [], [], [], [], 0, 0
    for r in records:
        times = [t for t, _ in r["msgs"]]
        ends = np.cumsum([len(text) for _, text in r["msgs"]])
        ttft.append(times[0] - r["sent"])
        # when the text first reached `window` characters past the first message (or the end)
        k = int(np.searchsorted(ends, ends[0] + window))
        ttft_window.append(times[min(k, len(times) - 1)] - r["sent"])
        itl += list(np.diff(times))
        e2e.append(times[-1] - r["sent"])
        chars, tokens = chars + int(ends[-1]), tokens + r["tokens"]
    p50 = lambda v: float(np.percentile(v, 50)) * 1e3  # noqa: E731
    return {"ttft_ms": p50(ttft), "ttft_window_ms": p50(ttft_window), "itl_ms": p50(itl), "e2e_ms": p50(e2e),
            "chars_per_token": chars / tokens, "n": len(records)}


def scan_cost(window: int, rounds: int = 20) -> None:
    """The rules' own cost on the ingress's event loop, in process (no server): README.md's text
    streamed as 4-character deltas through RequestGuard.output, against the same stream with no
    policy; microseconds per delta."""
    from pathlib import Path

    from router.ingress.flow import Delta
    from router.ingress.guardrails import Guardrails

    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()[:20_000]
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    cfg = AppConfig(guardrail_policies={"builtin": policy(window)}, guardrail_policy="builtin")
    guardrails = Guardrails(cfg)

    async def source():
        for i, t in enumerate(pieces):
            yield Delta("r", t, [i], "length" if i == len(pieces) - 1 else None, 1, i + 1)

    async def run(guarded: bool) -> float:
        started = time.perf_counter()
        stream = guardrails.for_request("default").output(source()) if guarded else source()
        out = [d async for d in stream]
        assert "".join(d.text for d in out) == text, "a rule flagged the README"
        return (time.perf_counter() - started) / len(pieces) * 1e6

    arms = {"plain": [], "guarded": []}
    for _ in range(rounds):
        for arm in arms:
            arms[arm].append(asyncio.run(run(arm == "guarded")))
    p, g = float(np.median(arms["plain"])), float(np.median(arms["guarded"]))
    print(f"\nscan cost: {len(pieces)} deltas of 4 characters (README.md), window {window}, 200 words + "
          f"{len(REGEXES)} regexes; median of {rounds} rounds")
    print(f"  plain {p:.1f} us/delta   guarded {g:.1f} us/delta   the rules: {g - p:.1f} us per delta per stream")


def main() -> None:
    import ray
    from ray import serve

    import cluster.app.builder as serve_app
    from cluster.app.builder import ensure_model
    from cluster.tools.netutil import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="per arm per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=64, help="hold-back window, characters")
    ap.add_argument("--model", choices=["smollm2", "random"], default="smollm2")
    ap.add_argument("--scan-only", action="store_true", help="only the rules' cost per delta, in process")
    args = ap.parse_args()
    if args.scan_only:
        return scan_cost(args.window)

    ray.init(num_cpus=8, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    cfg = ensure_model(default=args.model, config=AppConfig(
        http_port=free_port(), grpc_port=free_port(), prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5},
        graceful_shutdown_timeout_s=1.0, guardrail_policies={"builtin": policy(args.window)},
        tenants={"plain": {"api_keys": [KEYS["plain"]]},
                 "guarded": {"api_keys": [KEYS["guarded"]], "guardrail_policy": "builtin"}}))
    serve_app.start(cfg)
    address = f"localhost:{cfg.grpc_port}"
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10, 250, args.prompt_len)] for _ in range(args.requests)]
    asyncio.run(_phase(address, KEYS["plain"], prompts[:args.streams], args.streams, args.max_tokens))  # warm-up
    records: dict[str, list] = {"plain": [], "guarded": []}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(args.rounds):
        for arm in ("plain", "guarded"):
            records[arm] += asyncio.run(_phase(address, KEYS[arm], prompts, args.streams, args.max_tokens))
    client_cores = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    serve.shutdown()

    flagged = sum(r["flagged"] for r in records["guarded"])
    records["guarded"] = [r for r in records["guarded"] if not r["flagged"]]
    p, g = _stats(records["plain"], args.window), _stats(records["guarded"], args.window)
    print(f"\n{args.streams} streams, {args.rounds} rounds x {args.requests} requests per arm, prompt "
          f"{args.prompt_len} tokens, {args.max_tokens} output tokens; window {args.window} characters; "
          f"guarded policy: 200 words + {len(REGEXES)} regexes; model {cfg.served_model_name}; "
          f"{flagged} guarded requests flagged (left out)")
    for name, s in (("plain", p), ("guarded", g)):
        window_ms = f"{s['ttft_window_ms']:7.1f} ms" if name == "plain" else "      -   "
        print(f"  {name:<8} {s['n']} requests  TTFT p50 {s['ttft_ms']:7.1f} ms   TTFT + window p50 "
              f"{window_ms}   ITL p50 {s['itl_ms']:6.2f} ms   e2e p50 {s['e2e_ms']:7.1f} ms   "
              f"{s['chars_per_token']:.2f} characters a token")
    print(f"  hold-back window: +{p['ttft_window_ms'] - p['ttft_ms']:.1f} ms on TTFT p50 (measured on the plain arm)")
    print(f"  guarded / plain: TTFT {g['ttft_ms'] / p['ttft_window_ms']:.3f}x (guarded TTFT over plain TTFT + window; "
          f"goal <= 1.05)   ITL {g['itl_ms'] / p['itl_ms']:.3f}x (goal <= 1.05)")
    print(f"  load generator: {client_cores:.2f} cores busy (process CPU / wall, {os.cpu_count()} cores here)")


if __name__ == "__main__":
    main()
