"""The `pdserve` command line (`pdserve bench` is built in cluster/tools/loadgen/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid


def _init_model(args) -> int:
    if args.from_gguf:
        from cluster.engine.model.gguf import convert_gguf  # noqa: PLC0415

        try:
            out = convert_gguf(args.from_gguf, args.dir, dtype=args.dtype)
        except (OSError, ValueError) as e:
            print(f"pdserve init-model: {e}", file=sys.stderr)
            return 2
        print(f"converted {args.from_gguf} to a {args.dtype} checkpoint in {out}")
        return 0
    from cluster.engine.model.init_model import init_model  # noqa: PLC0415

    out = init_model(
        args.dir, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate, vocab=args.vocab, max_positions=args.max_positions,
        tie_embeddings=args.tie_embeddings, dtype=args.dtype, seed=args.seed,
    )
    print(f"wrote a random {args.layers}-layer Llama checkpoint to {out}")
    return 0


def _generate(args) -> int:
    from cluster.engine.loop import EngineLoop  # noqa: PLC0415
    from cluster.engine.llm_engine import LLMEngine  # noqa: PLC0415
    from cluster.errors import InvalidRequestError  # noqa: PLC0415
    from cluster.engine.sampling_params import SamplingParams  # noqa: PLC0415

    if args.address is not None:
        return _generate_remote(args)
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


def _load_app_config(args):
    from cluster.config import AppConfig  # noqa: PLC0415

    data = AppConfig.from_yaml(args.config).model_dump() if args.config else {}
    overrides = {"model": args.model, "http_port": args.http_port, "grpc_port": args.grpc_port, "host": args.host,
                 "mode": args.mode}
    data.update({k: v for k, v in overrides.items() if v is not None})
    for pool, n in (("prefill", args.prefill_replicas), ("decode", args.decode_replicas)):
        if n is not None:
            data.setdefault(pool, {})["num_replicas"] = n
            data[pool]["autoscaling"] = None
    if args.num_blocks is not None:
        data.setdefault("engine", {})["num_blocks"] = args.num_blocks
    return AppConfig.model_validate(data)


def _up(args) -> int:
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    import cluster.app.builder as serve_app  # noqa: PLC0415
    from cluster.manifest import ManifestError, resolve_manifests  # noqa: PLC0415

    config = serve_app.ensure_model(_load_app_config(args))
    config.check_startable()  # before Ray starts: an open non-loopback bind is refused
    try:  # before Ray starts too: a version whose checkpoint changed since its manifest is refused
        config = resolve_manifests(config)  # what is deployed and printed: each version's checkpoint
        serve_app.check_checkpoints(config)  # a Hub name resolved (downloaded once) before Ray starts
    except (ManifestError, ValueError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    address = os.environ.get("RAY_ADDRESS")
    joined = address is not None

    def interrupt(*_):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # during start-up: abort, and clean up below
        signal.signal(sig, interrupt)
    if joined:
        if args.direct_ingress and not serve_app.direct_ingress_on():
            print("pdserve up: --direct-ingress needs the cluster started with it: run `ray start` on every node "
                  "with the environment of cluster.app.builder.direct_ingress_env (deploy/cluster.yaml)",
                  file=sys.stderr)
            return 2
        ray.init(address=address, namespace="pdserve")
    else:
        # Ray's CPUs are scheduling slots: give the local instance enough for every replica
        # even on a small machine (the engines share the real cores through torch's threads).
        # The dashboard runs jobs: loopback only (README).
        if args.direct_ingress:  # the ingress replica is the HTTP server: no proxy hop (docs/architecture.md)
            os.environ.update(serve_app.direct_ingress_env(config.http_port,
                                                           throughput_optimized=args.throughput_profile))
        ray.init(namespace="pdserve", num_cpus=max(os.cpu_count() or 1, serve_app.cpus_needed(config)),
                 include_dashboard=args.dashboard, dashboard_host="127.0.0.1", dashboard_port=8265)
    stop = threading.Event()
    try:
        serve_app.start(config)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        host = "localhost" if config.host in ("0.0.0.0", "::") else config.host
        served = ", ".join(f"{v.name}@{v.label} ({v.config.model})" if not v.single else f"{v.name} ({v.config.model})"
                           for v in config.served_versions())
        print(f"pdserve is serving {served}, "
              f"{'disaggregated' if config.has_prefill_pool else 'colocated (no prefill pool)'}", flush=True)
        print(f"  gRPC    {host}:{config.grpc_port}   (pdserve.v1.Generation, grpc.health.v1.Health)", flush=True)
        print(f"  HTTP    http://{host}:{config.http_port}/v1   (OpenAI-compatible)", flush=True)
        if not joined and args.dashboard:
            print("  Ray dashboard   http://127.0.0.1:8265   (this machine only: README, \"Exposure\")", flush=True)
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":  # Ray's default for a local instance
            print("  Ray token auth  on: `pdserve status`, or `RAY_AUTH_MODE=token serve status` "
                  "(Ray's CLIs send the token only with it set)", flush=True)
        print(f"  {config.admission_bounds.describe()}", flush=True)
        print("Ctrl-C to stop.", flush=True)
        stop.wait()
    except KeyboardInterrupt:
        print("pdserve: interrupted during start-up", flush=True)
    finally:
        print("pdserve: shutting down", flush=True)
        serve.shutdown()
        if joined:  # the app's detached control actors go with it (router/actor.py)
            from router.actor import kill_app_actors  # noqa: PLC0415

            kill_app_actors("pdserve")
        else:
            ray.shutdown()
    print("pdserve: stopped", flush=True)
    return 0


def _rollout(args) -> int:
    import os  # noqa: PLC0415
    import time  # noqa: PLC0415

    import ray  # noqa: PLC0415

    from router.actor import DEFAULT_APP, lookup  # noqa: PLC0415
    from router.ingress.versions.rollout_actor import rollout_name  # noqa: PLC0415

    if not ray.is_initialized():
        ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", namespace="pdserve",
                 log_to_driver=False)
    actor = lookup(rollout_name(DEFAULT_APP))  # the app `pdserve up` deploys
    if actor is None:
        print("pdserve rollout: no rollout actor in this cluster (no model with several versions is deployed)",
              file=sys.stderr)
        return 1
    try:
        if args.rollout_command == "status":
            status = ray.get(actor.status.remote(), timeout=30)
            if args.json:
                print(json.dumps(status, indent=2))
                return 0
            for name, m in status["models"].items():
                print(f"{name}: " + ", ".join(f"{v}={w:g}" for v, w in m["weights"].items())
                      + f"  (baseline {m['baseline']}; configured " + ", ".join(
                          f"{v}={w:g}" for v, w in m["configured"].items()) + ")")
                for label, w in m["window"].items():
                    print(f"  {label}: {w}")
            for d in status["decisions"][-10:]:
                print(f"{time.strftime('%H:%M:%S', time.localtime(d['time']))} {d['model']} {d['action']}: {d['reason']}")
            return 0
        if args.rollout_command == "set":
            weights = {}
            for item in args.weights:
                label, sep, value = item.partition("=")
                try:
                    weights[label] = float(value)
                except ValueError:
                    sep = ""
                if not sep:
                    print(f"pdserve rollout set: {item!r} is not LABEL=WEIGHT", file=sys.stderr)
                    return 2
            decision = ray.get(actor.set_split.remote(args.model, weights, args.reason), timeout=30)
        else:
            decision = ray.get(actor.rollback.remote(args.model, args.reason), timeout=30)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), ValueError) else e
        print(f"pdserve rollout: {cause}", file=sys.stderr)
        return 2
    print(f"{decision['model']}: {decision['action']} -> " + ", ".join(
        f"{v}={w:g}" for v, w in decision["weights"].items()) + " (every ingress within one evaluate_s)")
    return 0


def _status(args) -> int:
    from cluster.app.status_cli import status  # noqa: PLC0415

    return status(args)


def _slo_rules(args) -> int:
    from cluster.config import AppConfig  # noqa: PLC0415
    from cluster.telemetry.slo import render  # noqa: PLC0415

    cfg = AppConfig.from_yaml(args.config) if args.config else AppConfig()
    sys.stdout.write(render(cfg.telemetry.slo, args.time_scale, cfg.budgets.alert_fraction))
    return 0


def _audit_verify(args) -> int:
    from cluster.config.front_door import state_path  # noqa: PLC0415
    from router.ingress.gateway.audit_log import verify  # noqa: PLC0415

    anchor = None
    if args.anchor:
        seq, _, digest = args.anchor.partition(":")
        if not (seq.isdigit() and len(digest) == 64):
            print(f"pdserve audit verify: --anchor wants SEQ:HASH (a record's seq and its 64-hex hash), got "
                  f"{args.anchor!r}", file=sys.stderr)
            return 2
        anchor = (int(seq), digest)
    path = state_path(args.path, "audit")
    result = verify(path, anchor=anchor)
    if not result.ok:
        print(f"FAIL after {result.records} good records: {result.error}", file=sys.stderr)
        return 1
    past = (f"; {result.unanchored} record(s) past HEAD (a writer crash before HEAD moved: anchored when it "
            f"restarts)" if result.unanchored else "")
    print(f"OK: {result.records} records in {result.files} file(s) of {path}; chain head {result.head}{past}")
    return 0


def _budget(args) -> int:
    """Each tenant's spend this month: from the running cluster's ledger actor, or its file."""
    if args.file:
        from router.ingress.gateway.budget import Ledger  # noqa: PLC0415

        snap = Ledger(args.file).snapshot()
    else:
        import os  # noqa: PLC0415

        import ray  # noqa: PLC0415

        from router.actor import DEFAULT_APP, lookup, scoped_name  # noqa: PLC0415
        from router.ingress.gateway.budget_actor import LEDGER  # noqa: PLC0415

        if not ray.is_initialized():
            ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", namespace="pdserve",
                     log_to_driver=False)
        ledger = lookup(scoped_name(DEFAULT_APP, LEDGER))  # the app `pdserve up` deploys
        if ledger is not None:
            snap = ray.get(ledger.snapshot.remote(), timeout=30)
        else:
            print("pdserve budget: no ledger in this cluster (no prices or budgets configured, or no request yet)",
                  file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(snap))
        return 0
    print(f"month {snap['month']} (UTC)")
    print(f"{'tenant':<20} {'spent $':>14} {'in flight $':>14} {'budget $':>12} {'used':>7}")
    for tenant, s in snap["tenants"].items():
        budget = s["budget_usd"]
        used = "" if not budget else f"{(s['spent_usd'] + s['reserved_usd']) / budget:.1%}"
        print(f"{tenant:<20} {s['spent_usd']:>14.6f} {s['reserved_usd']:>14.6f} "
              f"{'-' if budget is None else f'{budget:.2f}':>12} {used:>7}")
    return 0


def _models(args) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray")
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="command", required=True)

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
    im.set_defaults(func=_init_model)

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
    g.set_defaults(func=_generate)

    up = sub.add_parser("up", help="start (or join RAY_ADDRESS) a Ray cluster, deploy, serve until Ctrl-C")
    up.add_argument("--config", help="app config YAML (see deploy/pdserve.yaml)")
    up.add_argument("--model", help="HF checkpoint directory or Hub repo id (org/name; default: SmolLM2-135M-Instruct, "
                    "fetched and converted once)")
    up.add_argument("--mode", choices=["disaggregated", "colocated"],
                    help="colocated: no prefill pool, decode replicas prefill locally (default: disaggregated)")
    up.add_argument("--prefill-replicas", type=int)
    up.add_argument("--decode-replicas", type=int)
    up.add_argument("--num-blocks", type=int, help="KV blocks per replica")
    up.add_argument("--host")
    up.add_argument("--http-port", type=int)
    up.add_argument("--grpc-port", type=int)
    up.add_argument("--direct-ingress", action="store_true",
                    help="the ingress replica serves the ports itself (Serve's direct ingress, no proxy hop; one "
                         "ingress replica per node); the Ray started here gets the environment it needs "
                         "(docs/architecture.md, 'Direct ingress')")
    up.add_argument("--throughput-profile", action="store_true",
                    help="with --direct-ingress: Serve's throughput profile (RAY_SERVE_THROUGHPUT_OPTIMIZED): more "
                         "refusals/s and tokens/s under load, but more latency per token at one stream "
                         "(docs/benchmarks.md)")
    up.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                    help="start the local Ray instance without its dashboard")
    up.set_defaults(func=_up)

    st = sub.add_parser("status", help="replicas, KV usage and queues of a running pdserve")
    st.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local cluster)")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_status)

    au = sub.add_parser("audit", help="the audit log (audit.dir)")
    au_sub = au.add_subparsers(dest="audit_command", required=True)
    av = au_sub.add_parser("verify", help="check the hash chain of an audit log directory (or one file) and "
                                          "its end against the directory's HEAD; names the first record that "
                                          "was edited, removed or cut off")
    av.add_argument("path", nargs="?", help="default: audit.dir's default, $XDG_STATE_HOME/pdserve/audit "
                                            "(~/.local/state/pdserve/audit)")
    av.add_argument("--anchor", metavar="SEQ:HASH", help="a head kept elsewhere (an earlier `chain head`): "
                                                         "the log must still hold that record, with that hash")
    av.set_defaults(func=_audit_verify)

    bu = sub.add_parser("budget", help="each tenant's spend this month (the ledger actor, or --file)")
    bu.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local cluster)")
    bu.add_argument("--file", help="read the ledger's file (budgets.ledger_path) instead of the running cluster")
    bu.add_argument("--json", action="store_true")
    bu.set_defaults(func=_budget)

    sr = sub.add_parser("slo-rules", help="print Prometheus recording and alerting rules for the config's SLOs "
                                          "(telemetry.slo; the defaults are deploy/prometheus/pdserve-rules.yml)")
    sr.add_argument("--config", help="app config YAML (default: the built-in defaults)")
    sr.add_argument("--time-scale", type=float, default=1.0,
                    help="shrink every window and `for` by this factor (tests and drills; names stay nominal)")
    sr.set_defaults(func=_slo_rules)

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
    mo.set_defaults(func=_models)

    ro = sub.add_parser("rollout", help="each model's live traffic split (changed without a redeploy) and the "
                                        "canary gate's decisions (router/ingress/versions/rollout.py)")
    ros = ro.add_subparsers(dest="rollout_command", required=True)
    rst = ros.add_parser("status", help="splits, each version's outcomes over the gate's window, decisions")
    rst.add_argument("--json", action="store_true")
    rse = ros.add_parser("set", help="set a model's split, e.g. `pdserve rollout set chat v1=90 v2=10`")
    rse.add_argument("model")
    rse.add_argument("weights", nargs="+", metavar="LABEL=WEIGHT", help="versions left out get 0")
    rrb = ros.add_parser("rollback", help="all of a model's traffic to its baseline (its first version)")
    rrb.add_argument("model")
    for c in (rst, rse, rrb):
        c.add_argument("--address", help="Ray address (default: RAY_ADDRESS or the local cluster)")
    for c in (rse, rrb):
        c.add_argument("--reason", default="manual", help="logged with the decision")
    ro.set_defaults(func=_rollout)

    from cluster.app.plan_cli import add_planner_parsers  # noqa: PLC0415 — `pdserve profile`, `pdserve plan`

    add_planner_parsers(sub)
    from cluster.tools.loadgen.cli import add_bench_parser  # noqa: PLC0415 — `pdserve bench` lives in cluster/loadgen

    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "prompt_text", None) is not None:
        if args.prompt is not None:
            print("pdserve generate: give the prompt once (positional or --prompt)", file=sys.stderr)
            return 2
        args.prompt = args.prompt_text
    if args.command == "generate" and [args.prompt, args.prompt_token_ids, args.chat].count(None) != 2:
        print("pdserve generate: give exactly one of PROMPT/--prompt, --prompt-token-ids or --chat", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
