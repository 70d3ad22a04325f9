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

    @property
    def attainment(self) -> float:
        return self.slo_met / self.requests if self.requests else 0.0

    @property
    def goodput(self) -> float:
        """Requests/s that met the SLO (vLLM's definition: over the run's duration)."""
        return self.slo_met / self.duration_s if self.duration_s > 0 else 0.0
