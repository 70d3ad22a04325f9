"""Two result files side by side: every headline metric of both arms and the ratio B/A (for
latencies below 1 B is faster; for throughputs above 1 B is faster)."""

from __future__ import annotations

import json
from pathlib import Path

HEADLINE = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "total_cached_prompt_tokens", "request_throughput", "request_goodput", "output_throughput",
            "total_token_throughput", "max_output_tokens_per_s")
LATENCIES = ("ttft", "tpot", "itl", "e2el")


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def rows(a: dict, b: dict) -> list[tuple[str, float | None, float | None, float | None]]:
    """(metric, A, B, B/A) for the headline fields and each latency statistic both files have."""
    keys = [k for k in HEADLINE if k in a or k in b]
    for name in LATENCIES:
        stats = [k for k in a if k.endswith(f"_{name}_ms") and k.split("_")[0] in ("mean", "median")]
        stats += sorted((k for k in a if k.endswith(f"_{name}_ms") and k.startswith("p") and k in b),
                        key=lambda k: float(k[1:].split("_")[0]))
        keys += stats
    out = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        ratio = vb / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
        out.append((k, va, vb, ratio))
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:d}" if isinstance(v, int) else f"{v:.2f}"


def format_comparison(a: dict, b: dict, label_a: str, label_b: str) -> str:
    width = max(12, len(label_a), len(label_b))
    lines = [f"{'metric':<32} {label_a:>{width}} {label_b:>{width}} {'B/A':>8}",
             f"{'(A = ' + label_a + ', B = ' + label_b + ')':<32}"]
    for k, va, vb, ratio in rows(a, b):
        lines.append(f"{k:<32} {_fmt(va):>{width}} {_fmt(vb):>{width}} "
                     f"{'-' if ratio is None else f'{ratio:.2f}x':>8}")
    return "\n".join(lines)
