"""When sessions start: an open-loop arrival process, or a trace's own timestamps.

Gaps between arrivals are gamma-distributed with shape `burstiness` and mean 1/rate (vLLM's
convention): burstiness 1 is a Poisson process, below 1 arrivals come in bursts (coefficient of
variation 1/sqrt(burstiness) > 1), above 1 they are more regular, and infinity is a fixed gap.
An infinite rate sends everything at once (a closed loop, with `--max-concurrency` as its cap).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from cluster.tools.loadgen.datasets import Session


def arrival_offsets(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Start times (s from the run's start) of n arrivals; the first comes one gap after 0."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {request_rate}, {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    return [float(t) for t in np.cumsum(gaps)]


def session_offsets(sessions: Sequence[Session], request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> list[float]:
    """The sessions' own times where they carry them (trace replay), else the arrival process."""
    if sessions and all(s.arrival_s is not None for s in sessions):
        return [s.arrival_s for s in sessions]
    return arrival_offsets(len(sessions), request_rate, burstiness, rng)
