"""What the simulator answers: latency distributions, goodput against the SLO, utilisation."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.planner.config import ClusterConfig


@dataclass(frozen=True)
class Dist:
    """Percentiles of a sample (seconds)."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> "Dist":
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        v = sorted(values)
        return cls(len(v), sum(v) / len(v), percentile(v, 50), percentile(v, 90), percentile(v, 99), v[-1])


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class Trend:
    """A request's latency (arrival -> last token) through a trace: the median over the first
    third of the requests by arrival, and the last third's median minus it. A configuration that
    keeps up has no trend (its queues empty again); one that cannot has its queues grow through the
    trace, and with them every later request's latency: the growth. It is judged not to keep up
    when the growth exceeds half the first third's median (the noise of a stable load's thirds
    stays well under it; a queue that grows does not). Fewer than 6 requests: no judgement."""

    early_s: float
    growth_s: float

    @property
    def keeps_up(self) -> bool:
        return self.growth_s <= 0.5 * self.early_s

    @classmethod
    def of(cls, arrivals: list[float], latencies: list[float | None]) -> "Trend | None":
        """Per request in any order: arrival and latency (None: not completed, left out)."""
        order = [lat for _, lat in sorted((a, lat) for a, lat in zip(arrivals, latencies) if lat is not None)]
        third = len(order) // 3
        if third < 2:
            return None
        early = percentile(sorted(order[:third]), 50)
        return cls(early, percentile(sorted(order[-third:]), 50) - early)

    def text(self) -> str:
        verdict = "keeps up" if self.keeps_up else "CANNOT KEEP UP (its queues grow through the trace)"
        return f"latency first third p50 {self.early_s:.2f} s, last third {self.growth_s:+.2f} s: {verdict}"


@dataclass(frozen=True)
class SimResult:
    config: ClusterConfig
    requests: int
    completed: int
    duration_s: float  # first arrival to last completion
    ttft: Dist
    tpot: Dist
    itl: Dist
    slo_met: int
    preemptions: int
    remote: int
    local: int
    utilisation: dict  # pool -> busy time / (replicas x duration)
    transfer_s: float  # total KV transfer time
    step_lookups_clamped: int  # step times read below a curve's first point (over-estimates)
    flips: tuple = ()  # (when, replica, new pool, reason) of each run-time move that completed
    trend: "Trend | None" = None  # latency through the trace: whether the configuration kept up

    @property
    def keeps_up(self) -> bool:
        return self.trend is None or self.trend.keeps_up

    @property
    def attainment(self) -> float:
        return self.slo_met / self.requests if self.requests else 0.0

    @property
    def goodput(self) -> float:
        """Requests/s that met the SLO (vLLM's definition: over the run's duration)."""
        return self.slo_met / self.duration_s if self.duration_s > 0 else 0.0
