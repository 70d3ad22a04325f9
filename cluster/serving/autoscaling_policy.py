"""Serve's side of pool autoscaling: the deployment options that plug `cluster.serving.autoscaling.decide`
into Ray Serve's custom autoscaling policy API, and the policy class Serve's controller runs.

How the numbers flow: each engine replica answers Serve's `record_autoscaling_stats()` with its
`ReplicaMetrics` (cluster/serving/replica.py) every `metrics_interval_s`; Serve averages each replica's
reports over `look_back_period_s` and calls `PoolAutoscalingPolicy(ctx)` every control-loop turn
(0.1 s) with those averages per replica. The decision (and its timers) is `decide`'s alone: Serve's
own up/down delays are set to 0 here so they do not add to pdserve's.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from cluster.config import AutoscalingOptions
from cluster.serving.autoscaling import ReplicaMetrics, ScalingState, decide

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

log = logging.getLogger("ray.serve")  # the controller's log: decisions show up beside Serve's own

POLICY_PATH = "cluster.serving.autoscaling_policy:PoolAutoscalingPolicy"


def serve_autoscaling_config(pool: str, opts: AutoscalingOptions) -> dict:
    """A Serve `autoscaling_config` that runs pdserve's policy for `pool`."""
    return {
        "min_replicas": opts.min_replicas,
        "max_replicas": opts.max_replicas,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "look_back_period_s": opts.look_back_period_s,
        "metrics_interval_s": opts.metrics_interval_s,
        "policy": {"policy_function": POLICY_PATH,
                   "policy_kwargs": {"pool": pool, "options": opts.model_dump()}},
    }


def replica_metrics(aggregated: dict[str, dict], running_replicas) -> list[ReplicaMetrics]:
    """Serve's per-metric averages ({metric: {replica: value}}) as one ReplicaMetrics per running
    replica that has reported (a starting replica has not yet)."""
    reported = aggregated.get("kv_usage", {})
    return [ReplicaMetrics.from_mapping({name: per_replica[rid] for name, per_replica in aggregated.items()
                                         if rid in per_replica})
            for rid in running_replicas if rid in reported]


def _value(v) -> float | None:
    """Serve passes some context fields as values, some as callables evaluated on demand."""
    v = v() if callable(v) else v
    return None if v is None else float(v)


class PoolAutoscalingPolicy:
    """Built once per deployment by Serve's controller (with `policy_kwargs`), then called every
    control-loop turn. Stateless between calls: the timers travel in Serve's `policy_state`."""

    def __init__(self, pool: str, options: dict):
        self.pool = pool
        self.options = AutoscalingOptions.model_validate(options)

    def __call__(self, ctx: "AutoscalingContext") -> tuple[int, dict]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        decision = decide(
            self.pool, replica_metrics(ctx.aggregated_metrics or {}, ctx.running_replicas),
            ctx.target_num_replicas, now, ScalingState.from_dict(ctx.policy_state), self.options,
            ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas,
            requests=_value(ctx.total_num_requests),
        )
        if decision.replicas != ctx.target_num_replicas:
            log.info("pdserve %s pool: %s", self.pool, decision.reason)
        return decision.replicas, decision.state.as_dict()
