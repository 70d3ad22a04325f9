"""`pdserve models`: model versions as content-addressed manifests (cluster/manifest.py)."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    mo = sub.add_parser("models", help="model versions as content-addressed manifests (cluster/manifest.py)")
    mos = mo.add_subparsers(dest="models_command", required=True)
    mm = mos.add_parser("manifest", help="hash a checkpoint directory into a manifest")
    mm.add_argument("dir")
    mm.add_argument("--name", required=True, help="the model id clients ask for")
    mm.add_argument("--label", help="a name for people (v2, canary); the version is computed")
    mm.add_argument("--max-model-len", type=int)
    mm.add_argument("--temperature", type=float, help="default sampling for requests that leave it unset")
    mm.add_argument("--top-p", type=float)
    mm.add_argument("--top-k", type=int)
    mm.add_argument("--max-tokens", type=int)
    mm.add_argument("-o", "--output", help="write here (default: stdout)")
    for name, help_ in (("validate", "recompute every version and file hash (exit 1 if one does not hold)"),
                        ("diff", "every difference between two manifests (exit 1 if any)"),
                        ("list", "one line per manifest")):
        c = mos.add_parser(name, help=help_)
        c.add_argument("files", nargs="+", metavar="MANIFEST")
        if name == "validate":
            c.add_argument("--no-files", action="store_true", help="check versions only, not the checkpoint's files")
    mo.set_defaults(func=models)


def models(args) -> int:
    from cluster.manifest import ManifestError, ModelManifest, build_manifest, check, check_set, diff  # noqa: PLC0415

    try:
        if args.models_command == "manifest":
            fields = {}
            if args.max_model_len is not None:
                fields["max_model_len"] = args.max_model_len
            sampling = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "max_tokens")
                        if getattr(args, k) is not None}
            m = build_manifest(args.dir, args.name, args.label, sampling=sampling, **fields)
            if args.output:
                with open(args.output, "w") as f:
                    f.write(m.to_yaml())
                print(f"{m.ref} ({m.label or 'no label'}) -> {args.output}")
            else:
                sys.stdout.write(m.to_yaml())
            return 0
        manifests = [ModelManifest.from_file(f) for f in args.files]
    except (ManifestError, OSError) as e:
        print(f"pdserve models {args.models_command}: {e}", file=sys.stderr)
        return 2
    if args.models_command == "validate":
        bad = 0
        for path, m in zip(args.files, manifests):
            problems = check(m, files=not args.no_files)
            bad += bool(problems)
            print(f"{path}: {m.ref} " + ("ok" if not problems else "INVALID"))
            for line in problems:
                print(f"  {line}")
        for line in check_set(manifests):
            bad += 1
            print(f"INVALID: {line}")
        return 1 if bad else 0
    if args.models_command == "diff":
        if len(manifests) != 2:
            print("pdserve models diff: give exactly two manifests", file=sys.stderr)
            return 2
        lines = diff(*manifests)
        print("\n".join(lines) if lines else "identical")
        return 1 if lines else 0
    for m in manifests:  # list
        print(f"{m.name:<24} {m.label or '-':<12} {m.version}  {len(m.files)} files  {m.source}")
    return 0
