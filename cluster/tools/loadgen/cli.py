"""`pdserve bench` (a run against a server) and `pdserve bench compare A.json B.json`.

Options follow `vllm bench serve` where it has one (`--request-rate`, `--burstiness`,
`--max-concurrency`, `--random-input-len`, `--goodput`, `--save-result`, ...; its spellings
`--num-warmups`, `--metric-percentiles` and `--result-filename` are accepted too). Nothing heavy is
imported until a command runs, so `pdserve --help` stays fast.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from pathlib import Path

DATASETS = ("random", "shared-prefix", "multi-turn", "sharegpt", "trace")


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="load-test a running pdserve: latency, throughput, goodput, plots",
                       description="Load-test a running pdserve over gRPC (or OpenAI HTTP). "
                                   "`pdserve bench compare A.json B.json` compares two saved results.")
    api = b.add_argument_group("server")
    api.add_argument("--backend", choices=["grpc", "openai"], default="grpc")
    api.add_argument("--address", default="localhost:9000", help="gRPC HOST:PORT (backend grpc)")
    api.add_argument("--base-url", default="http://localhost:8000", help="HTTP base URL (backend openai)")
    api.add_argument("--api-key", help="sent as `authorization: Bearer KEY`")
    api.add_argument("--model", default="", help="served model id (default: the server's only model)")

    data = b.add_argument_group("workload")
    data.add_argument("--dataset-name", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", help="ShareGPT JSON or trace JSONL")
    data.add_argument("--num-prompts", type=int, help="requests to send (default: 1000, or the dataset's size)")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--shared-prefix-num-prefixes", type=int, default=8)
    data.add_argument("--shared-prefix-suffixes-per-prefix", type=int, default=16)
    data.add_argument("--shared-prefix-len", type=int, default=512)
    data.add_argument("--shared-prefix-suffix-len", type=int, default=64)
    data.add_argument("--shared-prefix-output-len", type=int, default=64)
    data.add_argument("--multi-turn-turns", type=int, default=4)
    data.add_argument("--multi-turn-user-len", type=int, default=64)
    data.add_argument("--multi-turn-output-len", type=int, default=64)
    data.add_argument("--sharegpt-output-len", type=int, help="fixed output length (default: the recorded answer's)")
    data.add_argument("--trace-time-scale", type=float, default=1.0, help="0.5 replays a trace twice as fast")
    data.add_argument("--trace-block-size", type=int, default=512, help="prompt tokens per trace hash id")
    data.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                      help="auto: token ids for synthetic data and traces, text for ShareGPT")
    data.add_argument("--tokenizer", help="model directory with tokenizer.json (text <-> ids, ShareGPT lengths)")
    data.add_argument("--vocab-size", type=int, help="token ids are drawn below this (default: the server's)")
    data.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens per request")
    data.add_argument("--temperature", type=float, default=0.0)
    data.add_argument("--top-p", type=float, default=1.0)

    load = b.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="sessions/s (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument("--warmup-requests", "--num-warmups", type=int, default=0, help="sent first, not measured")
    load.add_argument("--duration-s", type=float, default=600.0, help="hard bound on the measured run")
    load.add_argument("--seed", type=int, default=0)

    out = b.add_argument_group("report")
    out.add_argument("--percentiles", "--metric-percentiles", default="50,90,99")
    out.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--result-file", "--result-filename", help="where --save-result writes (implies it)")
    out.add_argument("--plot-dir", help="write latency CDFs and throughput over time here (PNG)")
    out.add_argument("--label", help="this run's name in plots and comparisons")
    out.add_argument("--disable-tqdm", action="store_true")
    b.set_defaults(func=run_bench)

    bsub = b.add_subparsers(dest="bench_command", metavar="{compare}")
    c = bsub.add_parser("compare", help="two result files side by side, with ratios B/A")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--labels", nargs=2, metavar=("A", "B"))
    c.add_argument("--plot-dir", help="overlay both runs' CDFs and throughput here (PNG)")
    c.set_defaults(func=run_compare)


def run_compare(args) -> int:
    from cluster.tools.loadgen.compare import format_comparison, load  # noqa: PLC0415

    a, b = load(args.a), load(args.b)
    la, lb = args.labels or (a.get("label") or Path(args.a).stem, b.get("label") or Path(args.b).stem)
    if la == lb:
        la, lb = f"A:{la}", f"B:{lb}"
    print(format_comparison(a, b, la, lb))
    if args.plot_dir:
        from cluster.tools.loadgen.plots import plot_results  # noqa: PLC0415

        for p in plot_results({la: a, lb: b}, args.plot_dir):
            print(f"wrote {p}")
    return 0


def run_bench(args) -> int:
    from cluster.tools.loadgen.report import parse_goodput, parse_percentiles  # noqa: PLC0415

    try:
        percentiles = parse_percentiles(args.percentiles)
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_bench(args, percentiles, slos))
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2


def make_client(args):
    from cluster.tools.loadgen.clients import GrpcClient, OpenAIClient, Sampling  # noqa: PLC0415

    sampling = Sampling(args.temperature, args.top_p, args.ignore_eos)
    if args.backend == "grpc":
        return GrpcClient(args.address, args.api_key, args.model, sampling)
    return OpenAIClient(args.base_url, args.api_key, args.model, sampling)


def make_dataset(args, vocab_size: int | None, tokenizer, max_model_len: int):
    from cluster.tools.loadgen import datasets as ds  # noqa: PLC0415
    from cluster.tools.loadgen import files  # noqa: PLC0415

    name = args.dataset_name
    if name in ("sharegpt", "trace") and not args.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if name == "sharegpt":
        return files.ShareGPTDataset(args.dataset_path, args.sharegpt_output_len, tokenizer, max_model_len)
    if vocab_size is None:
        raise ValueError("synthetic token ids need a vocabulary size: give --vocab-size or --tokenizer "
                         "(the OpenAI API does not report it)")
    if name == "trace":
        return files.TraceDataset(args.dataset_path, vocab_size, args.trace_block_size, args.trace_time_scale)
    if name == "shared-prefix":
        return ds.SharedPrefixDataset(args.shared_prefix_num_prefixes, args.shared_prefix_suffixes_per_prefix,
                                      args.shared_prefix_len, args.shared_prefix_suffix_len,
                                      args.shared_prefix_output_len, vocab_size)
    if name == "multi-turn":
        return ds.MultiTurnDataset(args.multi_turn_turns, args.multi_turn_user_len, args.multi_turn_output_len,
                                   vocab_size)
    return ds.RandomDataset(args.random_input_len, args.random_output_len, args.random_range_ratio, vocab_size)


def seeded_generators(seed: int):
    """Independent streams for the dataset, the arrivals and the warm-up: one seed fixes them all,
    and adding warm-up requests changes neither the measured requests nor their arrival times."""
    import numpy as np  # noqa: PLC0415

    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))


def default_num_prompts(dataset) -> int:
    if hasattr(dataset, "size"):  # shared-prefix: every prompt once
        return dataset.size
    if dataset.name == "trace":
        from cluster.tools.loadgen.files import read_trace  # noqa: PLC0415

        return len(read_trace(dataset.path))
    return 1000


def convert_prompts(sessions, args, tokenizer, dataset_name: str):
    from cluster.tools.loadgen.datasets import to_ids, to_text  # noqa: PLC0415

    fmt = args.prompt_format
    if fmt == "auto" or (fmt == "text") == (dataset_name == "sharegpt"):
        return sessions
    if tokenizer is None:
        raise ValueError(f"--prompt-format {fmt} for the {dataset_name} dataset needs --tokenizer")
    return to_text(sessions, tokenizer) if fmt == "text" else to_ids(sessions, tokenizer)


async def _bench(args, percentiles, slos) -> int:
    from cluster.tools.loadgen.arrivals import session_offsets  # noqa: PLC0415
    from cluster.tools.loadgen.datasets import check_fits  # noqa: PLC0415
    from cluster.tools.loadgen.report import format_report, summarize  # noqa: PLC0415
    from cluster.tools.loadgen.runner import Runner  # noqa: PLC0415

    tokenizer = None
    if args.tokenizer:
        from cluster.engine.tokenizer import Tokenizer  # noqa: PLC0415

        tokenizer = Tokenizer(args.tokenizer)
    client = make_client(args)
    try:
        try:
            info = await client.server_info()
        except Exception as e:  # noqa: BLE001 — no server: say so plainly
            where = args.address if args.backend == "grpc" else args.base_url
            print(f"pdserve bench: cannot reach pdserve at {where}: {e}", file=sys.stderr)
            return 1
        vocab = args.vocab_size or info.vocab_size or (tokenizer.vocab_size if tokenizer else None)
        dataset = make_dataset(args, vocab, tokenizer, info.max_model_len)
        rng_data, rng_arrivals, rng_warmup = seeded_generators(args.seed)
        num = args.num_prompts or default_num_prompts(dataset)
        sessions = convert_prompts(dataset.sample(num, rng_data), args, tokenizer, dataset.name)
        if not sessions:
            raise ValueError("the dataset gave no requests")
        if args.backend == "openai" and any(len(s.turns) > 1 for s in sessions) and \
                sessions[0].turns[0].prompt.token_ids is not None:
            raise ValueError("multi-turn token-id sessions need --backend grpc (SSE carries text only); "
                             "or use --prompt-format text with --tokenizer")
        check_fits(sessions, info.max_model_len)
        offsets = session_offsets(sessions, args.request_rate, args.burstiness, rng_arrivals)
        runner = Runner(client, args.max_concurrency, progress=not args.disable_tqdm)
        planned = sum(s.num_requests for s in sessions)
        print(f"pdserve bench: {client.name} -> {info.model}; {dataset.name}, {planned} requests in "
              f"{len(sessions)} sessions; rate {args.request_rate} (burstiness {args.burstiness}), "
              f"max concurrency {args.max_concurrency or 'none'}, bound {args.duration_s:g} s", flush=True)
        if args.warmup_requests:
            n = args.warmup_requests
            warm = dataset.sample(n * getattr(dataset, "turns", 1), rng_warmup)
            warm = convert_prompts(warm, args, tokenizer, dataset.name)
            records = await runner.warmup([s.turns[0] for s in warm][:n])
            ok = sum(r.status == "ok" for r in records)
            print(f"warm-up: {ok}/{len(records)} requests succeeded", flush=True)
            if ok == 0:
                print(f"pdserve bench: every warm-up request failed: {records[0].code} {records[0].error}",
                      file=sys.stderr)
                return 1
        outcome = await runner.run(sessions, offsets, args.duration_s)
    finally:
        await client.close()

    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "label": args.label or f"{client.name}-{dataset.name}",
        "backend": client.name, "model_id": info.model, "dataset_name": dataset.name,
        "num_prompts": planned, "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
        "ignore_eos": args.ignore_eos, "warmup_requests": args.warmup_requests, "duration_bound_s": args.duration_s,
        "hit_time_bound": outcome.hit_time_bound, "not_sent": outcome.not_sent,
        "client_cpu_cores": outcome.client_cpu_share, "client_send_lag_p99_ms": outcome.send_lag_s(99) * 1e3,
        "client_loop_lag_p99_ms": outcome.loop_lag_s(99) * 1e3,
        "client_kept_up": outcome.kept_up() if args.max_concurrency is None else None,
        "percentiles": list(percentiles), "goodput_slos": slos,
        **summarize(outcome.records, outcome.started_at, outcome.duration_s, percentiles, slos),
    }
    print(format_report(result, percentiles))
    if result["client_kept_up"] is False:
        print(f"pdserve bench: WARNING: the load generator fell behind its schedule (p99 send lag "
              f"{result['client_send_lag_p99_ms']:.0f} ms, loop lag {result['client_loop_lag_p99_ms']:.0f} ms, {result['client_cpu_cores']:.2f} cores busy): the offered "
              f"rate was lower than asked and these figures do not measure the server at that rate", file=sys.stderr)
    path = args.result_file or (_default_result_name(result) if args.save_result else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result))
        print(f"wrote {path}")
    if args.plot_dir:
        from cluster.tools.loadgen.plots import plot_results  # noqa: PLC0415

        for p in plot_results({result["label"]: result}, args.plot_dir):
            print(f"wrote {p}")
    return 0 if result["completed"] else 1


def _default_result_name(result: dict) -> str:
    conc = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] else ""
    return f"pdserve-bench-{result['backend']}-{result['request_rate']}qps{conc}-{result['date']}.json"

