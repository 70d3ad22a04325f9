"""The simulator against real runs: the same trace and configuration, measured and simulated.

A real run is a `pdserve bench` result file (per-request arrays); a simulated one a `SimResult`.
Both are reduced to the same five figures with the same definitions:

    TTFT p50 / p90   arrival (the request sent) -> first token, completed requests
    TPOT p50 / p90   (last token - first token) / (output tokens - 1), requests with >= 2 tokens
    goodput          requests meeting TTFT <= slo.ttft and TPOT <= slo.tpot, per second of
                     first arrival -> last completion (a failed request meets nothing)

Percentiles interpolate linearly between closest ranks (numpy's default, `outcome.percentile`).
A case may hold several real runs of the same trace and configuration: its real figure is then each
metric's median over them, and `noise()` says how far single runs lie from that median (a floor
under any model's error against one run). The error of one figure is |simulated - real| / real, in
percent; a metric's MAPE is its mean over the cases. A `Validation` is saved as JSON and read back by `pdserve plan --validation FILE`, which
prints the MAPE with its answer and widens its predicted figures by it.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from cluster.planner.config import SLO
from cluster.planner.outcome import SimResult, percentile
from cluster.planner.workload import RequestSpec

FORMAT = "pdserve-validation/1"
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "goodput")
LABELS = {"ttft_p50": "TTFT p50", "ttft_p90": "TTFT p90", "tpot_p50": "TPOT p50", "tpot_p90": "TPOT p90",
          "goodput": "goodput"}


@dataclass(frozen=True)
class Metrics:
    """The five compared figures (seconds; goodput in requests/s)."""

    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float
    goodput: float

    @classmethod
    def of_sim(cls, r: SimResult) -> "Metrics":
        return cls(r.ttft.p50, r.ttft.p90, r.tpot.p50, r.tpot.p90, r.goodput)

    @classmethod
    def of_requests(cls, arrivals: Sequence[float], ttfts: Sequence[float | None],
                    latencies: Sequence[float | None], outputs: Sequence[int], slo: SLO) -> "Metrics":
        """Per request: arrival (s), TTFT and end-to-end latency from it (None: not completed), tokens."""
        done = [i for i, lat in enumerate(latencies) if lat is not None and ttfts[i] is not None]
        ttft = sorted(ttfts[i] for i in done)
        tpot_of = {i: (latencies[i] - ttfts[i]) / (outputs[i] - 1) for i in done if outputs[i] > 1}
        tpot = sorted(tpot_of.values())
        met = sum(1 for i in done if ttfts[i] <= slo.ttft_s and tpot_of.get(i, 0.0) <= slo.tpot_s)
        span = max((arrivals[i] + latencies[i] for i in done), default=0.0) - min(arrivals, default=0.0)

        def pct(v, q):
            return percentile(v, q) if v else math.nan

        return cls(pct(ttft, 50), pct(ttft, 90), pct(tpot, 50), pct(tpot, 90), met / span if span > 0 else 0.0)

    @classmethod
    def median(cls, runs: Sequence["Metrics"]) -> "Metrics":
        """Each metric's median over several runs (the mean of the middle two for an even count)."""
        if not runs:
            raise ValueError("no runs")
        return cls(*(statistics.median(getattr(r, m) for r in runs) for m in METRICS))

    @classmethod
    def of_bench(cls, result: dict, slo: SLO) -> "Metrics":
        """A `pdserve bench` result file's per-request arrays (failed or cut-off requests: not completed)."""
        ok = [s == "ok" for s in result["statuses"]]
        return cls.of_requests(result["start_times"], [t if g else None for t, g in zip(result["ttfts"], ok)],
                               [t if g else None for t, g in zip(result["latencies"], ok)],
                               result["output_lens"], slo)


def ape(real: float, sim: float) -> float:
    """Absolute percentage error of sim against real; inf when real is 0 and sim is not."""
    if real == sim:
        return 0.0
    return abs(sim - real) / abs(real) * 100 if real else math.inf


@dataclass(frozen=True)
class WorkloadRange:
    """What a validated trace spans: a plan's trace beyond it is not covered by the error figures."""

    name: str
    requests: int
    rate: float  # requests/s over the trace
    prompt_max: int
    output_max: int

    @classmethod
    def of(cls, name: str, specs: Sequence[RequestSpec]) -> "WorkloadRange":
        span = specs[-1].arrival_s - specs[0].arrival_s
        return cls(name, len(specs), (len(specs) - 1) / span if span > 0 else math.inf,
                   max(s.prompt_tokens for s in specs), max(s.output_tokens for s in specs))


@dataclass(frozen=True)
class Case:
    """One configuration on one workload, real and simulated. `client` holds what the load generator
    said of itself (cores busy, p99 send lag, kept its schedule) and `cpu` the CPU seconds per part
    of the cluster during the run: the conditions the real figures were taken under."""

    config: str
    workload: str
    slo: SLO  # the goodput's
    real: Metrics
    sim: Metrics
    completed: int
    requests: int
    client: dict
    cpu: dict
    runs: tuple[Metrics, ...] = ()  # every real run when there were several (`real` is their median)

    def errors(self) -> dict[str, float]:
        return {m: ape(getattr(self.real, m), getattr(self.sim, m)) for m in METRICS}

    def spread(self) -> dict[str, float]:
        """Per metric, the mean error of a single real run against the runs' median (0 with one run)."""
        if len(self.runs) < 2:
            return {m: 0.0 for m in METRICS}
        return {m: sum(ape(getattr(self.real, m), getattr(r, m)) for r in self.runs) / len(self.runs)
                for m in METRICS}


@dataclass(frozen=True)
class Validation:
    cases: tuple[Case, ...]
    workloads: tuple[WorkloadRange, ...]
    profile: dict  # model path, device, created: which profile priced the simulated arm
    created: str = ""

    def mape(self, workload: str | None = None) -> dict[str, float]:
        """Per metric, the mean absolute percentage error over the cases (of one workload if named)."""
        cases = [c for c in self.cases if workload is None or c.workload == workload]
        return {m: sum(c.errors()[m] for c in cases) / len(cases) if cases else math.nan for m in METRICS}

    def noise(self, workload: str | None = None) -> dict[str, float]:
        """Per metric, the cases' mean `spread()`: what a model exactly at the median would score
        against one run. Only cases with several runs count (nan when none has)."""
        cases = [c for c in self.cases if len(c.runs) > 1 and (workload is None or c.workload == workload)]
        return {m: sum(c.spread()[m] for c in cases) / len(cases) if cases else math.nan for m in METRICS}

    def covers(self, specs: Sequence[RequestSpec]) -> list[str]:
        """Why a plan's workload lies outside what was validated ([] when it lies inside)."""
        w = WorkloadRange.of("plan", specs)
        out = []
        if w.prompt_max > max(x.prompt_max for x in self.workloads):
            out.append(f"prompts up to {w.prompt_max} tokens (validated: up to "
                       f"{max(x.prompt_max for x in self.workloads)})")
        if w.output_max > max(x.output_max for x in self.workloads):
            out.append(f"outputs up to {w.output_max} tokens (validated: up to "
                       f"{max(x.output_max for x in self.workloads)})")
        return out

    @classmethod
    def merged(cls, parts: Sequence["Validation"]) -> "Validation":
        """Several runs' cases as one validation (they must share a profile)."""
        if len({json.dumps(v.profile, sort_keys=True) for v in parts}) > 1:
            raise ValueError("validations made with different profiles cannot be merged")
        workloads = {w.name: w for v in parts for w in v.workloads}
        return cls(tuple(c for v in parts for c in v.cases), tuple(workloads.values()), parts[0].profile,
                   max(v.created for v in parts))

    def same_profile(self, profile_created: str, model_path: str | None) -> bool:
        return self.profile.get("created") == profile_created and self.profile.get("path") == model_path

    def bands(self, r: SimResult) -> dict[str, tuple[float, float, float]]:
        """Per metric, a simulated result's figure and the real range its metric's MAPE allows."""
        sim, mape = Metrics.of_sim(r), self.mape()
        return {m: (getattr(sim, m), *band(getattr(sim, m), mape[m])) for m in METRICS}

    def table(self) -> list[str]:
        """The report: per case and metric real, simulated and error; then the MAPE per metric."""
        lines = [f"{'configuration':<30} {'workload':<10} {'metric':<9} {'real':>9} {'simulated':>10} {'error':>8}"]
        for c in self.cases:
            err = c.errors()
            for m in METRICS:
                runs = (f"  {len(c.runs)} runs: " + " ".join(_fmt(m, getattr(r, m)) for r in c.runs)
                        if len(c.runs) > 1 else "")
                lines.append(f"{c.config:<30} {c.workload:<10} {LABELS[m]:<9} {_fmt(m, getattr(c.real, m)):>9} "
                             f"{_fmt(m, getattr(c.sim, m)):>10} {err[m]:7.1f}%{runs}")
        names = [w.name for w in self.workloads]
        for name in (names if len(names) > 1 else []) + [None]:
            n = sum(1 for c in self.cases if name is None or c.workload == name)
            lines.append(f"MAPE over {n} {name + ' ' if name else ''}cases: " + ", ".join(
                f"{LABELS[m]} {v:.1f}%" for m, v in self.mape(name).items()))
        if any(len(c.runs) > 1 for c in self.cases):
            n = sum(1 for c in self.cases if len(c.runs) > 1)
            lines.append(f"real runs against their median ({n} cases with several runs; a floor for the MAPE): "
                         + ", ".join(f"{LABELS[m]} {v:.1f}%" for m, v in self.noise().items()))
        return lines

    def to_json(self) -> dict:
        return {"format": FORMAT, "cases": [asdict(c) for c in self.cases],
                "workloads": [asdict(w) for w in self.workloads],
                "profile": self.profile, "created": self.created, "mape": self.mape(),
                **({"noise": self.noise()} if any(len(c.runs) > 1 for c in self.cases) else {})}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, d: dict) -> "Validation":
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file (format={d.get('format')!r})")
        cases = tuple(Case(c["config"], c["workload"], SLO(**c["slo"]), Metrics(**c["real"]), Metrics(**c["sim"]),
                           c["completed"], c["requests"], c["client"], c["cpu"],
                           tuple(Metrics(**r) for r in c.get("runs", ()))) for c in d["cases"])
        return cls(cases, tuple(WorkloadRange(**w) for w in d["workloads"]), d["profile"], d.get("created", ""))

    @classmethod
    def load(cls, path: str | Path) -> "Validation":
        return cls.from_json(json.loads(Path(path).read_text()))


def _fmt(metric: str, v: float) -> str:
    return f"{v:.2f}/s" if metric == "goodput" else f"{v * 1e3:.0f} ms"


def band(sim: float, error_pct: float) -> tuple[float, float]:
    """The real values a simulated figure stands for, were it off by error_pct (|sim - real| / real):
    [sim / (1 + e), sim / (1 - e)], unbounded above when e >= 100%."""
    e = error_pct / 100
    return sim / (1 + e), (sim / (1 - e) if e < 1 else math.inf)
