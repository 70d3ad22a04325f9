"""Records -> the result: per-request arrays first, then every aggregate from those arrays, so a
saved result file holds everything its figures and plots came from.

Field names follow `vllm bench serve` (`completed`, `total_output_tokens`, `mean_ttft_ms`,
`p99_itl_ms`, `request_goodput`, `ttfts`, `itls`, ...), so tools written for its JSON read ours.
Latency arrays are in seconds, aggregates in milliseconds (also as vLLM does). Only completed
requests count towards latencies, token totals and throughput. Percentiles interpolate linearly
(numpy's default, vLLM's too).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from cluster.tools.loadgen.records import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_percentiles(text: str) -> tuple[float, ...]:
    values = tuple(float(p) for p in text.split(",") if p.strip())
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"percentiles must be in (0, 100], e.g. 50,90,99; got {text!r}")
    return values


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for pair in pairs:
        name, _, value = pair.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"goodput SLOs are NAME:MS with NAME one of {', '.join(SLO_METRICS)}; got {pair!r}")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"an SLO must be >= 0 ms, got {pair!r}")
    return slos


def percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def per_request(records: Sequence[RequestRecord], started_at: float) -> dict:
    """The per-request arrays (send order). Failed and incomplete requests have None latencies."""
    ok = [r.status == "ok" for r in records]
    return {
        "input_lens": [r.prompt_tokens if good else (r.prompt_len or 0) for r, good in zip(records, ok)],
        "output_lens": [r.output_tokens if good else 0 for r, good in zip(records, ok)],
        "cached_tokens": [r.cached_tokens if good else 0 for r, good in zip(records, ok)],
        "ttfts": [r.ttft_s if good else None for r, good in zip(records, ok)],
        "itls": [list(r.itls_s) if good else [] for r, good in zip(records, ok)],
        "message_tokens": [list(r.message_tokens) if good else [] for r, good in zip(records, ok)],
        "latencies": [r.latency_s if good else None for r, good in zip(records, ok)],
        "start_times": [r.sent_at - started_at for r in records],
        "queue_times": [r.queue_s for r in records],
        "statuses": [r.status for r in records],
        "error_codes": [r.code for r in records],
        "errors": [r.error for r in records],
        "sessions": [r.session for r in records],
        "turns": [r.turn for r in records],
    }


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    if not values_s:
        keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
        return dict.fromkeys(keys + [f"p{percentile_key(p)}_{name}_ms" for p in percentiles])
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def tpots(arrays: dict) -> list[float | None]:
    """(e2e - ttft) / (output tokens - 1) per completed request; None where undefined."""
    return [None if lat is None or n < 2 else (lat - ttft) / (n - 1)
            for lat, ttft, n in zip(arrays["latencies"], arrays["ttfts"], arrays["output_lens"])]


def token_times(arrays: dict) -> list[tuple[float, int]]:
    """(seconds from the run's start, tokens) for every token-carrying message of completed requests."""
    events = []
    for start, ttft, itls, counts in zip(arrays["start_times"], arrays["ttfts"], arrays["itls"],
                                         arrays["message_tokens"]):
        if ttft is None:
            continue
        t = start + ttft
        events.append((t, counts[0]))
        for gap, n in zip(itls, counts[1:]):
            t += gap
            events.append((t, n))
    return events


def _peaks(arrays: dict) -> tuple[float, int]:
    """Peak output tokens in any whole second of the run, and peak requests in flight."""
    events = token_times(arrays)
    per_second = Counter()
    for t, n in events:
        per_second[int(t)] += n
    spans = [(s, s + lat) for s, lat in zip(arrays["start_times"], arrays["latencies"]) if lat is not None]
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])  # an end before a start at a tie
    inflight = peak = 0
    for _, d in edges:
        inflight += d
        peak = max(peak, inflight)
    return float(max(per_second.values(), default=0)), peak


def aggregate(arrays: dict, duration_s: float, percentiles: Sequence[float], slos: dict[str, float]) -> dict:
    statuses = arrays["statuses"]
    ok = [s == "ok" for s in statuses]
    ttfts = [t for t, good in zip(arrays["ttfts"], ok) if good]
    lats = [t for t, good in zip(arrays["latencies"], ok) if good]
    tp = tpots(arrays)
    completed = sum(ok)
    total_in = sum(n for n, good in zip(arrays["input_lens"], ok) if good)
    total_out = sum(arrays["output_lens"])
    good = None
    if slos:
        limits = {"ttft": arrays["ttfts"], "tpot": [0.0 if t is None else t for t in tp], "e2el": arrays["latencies"]}
        good = sum(1 for i, g in enumerate(ok)
                   if g and all(limits[name][i] * 1000.0 <= slo for name, slo in slos.items()))
    peak_tokens, peak_requests = _peaks(arrays)
    result = {
        "duration": duration_s,
        "completed": completed,
        "failed": statuses.count("failed"),
        "incomplete": statuses.count("incomplete"),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_prompt_tokens": sum(arrays["cached_tokens"]),
        "request_throughput": completed / duration_s if duration_s > 0 else 0.0,
        "request_goodput": None if good is None else good / duration_s,
        "good_requests": good,
        "output_throughput": total_out / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s > 0 else 0.0,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        "errors_by_code": dict(sorted(Counter(c for c, s in zip(arrays["error_codes"], statuses)
                                              if s == "failed").items())),
    }
    result.update(_stats("ttft", ttfts, percentiles))
    result.update(_stats("tpot", [t for t in tp if t is not None], percentiles))
    result.update(_stats("itl", [g for itls in arrays["itls"] for g in itls], percentiles))
    result.update(_stats("e2el", lats, percentiles))
    return result


def summarize(records: Sequence[RequestRecord], started_at: float, duration_s: float,
              percentiles: Sequence[float] = (50, 90, 99), slos: dict[str, float] | None = None) -> dict:
    arrays = per_request(records, started_at)
    return {**aggregate(arrays, duration_s, percentiles, slos or {}), **arrays}


def format_report(result: dict, percentiles: Sequence[float]) -> str:
    lines = ["{:=^60}".format(" pdserve bench result ")]

    def row(label: str, value, fmt: str = "{}") -> None:
        lines.append(f"{label:<44} {'-' if value is None else fmt.format(value)}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result["incomplete"] or result.get("not_sent"):
        row("Cut off by --duration-s (incomplete / not sent):", f"{result['incomplete']} / {result.get('not_sent', 0)}")
    for code, n in result["errors_by_code"].items():
        row(f"  errors {code}:", n)
    row("Benchmark duration (s):", result["duration"], "{:.2f}")
    if "client_cpu_cores" in result:
        row("Load generator CPU (cores busy):", result["client_cpu_cores"], "{:.2f}")
        kept = result.get("client_kept_up")
        row("Load generator p99 send lag (ms):",
            f"{result['client_send_lag_p99_ms']:.1f}" + ("" if kept is None else " (kept up)" if kept else " (FELL BEHIND)"))
        if "client_loop_lag_p99_ms" in result:
            row("Load generator p99 loop lag (ms):", result["client_loop_lag_p99_ms"], "{:.1f}")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total cached prompt tokens:", result["total_cached_prompt_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], "{:.2f}")
    if result["request_goodput"] is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in result.get("goodput_slos", {}).items())
        row(f"Request goodput (req/s) [{slos}]:", result["request_goodput"], "{:.2f}")
    row("Output token throughput (tok/s):", result["output_throughput"], "{:.2f}")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], "{:.2f}")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", result["total_token_throughput"], "{:.2f}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{:-^60}".format(title))
        upper = name.upper()
        row(f"Mean {upper} (ms):", result[f"mean_{name}_ms"], "{:.2f}")
        row(f"Median {upper} (ms):", result[f"median_{name}_ms"], "{:.2f}")
        for p in percentiles:
            w = percentile_key(p)
            row(f"P{w} {upper} (ms):", result[f"p{w}_{name}_ms"], "{:.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
