"""One load model: what a replica's load report (`router.policy.ReplicaLoad`), or an ingress's own
measurements, mean to every controller. The router's policy (a decision's queue wait), the
ingress's capacity stage (its first-token queue), the run-time planner (each pool's pressure, its
donor) and the pools' autoscaling signals all read these functions; none keeps a predictor of its own
(tests/router/test_load_model.py holds them to it).

    queue wait of a new prompt of n tokens = (prompt tokens ahead of it + n) / the rate they drain at

- **Prompt tokens ahead** on a replica: its waiting requests' uncached tokens *and* the part of its
  running prompts not computed yet. A prefill replica whose every request runs (chunked prefill
  admits them) has none waiting: counted on waiting ones alone, a saturated pool read a wait of 0.
- **The rate** is measured in whole prompts (cache hits fold into it, as they fold into the queue's
  count) over busy time only, by a `RateMeter`: unknown until `warm` samples, then the largest of
  them (a first sample times a fresh process's own warm-up: 0.7 tokens/s where the pools ran 270),
  then smoothed. Per-request costs are in it: 2-token prompts that cost 20 ms each drain at 100
  tokens/s, so k of them ahead wait k x 20 ms. A flip resets it (the old role's pace says nothing
  of the new one); a replica without a rate of its own is priced at its pool's median, with no
  samples behind the estimate: unknown is not idle.
- **Uncertainty**: every estimate carries the samples behind it (`Estimate.samples`); with none it
  is a prior (the pool's), and with none at all there is no estimate (None), which no controller
  reads as "no load".
- **Busy fraction**: the share of recent time a replica's engine spent in steps, as it reports it;
  a replica that has not reported one is busy while it holds work. **KV headroom**: the share of
  its blocks free (cached-but-free blocks are free). **Decode headroom**: how far its step time is
  under a target interval (1 - step / target; negative: over).

Plain Python: no Ray, no clock of its own.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Protocol, Sequence


class ReplicaLoad(Protocol):
    """What the model reads of a load report (router.policy.ReplicaLoad, which imports this module)."""

    free_blocks: int
    total_blocks: int
    running: int
    queued_prefill_tokens: int
    running_prompt_tokens: int
    step_time_s: float
    tokens_per_s: float
    rate_samples: int
    busy_fraction: float | None

    @property
    def requests(self) -> int: ...


@dataclass(frozen=True)
class Estimate:
    """A measured quantity and the samples behind it (0: a prior borrowed from the pool)."""

    value: float
    samples: int

    def spread(self) -> float:
        """Relative uncertainty, ~1/sqrt(samples) (inf for a prior): a controller acting on few
        samples may ask for a margin; none of today's does more than report it."""
        return math.inf if self.samples <= 0 else 1.0 / math.sqrt(self.samples)


class RateMeter:
    """A rate from samples: unknown (None) until `warm` samples were taken, then the largest of
    them, then each later sample smoothed in by `alpha` (one stall moves it by at most alpha)."""

    def __init__(self, alpha: float = 0.3, warm: int = 1):
        self.alpha, self.warm = alpha, max(1, warm)
        self.reset()

    def reset(self) -> None:
        """Forget every sample (a role flip: the old role's pace says nothing of the new)."""
        self.value: float | None = None
        self.samples = 0
        self._first: list[float] = []

    def add(self, sample: float) -> None:
        self.samples += 1
        if self.value is not None:
            self.value = (1 - self.alpha) * self.value + self.alpha * sample
            return
        self._first.append(sample)
        if len(self._first) >= self.warm:
            self.value, self._first = max(self._first), []

    def estimate(self) -> Estimate | None:
        return None if self.value is None else Estimate(self.value, self.samples)


def queue_wait_s(tokens_ahead: float, rate: Estimate | float | None, n: int = 0) -> float | None:
    """Seconds before a new prompt of `n` tokens has its first token behind `tokens_ahead` (n = 0:
    before it starts). 0 with nothing ahead and n = 0; None when there is work and no rate."""
    work = tokens_ahead + n
    if work <= 0:
        return 0.0
    value = rate.value if isinstance(rate, Estimate) else rate
    return None if not value else work / value


def request_floor_s(mean_prompt_tokens: float | None, rate: float | None) -> float | None:
    """One request's own prompt time at the measured pace: the wait a request behind one other
    expects (per-request costs are in the rate, measured over whole requests)."""
    return mean_prompt_tokens / rate if rate and mean_prompt_tokens else None


def tokens_ahead(r: ReplicaLoad) -> int:
    """Prompt tokens a new prompt waits behind on r: queued and still running."""
    return r.queued_prefill_tokens + r.running_prompt_tokens


def pool_rate(pool: Sequence[ReplicaLoad]) -> float | None:
    """The pool's median measured rate (replicas without one left out); None if none measured."""
    measured = [r.tokens_per_s for r in pool if r.tokens_per_s > 0]
    return statistics.median(measured) if measured else None


def replica_rate(r: ReplicaLoad, pool: Sequence[ReplicaLoad] = ()) -> Estimate | None:
    """r's own rate, or (none measured: fresh, or just flipped) its pool's median as a prior."""
    if r.tokens_per_s > 0:
        return Estimate(r.tokens_per_s, max(1, r.rate_samples))
    prior = pool_rate(pool)
    return None if prior is None else Estimate(prior, 0)


def replica_queue_wait_s(r: ReplicaLoad, pool: Sequence[ReplicaLoad] = (), n: int = 0) -> float | None:
    """The wait on r (its pool: for a prior rate) before a new prompt of n tokens starts (n = 0)
    or has its first token; None: work and no rate anywhere in the pool."""
    return queue_wait_s(tokens_ahead(r), replica_rate(r, pool), n)


def pool_queue_wait(pool: Sequence[ReplicaLoad]) -> tuple[float | None, int, float]:
    """The pool as one queue: (its wait, the prompt tokens ahead, the rate they drain at), each
    replica at its own rate or, unmeasured, the pool's median. Wait None: work ahead, no rate."""
    ahead = sum(tokens_ahead(r) for r in pool)
    rates = [replica_rate(r, pool) for r in pool]
    rate = sum(e.value for e in rates if e is not None)
    return queue_wait_s(ahead, rate), ahead, rate


def busy_fraction(r: ReplicaLoad) -> float:
    """The share of recent time r spent in steps, as reported; unreported: busy while it holds work."""
    if r.busy_fraction is not None:
        return r.busy_fraction
    return 1.0 if r.requests or tokens_ahead(r) else 0.0


def pool_busy_fraction(pool: Sequence[ReplicaLoad]) -> float:
    return sum(busy_fraction(r) for r in pool) / len(pool) if pool else 0.0


def kv_usage(free_blocks: int, total_blocks: int) -> float:
    """The share of blocks held (cached-but-free blocks are free); 0 for a pool of none."""
    return 1.0 - free_blocks / total_blocks if total_blocks else 0.0


def kv_headroom(pool: Sequence[ReplicaLoad]) -> float:
    """The share of the pool's blocks free."""
    return 1.0 - kv_usage(sum(r.free_blocks for r in pool), sum(r.total_blocks for r in pool))


def decode_step_s(pool: Sequence[ReplicaLoad]) -> float:
    """The median step of the pool's replicas that run streams (0: none measured)."""
    steps = [r.step_time_s for r in pool if r.step_time_s > 0 and r.running > 0]
    return statistics.median(steps) if steps else 0.0


def decode_headroom(pool: Sequence[ReplicaLoad], target_s: float) -> float:
    """How far the pool's step is under `target_s` (1: idle, 0: at it, negative: over)."""
    return 1.0 - decode_step_s(pool) / target_s


class BusyMeter:
    """The busy fraction a replica reports: its busy seconds over the wall seconds between reports,
    decayed with `tau_s` (an idle second counts as much as a busy one)."""

    def __init__(self, tau_s: float = 2.0):
        self.tau_s = tau_s
        self.reset()

    def reset(self) -> None:
        self.value: float | None = None
        self._mark: tuple[float, float] | None = None  # (busy seconds, now) at the last update

    def update(self, busy_s: float, now: float) -> float | None:
        if self._mark is None:
            self._mark = (busy_s, now)
            return self.value
        busy0, t0 = self._mark
        dt = now - t0
        if dt <= 0:
            return self.value
        share = min(1.0, max(0.0, (busy_s - busy0) / dt))
        w = math.exp(-dt / self.tau_s)
        self.value = share if self.value is None else w * self.value + (1 - w) * share
        self._mark = (busy_s, now)
        return self.value
