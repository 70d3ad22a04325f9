"""A replica's reports, as a hook of its engine loop (cluster/engine/loop.py): block events and
load to the router (one feed call at a time, router/events.py), load to the registry (for
`pdserve status`), and the autoscaling signals.
It observes the engine through its verbs (`load()`, `drain_block_events()`); it wraps nothing."""

from __future__ import annotations

from dataclasses import asdict

from cluster.engine.latency import TokenIntervals
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import EngineLoad
from cluster.serving.autoscaling import ReplicaMetrics
from kv_transfer.stats import TransferStats
from router.events import RouterFeed
from router.load_model import BusyMeter, RateMeter
from router.policy import ReplicaLoad

WARMUP_STEPS = 20  # a replica's first steps carry one-time costs: not a slow-replica signal
# A replica whose last step failed is reported failing (the router avoids it) for this long; then it
# gets requests again: a step that runs clears it, one that fails counts towards its health check.
FAILING_HOLD_S = 5.0


class LoadReporter:
    """`registry`: a RayMetadataStore (its `report()` is fire-and-forget); `router`: the router actor."""

    def __init__(self, engine: LLMEngine, transfer_stats: TransferStats, replica_id: str, pool: str,
                 registry, router=None, node_id: str | None = None, interval_s: float = 1.0,
                 router_interval_s: float = 0.25, router_min_interval_s: float = 0.02, group: str = ""):
        """`router_min_interval_s`/`router_interval_s`: the feed's least and most time between
        calls (router/events.py)."""
        self.engine = engine
        self.group = group  # the model version (AppConfig.serving_group): the router routes within it
        self.transfer_stats = transfer_stats
        self.replica_id = replica_id
        self.role = pool  # the part it plays now (`flipped` changes it)
        self.deployment = pool  # the Serve deployment it lives in: never changes
        self.draining = False  # a role flip is draining it: the router chooses it for nothing
        self.node_id = node_id  # the Ray node this replica runs on (`pdserve status` shows it)
        self.registry = registry
        self.feed = None if router is None else RouterFeed(
            replica_id, engine, router, lambda now: self.replica_load(self.engine.load(), now),
            min_interval_s=router_min_interval_s, max_interval_s=router_interval_s)
        self.interval_s = interval_s
        self._next = 0.0
        self.rate = RateMeter(alpha=0.3)  # tokens a second while busy (router/load_model.py)
        self.busy = BusyMeter()
        self._tp_mark = (0, 0.0)  # (tokens_computed, busy_s) at the last throughput estimate
        self.token_intervals = TokenIntervals()

    def flipped(self, role: str) -> None:
        """Loop thread: it plays `role` from now on. Its estimators start again: the old role's
        throughput (a decode replica's tokens a second) and token intervals say nothing of the new
        one's; until it measures its own, the router prices it at its pool's median rate."""
        self.role, self.draining = role, False
        self.rate.reset()
        stats = self.engine.stats
        self._tp_mark = (stats.tokens_computed, stats.busy_s)
        self.token_intervals = TokenIntervals()

    # ---- LoopHook --------------------------------------------------------------------------

    def after_step(self, now: float) -> None:
        self.token_intervals.after_step(self.engine.stats.generation_tokens, now)

    def service(self, now: float, busy: bool) -> None:
        if not busy:
            self.token_intervals.idle()
        if self.feed is not None:
            # The router counts work it sent here until our next call, so the feed sends as soon as
            # the queues change. A request that came and went between two calls leaves the queues
            # as they were, but the router still counts it pending here: the count of requests
            # received tells those apart (an idle loop may not turn again for a long time).
            shape = self.engine.queue_shape()
            self.feed.publish(now, (*shape, self.engine.stats.requests_received), idle=not any(shape))
        if now >= self._next:
            self._next = now + self.interval_s
            self.registry.report(self.replica_id, self.report())

    def push(self, now: float):
        """Report now, off the schedule (a role flip: the router must see the pool or the drain
        at once). Loop thread only. Returns a concurrent Future that completes when the router
        has answered the feed call carrying it (None without a router)."""
        self.registry.report(self.replica_id, self.report())
        return None if self.feed is None else self.feed.push(now)

    # ---- what is reported ------------------------------------------------------------------

    def replica_load(self, load: EngineLoad, now: float) -> ReplicaLoad:
        stats = self.engine.stats
        failing = stats.consecutive_step_errors > 0 and now - stats.last_step_error_at < FAILING_HOLD_S
        return ReplicaLoad(self.replica_id, self.role, load.free_blocks, load.total_blocks,
                           load.running + load.importing, load.waiting, load.queued_prefill_tokens,
                           self._step_time(), self._throughput(), failing, self._pull_s_per_block(), self.group,
                           tuple(u.stats.load_s_per_block or 0.0 for u in self.engine.tier_usage()),
                           self.deployment, self.draining, load.running_prompt_tokens, self.rate.samples,
                           self.busy.update(stats.busy_s, now))

    def _pull_s_per_block(self) -> float:
        """Seconds per block of this replica's KV pulls so far (their fixed cost spread over their
        blocks): what the router weighs a block decode lacks by. 0 before the first pull."""
        t = self.transfer_stats
        return t.pull_seconds_sum / t.blocks_pulled if t.blocks_pulled else 0.0

    def _step_time(self) -> float:
        """The slow-replica signal, compared within a pool: a decode replica's smoothed time of a
        decode-only step, a prefill replica's smoothed seconds per prompt token. Neither moves
        when a replica is handed the long prompts (a mixed average did: the replica that had just
        computed a prompt, and so held its cache, looked slow and lost the next request for it).
        0 (not measured) during the first WARMUP_STEPS of that kind, whose one-time costs would
        mark a fresh replica slow."""
        st = self.engine.stats
        steps, value = ((st.prompt_steps, st.prompt_s_per_token_avg) if self.role == "prefill"
                        else (st.decode_steps, st.decode_step_s_avg))
        return value if steps >= WARMUP_STEPS else 0.0

    def _throughput(self) -> float:
        """Tokens a second while busy, smoothed over reports (0: none measured in this role): the
        load model's rate for this replica."""
        stats = self.engine.stats
        tokens, busy = stats.tokens_computed - self._tp_mark[0], stats.busy_s - self._tp_mark[1]
        if busy > 0.05:  # enough work since the last estimate to measure
            self.rate.add(tokens / busy)
            self._tp_mark = (stats.tokens_computed, stats.busy_s)
        return self.rate.value or 0.0

    def report(self, load: EngineLoad | None = None) -> dict:
        """The replica's load as `pdserve status` and the tests read it."""
        load = load or self.engine.load()
        stats = self.engine.stats
        return {
            "role": self.role, "deployment": self.deployment, "draining": self.draining, "node_id": self.node_id, **asdict(load),
            "requests_received": stats.requests_received,
            "last_step_ms": round(stats.last_step_s * 1e3, 3), "avg_step_ms": round(stats.step_s_avg * 1e3, 3),
            "steps": stats.steps, "step_errors": stats.step_errors, "generation_tokens": stats.generation_tokens, "preemptions": stats.preemptions,
            "tokens_computed": stats.tokens_computed, "cached_prompt_tokens": stats.cached_prompt_tokens,
            "speculative": {"proposed": stats.spec_proposed_tokens, "accepted": stats.spec_accepted_tokens,
                            "off": dict(stats.spec_off)},
            "transfer": asdict(self.transfer_stats),
            "kv_tiers": [asdict(u) for u in self.engine.tier_usage()],
            "router_feed": {} if self.feed is None else asdict(self.feed.stats),
        }

    def autoscaling_metrics(self, ttft_s: float) -> ReplicaMetrics:
        """This replica's autoscaling signals since the previous call (`ttft_s` comes from the
        loop, which sees streams start and produce)."""
        return ReplicaMetrics.of(self.engine.load(), ttft_s, self.token_intervals.drain())
