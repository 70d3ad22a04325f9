"""PNG plots from result dicts (a live run's or saved files'): latency CDFs and throughput over
time. Several results overlay on the same axes, which is how `compare` shows two arms."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from cluster.tools.loadgen.report import token_times, tpots

CDFS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "Inter-token latency"), ("e2el", "End-to-end latency"))


def latency_values_ms(result: dict, metric: str) -> np.ndarray:
    """One metric's per-request (per-gap for ITL) values in ms, completed requests only."""
    if metric == "ttft":
        values = result["ttfts"]
    elif metric == "tpot":
        values = tpots(result)
    elif metric == "itl":
        values = [g for itls in result["itls"] for g in itls]
    else:
        values = result["latencies"]
    return np.asarray([v for v in values if v is not None], dtype=float) * 1000.0


def throughput_series(result: dict, bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bin starts (s), output tokens/s and completed requests/s per bin over the run. A last bin
    shorter than half a bin is left out: divided by its own width it would be mostly noise."""
    tokens = Counter()
    for t, n in token_times(result):
        tokens[int(t // bin_s)] += n
    done = Counter(int((s + lat) // bin_s) for s, lat in zip(result["start_times"], result["latencies"])
                   if lat is not None)
    duration = max(result["duration"], 1e-9)
    bins = int(np.ceil(duration / bin_s))
    if bins > 1 and duration - (bins - 1) * bin_s < bin_s / 2:
        bins -= 1
    x = np.arange(bins) * bin_s
    width = np.minimum(bin_s, duration - x)
    return x, np.array([tokens[i] for i in range(bins)]) / width, np.array([done[i] for i in range(bins)]) / width


def plot_results(results: dict[str, dict], out_dir: str | Path) -> list[Path]:
    """Writes ttft_cdf.png, tpot_cdf.png, itl_cdf.png, e2el_cdf.png and throughput.png."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, title in CDFS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, result in results.items():
            v = np.sort(latency_values_ms(result, metric))
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{label} (n={len(v)})")
        ax.set(xlabel=f"{title} (ms)", ylabel="fraction of requests" if metric != "itl" else "fraction of gaps",
               title=f"{title} CDF", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        paths.append(_save(fig, out / f"{metric}_cdf.png", plt))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for label, result in results.items():
        x, tok, req = throughput_series(result)
        top.plot(x, tok, drawstyle="steps-post", label=label)
        bottom.plot(x, req, drawstyle="steps-post", label=label)
    top.set(ylabel="output tokens/s", title="Throughput over time (1 s bins)")
    bottom.set(xlabel="time since the run's start (s)", ylabel="completed requests/s")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    paths.append(_save(fig, out / "throughput.png", plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
