"""Pool autoscaling as one pure decision: a pool's replica metrics, its size and the time in; the
number of replicas it should have out (no Ray, no clock: Serve's adapter is
`cluster/serving/autoscaling_policy.py`, the tests feed crafted inputs).

Each pool scales on its own signals, because each pool runs out of something different:

- prefill runs out of compute: prompt tokens queue up and time to first token (TTFT) grows;
- decode runs out of KV memory and of step time: KV blocks fill up and the interval between a
  request's tokens (ITL) grows.

A signal's *load* is the sum over the pool's replicas of metric / target: the number of replicas
that would each sit exactly at the target (2.4 = "2.4 replicas' worth"). The pool's load is its
highest signal's. Then:

- **scale up, fast**: load needs more replicas than the pool has (`ceil(load) > replicas`),
  continuously for `upscale_delay_s` → go straight to `ceil(load)`;
- **scale down, slowly**: the pool would stay below `downscale_threshold` of every target with
  one replica fewer (`load < threshold × (replicas - 1)`), continuously for `downscale_delay_s` →
  remove `downscale_step` replicas (never so many that the rest would exceed the threshold); the
  next removal waits a whole delay from this one;
- **hold** in between. The band is the hysteresis: after a scale-down the load per replica is
  below the threshold (< 1, so no scale-up follows), and after a scale-up it is above
  `ceil(load) - 1` replicas' worth (more than the threshold of one fewer, so no scale-down follows).

Replicas that have not reported yet (starting) do not count towards the load; with no report at
all the pool holds. The result is always within [min_replicas, max_replicas].

A pool with `min_replicas: 0` also sleeps: no request in it (Serve's count of requests running on
its replicas and queued at its callers' handles) for `idle_timeout_s` -> 0 replicas. Load never
takes it below one replica; Serve's own cold-start path wakes it (0 -> 1) when a request arrives.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Literal, Mapping, Sequence

from cluster.config import AutoscalingOptions
from router import load_model

Pool = Literal["prefill", "decode"]

# pool -> its signals: (metric a replica reports, the AutoscalingOptions field holding its target)
SIGNALS: dict[str, tuple[tuple[str, str], ...]] = {
    "prefill": (("queued_prefill_tokens", "target_queued_prefill_tokens"), ("ttft_s", "target_ttft_s")),
    "decode": (("kv_usage", "target_kv_usage"), ("itl_s", "target_itl_s")),
}

_EPS = 1e-9  # float sums of ratios: a load of exactly 2.0 must not round up to 3 replicas
_DELAY_EPS = 1e-6  # float clock differences: 120.1 - 60.1 must count as the 60 s it is


@dataclass(frozen=True)
class ReplicaMetrics:
    """What one replica reports each autoscaling period (Serve's `record_autoscaling_stats`).

    Every replica reports all four; each pool's policy reads its own two (`SIGNALS`)."""

    kv_usage: float = 0.0  # fraction of KV blocks held by requests (cached free blocks are free)
    queued_prefill_tokens: float = 0.0  # prompt tokens ahead of a new prompt: waiting, and running not computed yet
    ttft_s: float = 0.0  # mean time to first output since the last report, or the oldest wait if longer
    itl_s: float = 0.0  # mean interval between consecutive token-producing steps since the last report

    @classmethod
    def of(cls, load, ttft_s: float, itl_s: float) -> "ReplicaMetrics":
        """A replica's signals from its engine's load (`EngineLoad`), read through the load model
        (router/load_model.py) as the router and the planner read it: the prompt tokens ahead
        include running prompts' uncomputed part (a saturated prefill replica whose requests all
        run has none waiting), the KV usage counts cached-but-free blocks as free."""
        return cls(kv_usage=load_model.kv_usage(load.free_blocks, load.total_blocks),
                   queued_prefill_tokens=float(load_model.tokens_ahead(load)), ttft_s=ttft_s, itl_s=itl_s)

    @classmethod
    def from_mapping(cls, values: Mapping[str, float]) -> "ReplicaMetrics":
        return cls(**{f.name: float(values[f.name]) for f in fields(cls) if f.name in values})

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class ScalingState:
    """Carried from one decision to the next: since when the pool has needed more replicas, or
    could have done with fewer (None: not now)."""

    pressure_since: float | None = None
    slack_since: float | None = None
    idle_since: float | None = None  # a pool that may sleep: since when no request was in it

    KEYS = ("pdserve_pressure_since", "pdserve_slack_since", "pdserve_idle_since")

    @classmethod
    def from_dict(cls, state: Mapping) -> "ScalingState":
        return cls(*(state.get(k) for k in cls.KEYS))

    def as_dict(self) -> dict:
        return dict(zip(self.KEYS, (self.pressure_since, self.slack_since, self.idle_since)))


@dataclass(frozen=True)
class PoolLoad:
    load: float  # replicas' worth of work at the targets, by the pool's highest signal
    signal: str  # which signal that is
    mean: float  # that signal's mean over the reporting replicas


@dataclass(frozen=True)
class Decision:
    replicas: int
    state: ScalingState
    reason: str


def pool_load(pool: Pool, metrics: Sequence[ReplicaMetrics], opts: AutoscalingOptions) -> PoolLoad:
    """The pool's load: for each of its signals, sum over replicas of metric / target; the highest."""
    best = None
    for metric, target_field in SIGNALS[pool]:
        values = [getattr(m, metric) for m in metrics]
        load = sum(values) / getattr(opts, target_field)
        if best is None or load > best.load:
            best = PoolLoad(load, metric, sum(values) / len(values))
    return best


def decide(
    pool: Pool,
    metrics: Sequence[ReplicaMetrics],
    replicas: int,
    now: float,
    state: ScalingState,
    opts: AutoscalingOptions,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    requests: float | None = None,
) -> Decision:
    """How many replicas `pool` should have now.

    `metrics`: one entry per replica that has reported (possibly fewer than `replicas`);
    `replicas`: the pool's current target size; `now`: seconds on any clock that `state` also
    uses; `min_replicas`/`max_replicas`: bounds overriding the options' (Serve narrows them
    under a target capacity); `requests`: the requests in the pool now, running or queued
    (a pool with min_replicas 0 sleeps after idle_timeout_s of none; None: unknown, never sleeps).
    """
    lo = opts.min_replicas if min_replicas is None else min_replicas
    if opts.min_replicas > 0 or requests is None:
        return _by_load(pool, metrics, replicas, now, state, opts, lo, max_replicas)
    if replicas == 0:
        return Decision(1 if requests > 0 else 0, ScalingState(),
                        f"{requests:g} requests wait: waking, 0 -> 1" if requests > 0 else "asleep")
    idle_since = None if requests > 0 else now if state.idle_since is None else state.idle_since
    if idle_since is not None and now - idle_since + _DELAY_EPS >= opts.idle_timeout_s:
        return Decision(0, ScalingState(), f"no request for {now - idle_since:.1f}s: {replicas} -> 0 (asleep)")
    d = _by_load(pool, metrics, replicas, now, state, opts, max(lo, 1), max_replicas)  # load never sleeps a pool
    return Decision(d.replicas, replace(d.state, idle_since=idle_since), d.reason)


def _by_load(pool: Pool, metrics: Sequence[ReplicaMetrics], replicas: int, now: float, state: ScalingState,
             opts: AutoscalingOptions, lo: int, max_replicas: int | None) -> Decision:
    hi = opts.max_replicas if max_replicas is None else max_replicas
    if replicas < lo:
        return Decision(lo, ScalingState(), f"{replicas} replicas is below the minimum: {replicas} -> {lo}")
    if replicas > hi:
        return Decision(hi, ScalingState(), f"{replicas} replicas is above the maximum: {replicas} -> {hi}")
    if not metrics:
        return Decision(replicas, ScalingState(), "no replica has reported yet")

    p = pool_load(pool, metrics, opts)
    what = f"{p.signal} {p.mean:.3g} per replica ({p.load:.2f} replicas' worth)"
    needed = math.ceil(p.load - _EPS)
    if needed > replicas:
        if replicas >= hi:
            return Decision(replicas, ScalingState(), f"{what}: at the maximum")
        since = now if state.pressure_since is None else state.pressure_since
        if now - since + _DELAY_EPS >= opts.upscale_delay_s:
            target = min(hi, needed)
            return Decision(target, ScalingState(), f"{what} for {now - since:.1f}s: {replicas} -> {target}")
        return Decision(replicas, ScalingState(pressure_since=since), f"{what}: waiting to scale up")

    if replicas > lo and p.load < opts.downscale_threshold * (replicas - 1):
        since = now if state.slack_since is None else state.slack_since
        if now - since + _DELAY_EPS >= opts.downscale_delay_s:
            fewest = math.floor(p.load / opts.downscale_threshold) + 1  # smallest n with load < threshold·n
            target = max(lo, replicas - opts.downscale_step, fewest)
            # the next removal waits a whole delay from this one
            return Decision(target, ScalingState(slack_since=now), f"{what} for {now - since:.1f}s: {replicas} -> {target}")
        return Decision(replicas, ScalingState(slack_since=since), f"{what}: waiting to scale down")

    return Decision(replicas, ScalingState(), f"{what}: within the band")
