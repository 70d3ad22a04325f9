"""`pdserve init-model`: a small random HF-format Llama checkpoint (the demo model), or a GGUF file
converted into one."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    im = sub.add_parser("init-model", help="write a small random HF-format Llama checkpoint (the demo model), "
                                           "or convert a GGUF file (--from-gguf)")
    im.add_argument("dir")
    im.add_argument("--from-gguf", metavar="FILE", help="convert this GGUF file into DIR, dequantized to --dtype")
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
    im.set_defaults(func=init_model)


def init_model(args) -> int:
    if args.from_gguf:
        from cluster.engine.model.gguf import convert_gguf  # noqa: PLC0415

        try:
            out = convert_gguf(args.from_gguf, args.dir, dtype=args.dtype)
        except (OSError, ValueError) as e:
            print(f"pdserve init-model: {e}", file=sys.stderr)
            return 2
        print(f"converted {args.from_gguf} to a {args.dtype} checkpoint in {out}")
        return 0
    from cluster.engine.model.init_model import init_model as write_random  # noqa: PLC0415

    out = write_random(
        args.dir, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate, vocab=args.vocab, max_positions=args.max_positions,
        tie_embeddings=args.tie_embeddings, dtype=args.dtype, seed=args.seed,
    )
    print(f"wrote a random {args.layers}-layer Llama checkpoint to {out}")
    return 0
