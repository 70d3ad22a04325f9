"""`pdserve generate`: stream a completion, in-process (--model DIR) or from a server (--address)."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="stream a completion (in-process with --model DIR)")
    g.add_argument("prompt_text", nargs="?", default=None, help="the prompt (or use --prompt)")
    g.add_argument("--model", help="HF checkpoint directory or Hub repo id (org/name), run in-process")
    g.add_argument("--prompt")
    g.add_argument("--prompt-token-ids", help="comma-separated token ids instead of a text prompt")
    g.add_argument("--chat", help="a user message, rendered with the model's chat template (as the chat API does)")
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
    g.add_argument("--address", help="HOST:PORT of a pdserve gRPC endpoint (instead of --model)")
    g.add_argument("--served-model", help="model id to ask the server for (default: its only model)")
    g.add_argument("--api-key")
    g.add_argument("--timeout", type=float, default=None, help="gRPC deadline in seconds")
    g.set_defaults(func=generate)


def generate(args) -> int:
    if args.prompt_text is not None:
        if args.prompt is not None:
            print("pdserve generate: give the prompt once (positional or --prompt)", file=sys.stderr)
            return 2
        args.prompt = args.prompt_text
    if [args.prompt, args.prompt_token_ids, args.chat].count(None) != 2:
        print("pdserve generate: give exactly one of PROMPT/--prompt, --prompt-token-ids or --chat", file=sys.stderr)
        return 2
    if args.address is not None:
        return _generate_remote(args)
    return _generate_local(args)


def _generate_local(args) -> int:
    from cluster.engine.loop import EngineLoop  # noqa: PLC0415
    from cluster.engine.llm_engine import LLMEngine  # noqa: PLC0415
    from cluster.errors import InvalidRequestError  # noqa: PLC0415
    from cluster.engine.sampling_params import SamplingParams  # noqa: PLC0415

    if args.model is None:
        print("pdserve generate: give --model DIR (in-process) or --address HOST:PORT (a server)", file=sys.stderr)
        return 2
    ids = [int(t) for t in args.prompt_token_ids.split(",")] if args.prompt_token_ids else None
    engine = LLMEngine.from_model(args.model, num_blocks=args.num_blocks, device=args.device)
    if args.chat is not None:  # rendered as the server renders a chat: template, then no extra special tokens
        from cluster.engine.chat_template import render_chat  # noqa: PLC0415

        text = render_chat(engine.tokenizer, [{"role": "user", "content": args.chat}])
        ids = engine.validator.tokenize(text, add_special_tokens=False)
    aengine = EngineLoop(engine)

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


def _generate_remote(args) -> int:
    import grpc  # noqa: PLC0415

    from protos.pdserve.v1 import generation_pb2 as pb  # noqa: PLC0415
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: PLC0415

    sp = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, stop=args.stop or [], ignore_eos=args.ignore_eos)
    if args.seed is not None:
        sp.seed = args.seed
    req = pb.GenerateRequest(sampling=sp, model=args.served_model or "")
    if args.prompt is not None:
        req.text = args.prompt
    elif args.chat is not None:
        req.chat.messages.add(role="user", content=args.chat)
    else:
        req.token_ids.ids.extend(int(t) for t in args.prompt_token_ids.split(","))
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    if args.timeout is not None:  # the server reads the gRPC deadline too; the header also bounds the engines
        metadata.append(("x-pdserve-timeout-s", str(args.timeout)))
    token_ids, text, last = [], "", None
    with grpc.insecure_channel(args.address) as channel:
        try:
            for resp in pb_grpc.GenerationStub(channel).Generate(req, metadata=metadata, timeout=args.timeout):
                token_ids += resp.token_ids
                text += resp.text
                last = resp
                if not args.json:
                    print(resp.text, end="", flush=True)
        except grpc.RpcError as e:
            print(f"\npdserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "finish_reason": reason,
                          "usage": {"prompt_tokens": last.usage.prompt_tokens,
                                    "completion_tokens": last.usage.completion_tokens,
                                    "cached_tokens": last.usage.cached_prompt_tokens}}))
    else:
        print()
    return 0
