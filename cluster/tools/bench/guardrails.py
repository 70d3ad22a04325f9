"""What the guardrail's built-in rules cost a stream, beyond their hold-back window.

    python -m cluster.tools.bench.guardrails [--streams 16] [--requests 32] [--rounds 4] [--window 64]

One server (SmolLM2-135M-Instruct, 1 prefill + 1 decode replica, gRPC), two tenants: "plain" (no
policy) and "guarded" (a policy of 200 random words and 4 bounded regexes on input and output; a
request they flag is counted and left out of the figures). The prompts ask for essays on
--requests topics (chat template), so the model writes ordinary English, ~4 characters a token:
the window holds ~window/4 tokens, not the whole stream. Greedy, EOS ignored, --max-tokens each:
both arms produce the same text. Arms alternate within each round, ABBA over round pairs (plain,
guarded | guarded, plain | ...), each a closed loop of --streams concurrent streams.

The guarded arm's first token is held until `window` characters follow it: that delay is the
window's, not the checks'. It is measured on the plain arm's own streams: the time the text had
grown `window` characters past the first message ("TTFT + window"), exactly when the guard would
release the first delta if its checks took no time. So:
  - the window's delay: plain (TTFT + window) p50 - plain TTFT p50, reported apart;
  - the rules' cost on TTFT: guarded TTFT p50 / plain (TTFT + window) p50;
  - on ITL: guarded ITL p50 / plain ITL p50 (once the window is full, each new delta releases
    one; what the window holds at the end goes out as one message, one interval);
  - on the whole stream: guarded e2e p50 / plain e2e p50 (the last token is released as soon as
    it is checked: no window in it).
Ratios are given as the median of per-round ratios (with min and max) and pooled over all rounds.
The load generator's CPU use (this process: CPU time / wall time) is printed; and, after the
run, the rules' own cost per delta, in process, on the deltas the plain arm received.
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


TOPICS = [
    "the history of the printing press", "how bees make honey", "why the sky is blue", "the life of a lighthouse keeper",
    "the invention of the telephone", "how volcanoes form", "the migration of birds", "the history of chess",
    "how bread is baked", "the water cycle", "the building of the pyramids", "how trains changed travel",
    "the importance of sleep", "the history of the bicycle", "how forests grow back after a fire", "the Roman roads",
    "learning to play the piano", "the life cycle of a butterfly", "how glass is made", "the first maps of the world",
    "why leaves change colour in autumn", "the history of tea", "how a library is organised", "the ocean tides",
    "the life of a medieval farmer", "how clocks keep time", "the story of the Silk Road", "how rivers shape valleys",
    "the history of paper money", "why cats purr", "the first flight of the Wright brothers", "how coffee is grown",
    "the history of the Olympic games", "how a bridge carries weight", "the Arctic winter", "how people learn languages",
    "the history of the post office", "how windmills work", "the life of an astronaut", "the history of cheese",
    "how coral reefs live", "the invention of the compass", "a day in a busy harbour", "how maple syrup is made",
    "the history of the umbrella", "why the moon has phases", "how a newspaper was printed", "the history of gardens",
]


def _words(n: int) -> list[str]:
    rng = np.random.default_rng(7)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return sorted({"".join(rng.choice(letters, int(rng.integers(5, 12)))) for _ in range(n)})


def policy(window: int) -> dict:
    rules = [{"name": "words", "words": _words(200)}]
    rules += [{"name": f"regex{i}", "pattern": p} for i, p in enumerate(REGEXES)]
    return {"rules": rules, "holdback_chars": window}


async def _one(stub, pb, key: str, topic: str, max_tokens: int) -> dict:
    chat = pb.Chat(messages=[pb.ChatMessage(
        role="user", content=f"Write a long, detailed essay about {topic}. Use several paragraphs.")])
    req = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    sent = time.perf_counter()
    msgs = []  # (time, text) of token-carrying messages
    async for resp in stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),)):
        if resp.token_ids:
            msgs.append((time.perf_counter(), resp.text))
        last = resp
    return {"sent": sent, "msgs": msgs, "tokens": last.usage.completion_tokens,
            "flagged": last.finish_reason == pb.FINISH_REASON_CONTENT_FILTER}


async def _phase(address: str, key: str, prompts: list[str], streams: int, max_tokens: int) -> list[dict]:
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
            "chars_per_token": chars / max(tokens, 1), "n": len(records)}


def _ratios(p: dict, g: dict) -> dict:
    """The rules' cost, guarded over plain: TTFT against plain's TTFT + window; ITL; e2e."""
    return {"ttft": g["ttft_ms"] / p["ttft_window_ms"], "itl": g["itl_ms"] / p["itl_ms"], "e2e": g["e2e_ms"] / p["e2e_ms"]}


def scan_cost(window: int, streams: list[list[str]] | None = None, rounds: int = 20) -> None:
    """The rules' own cost on the ingress's event loop, in process (no server): `streams` (each a
    request's deltas as the client received them; default README.md in 4-character deltas) through
    RequestGuard.output, against the same streams with no policy; microseconds per delta."""
    from pathlib import Path

    from router.ingress.request import Delta
    from router.ingress.gateway.guardrails import Guardrails

    if streams is None:
        text = (Path(__file__).resolve().parents[3] / "README.md").read_text()[:20_000]
        streams, what = [[text[i:i + 4] for i in range(0, len(text), 4)]], "README.md in 4-character deltas"
    else:
        what = f"the plain arm's deltas of {len(streams)} requests"
    n = sum(len(s) for s in streams)
    cfg = AppConfig(guardrail_policies={"builtin": policy(window)}, guardrail_policy="builtin")
    guardrails = Guardrails(cfg)

    async def source(pieces):
        for i, t in enumerate(pieces):
            yield Delta("r", t, [i], "length" if i == len(pieces) - 1 else None, 1, i + 1)

    async def run(guarded: bool) -> float:
        started = time.perf_counter()
        for pieces in streams:
            stream = guardrails.for_request("default").output(source(pieces)) if guarded else source(pieces)
            out = [d async for d in stream]
            assert "".join(d.text for d in out) == "".join(pieces), "a rule flagged the text"
        return (time.perf_counter() - started) / n * 1e6

    arms = {"plain": [], "guarded": []}
    for _ in range(rounds):
        for arm in arms:
            arms[arm].append(asyncio.run(run(arm == "guarded")))
    p, g = float(np.median(arms["plain"])), float(np.median(arms["guarded"]))
    print(f"\nscan cost: {n} deltas ({what}), window {window}, 200 words + {len(REGEXES)} regexes; "
          f"median of {rounds} rounds")
    print(f"  plain {p:.1f} us/delta   guarded {g:.1f} us/delta   the rules: {g - p:.1f} us per delta per stream")


def main() -> None:
    import ray
    from ray import serve

    import cluster.app.builder as serve_app
    from cluster.app.builder import ensure_model
    from cluster.tools.netutil import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32, help=f"per arm per round (<= {len(TOPICS)} topics)")
    ap.add_argument("--rounds", type=int, default=4, help="each runs both arms, ABBA over round pairs")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--window", type=int, default=64, help="hold-back window, characters")
    ap.add_argument("--scan-only", action="store_true", help="only the rules' cost per delta, in process")
    args = ap.parse_args()
    if args.scan_only:
        return scan_cost(args.window)
    if not 0 < args.requests <= len(TOPICS):
        ap.error(f"--requests: 1 to {len(TOPICS)}")

    ray.init(num_cpus=8, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    cfg = ensure_model(default="smollm2", config=AppConfig(
        http_port=free_port(), grpc_port=free_port(), prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5},
        graceful_shutdown_timeout_s=1.0, guardrail_policies={"builtin": policy(args.window)},
        tenants={"plain": {"api_keys": [KEYS["plain"]]},
                 "guarded": {"api_keys": [KEYS["guarded"]], "guardrail_policy": "builtin"}}))
    serve_app.start(cfg)
    address = f"localhost:{cfg.grpc_port}"
    prompts = TOPICS[:args.requests]
    for arm in KEYS:  # warm-up, both tenants
        asyncio.run(_phase(address, KEYS[arm], TOPICS[-args.streams:], args.streams, 16))
    records: dict[str, list] = {"plain": [], "guarded": []}
    per_round: list[dict] = []
    flagged = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for rnd in range(args.rounds):
        order = ("plain", "guarded") if rnd % 2 == 0 else ("guarded", "plain")
        got = {arm: asyncio.run(_phase(address, KEYS[arm], prompts, args.streams, args.max_tokens)) for arm in order}
        flagged += sum(r["flagged"] for r in got["guarded"])
        got["guarded"] = [r for r in got["guarded"] if not r["flagged"]]
        p, g = _stats(got["plain"], args.window), _stats(got["guarded"], args.window)
        per_round.append(_ratios(p, g))
        records["plain"] += got["plain"]
        records["guarded"] += got["guarded"]
        print(f"round {rnd + 1}/{args.rounds} ({order[0]} first): plain TTFT {p['ttft_ms']:.0f} ms, + window "
              f"{p['ttft_window_ms']:.0f} ms, ITL {p['itl_ms']:.1f} ms; guarded TTFT {g['ttft_ms']:.0f} ms, ITL "
              f"{g['itl_ms']:.1f} ms; rules: TTFT {per_round[-1]['ttft']:.3f}x ITL {per_round[-1]['itl']:.3f}x",
              flush=True)
    client_cores = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    serve.shutdown()
    ray.shutdown()

    p, g = _stats(records["plain"], args.window), _stats(records["guarded"], args.window)
    pooled = _ratios(p, g)
    print(f"\n{args.streams} streams, {args.rounds} rounds x {args.requests} requests per arm, essay prompts (chat), "
          f"{args.max_tokens} output tokens; window {args.window} characters; guarded policy: 200 words + "
          f"{len(REGEXES)} regexes; model {cfg.served_model_name}; {flagged} guarded requests flagged (left out)")
    for name, s in (("plain", p), ("guarded", g)):
        window_ms = f"{s['ttft_window_ms']:7.1f} ms" if name == "plain" else "      -   "
        print(f"  {name:<8} {s['n']} requests  TTFT p50 {s['ttft_ms']:7.1f} ms   TTFT + window p50 "
              f"{window_ms}   ITL p50 {s['itl_ms']:6.2f} ms   e2e p50 {s['e2e_ms']:7.1f} ms   "
              f"{s['chars_per_token']:.2f} characters a token")
    print(f"  hold-back window ({args.window} characters, ~{args.window / p['chars_per_token']:.0f} tokens): "
          f"+{p['ttft_window_ms'] - p['ttft_ms']:.1f} ms on TTFT p50 (plain arm's TTFT + window - TTFT); what the "
          f"guarded client sees in all: TTFT {g['ttft_ms'] / p['ttft_ms']:.2f}x plain")
    print("  the rules' cost, guarded / plain (goal <= 1.05), median of per-round ratios [min, max]; pooled:")
    for key, what in (("ttft", "TTFT (over plain TTFT + window)"), ("itl", "ITL p50"), ("e2e", "e2e p50")):
        v = [r[key] for r in per_round]
        print(f"    {what:<32} {np.median(v):.3f}x [{min(v):.3f}, {max(v):.3f}]; pooled {pooled[key]:.3f}x")
    print(f"  load generator: {client_cores:.2f} cores busy (process CPU / wall, {os.cpu_count()} cores here)")
    deltas = [[text for _, text in r["msgs"]] for r in records["plain"][:args.requests]]
    scan_cost(args.window, deltas, rounds=5)


if __name__ == "__main__":
    main()
