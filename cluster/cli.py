"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid


def _init_model(args) -> int:
    from cluster.model.init_model import init_model  # noqa: PLC0415

    out = init_model(
        args.dir, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate, vocab=args.vocab, max_positions=args.max_positions,
        tie_embeddings=args.tie_embeddings, dtype=args.dtype, seed=args.seed,
    )
    print(f"wrote a random {args.layers}-layer Llama checkpoint to {out}")
    return 0


def _generate(args) -> int:
    from cluster.async_engine import AsyncEngine  # noqa: PLC0415
    from cluster.engine import LLMEngine  # noqa: PLC0415
    from cluster.errors import InvalidRequestError  # noqa: PLC0415
    from cluster.sampling_params import SamplingParams  # noqa: PLC0415

    if args.model is None:
        print("pdserve generate: --model DIR is required (serving over --address comes with `pdserve up`)",
              file=sys.stderr)
        return 2
    ids = [int(t) for t in args.prompt_token_ids.split(",")] if args.prompt_token_ids else None
    engine = LLMEngine.from_model(args.model, num_blocks=args.num_blocks, device=args.device)
    aengine = AsyncEngine(engine)

    async def run() -> dict:
        sp = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
        )
        token_ids, text, last = [], "", None
        async for out in aengine.generate(uuid.uuid4().hex, args.prompt, ids, sp):
            token_ids += out.token_ids
            text += out.text
            last = out
            if not args.json:
                print(out.text, end="", flush=True)
        if not args.json:
            print()
        return {"token_ids": token_ids, "text": text, "finish_reason": last.finish_reason,
                "usage": {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_output_tokens,
                          "cached_tokens": last.num_cached_tokens}}

    try:
        result = asyncio.run(run())
    except InvalidRequestError as e:
        print(f"pdserve generate: invalid request: {e}", file=sys.stderr)
        return 2
    finally:
        aengine.shutdown()
    if args.json:
        print(json.dumps(result))
    return 0 if result["finish_reason"] != "error" else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray")
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="command", required=True)

    im = sub.add_parser("init-model", help="write a small random HF-format Llama checkpoint (the demo model)")
    im.add_argument("dir")
    im.add_argument("--layers", type=int, default=2)
    im.add_argument("--hidden", type=int, default=64)
    im.add_argument("--heads", type=int, default=4)
    im.add_argument("--kv-heads", type=int, default=2)
    im.add_argument("--intermediate", type=int, default=None)
    im.add_argument("--vocab", type=int, default=320)
    im.add_argument("--max-positions", type=int, default=2048)
    im.add_argument("--tie-embeddings", action="store_true")
    im.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    im.add_argument("--seed", type=int, default=0)
    im.set_defaults(func=_init_model)

    g = sub.add_parser("generate", help="stream a completion (in-process with --model DIR)")
    g.add_argument("prompt_text", nargs="?", default=None, help="the prompt (or use --prompt)")
    g.add_argument("--model", help="HF checkpoint directory, run in-process")
    g.add_argument("--prompt")
    g.add_argument("--prompt-token-ids", help="comma-separated token ids instead of a text prompt")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument("--device", default="auto")
    g.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": "..."}')
    g.set_defaults(func=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "prompt_text", None) is not None:
        if args.prompt is not None:
            print("pdserve generate: give the prompt once (positional or --prompt)", file=sys.stderr)
            return 2
        args.prompt = args.prompt_text
    if args.command == "generate" and (args.prompt is None) == (args.prompt_token_ids is None):
        print("pdserve generate: give exactly one of PROMPT/--prompt or --prompt-token-ids", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
