"""A prefill or decode replica's exporter: every `metrics_interval_s` (from the replica loop's
service turn, on the loop thread) it drains the engine's probe and plain counters into Ray's
metrics, and turns finished requests into phase spans. The engine step itself only appends plain
numbers (cluster/engine/probe.py); all Ray and OpenTelemetry calls happen here, batched.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from cluster.engine.probe import EngineProbe, ProbeBatch

from cluster.telemetry.metrics import engine_metrics
from cluster.telemetry.tracing import extract, make_tracer, record_span

if TYPE_CHECKING:
    from cluster.config import TelemetryOptions
    from cluster.engine.llm_engine import LLMEngine
    from cluster.engine.request import Request
    from kv_transfer.stats import TransferStats


class CounterSync:
    """Exports plain running totals as Ray counters: each flush adds what grew since the last."""

    def __init__(self):
        self._last: dict[tuple, float] = {}

    def sync(self, counter, tags: dict[str, str], total: float) -> None:
        key = (id(counter), *sorted(tags.items()))
        grew = total - self._last.get(key, 0)
        if grew > 0:
            counter.inc(grew, tags)
            self._last[key] = total


def phases(pool: str, req: "Request", end: float) -> list[tuple[str, float, float]]:
    """A finished request's phases on this engine, as (name, start, end) in monotonic time."""
    scheduled, first = req.first_scheduled_time, req.first_token_time
    if pool == "decode" and first is None and req.num_output_tokens > 0:  # its prompt was computed elsewhere
        started = scheduled if scheduled is not None else end
        spans = [("transfer", req.arrival_time, started)]
        return spans + ([("decode", started, end)] if scheduled is not None else [])
    spans = [("queue", req.arrival_time, scheduled if scheduled is not None else end)]
    if scheduled is not None:
        spans.append(("prefill", scheduled, first if first is not None else end))
    if pool == "decode" and first is not None and req.num_output_tokens > 1:
        spans.append(("decode", first, end))
    return spans


class ReplicaTelemetry:
    def __init__(self, options: "TelemetryOptions", engine: "LLMEngine", transfer: "TransferStats",
                 pool: str, replica_id: str, feed=None, replies=None):
        self.engine = engine
        self.feed = feed  # the replica's router feed (router/events.py): its calls' lags and outcomes
        self.replies = replies  # its connections to the ingresses (router/replies.py): legs by path
        self.transfer = transfer
        self.pool = pool
        self.interval_s = options.metrics_interval_s
        self.metrics = None
        if options.metrics:
            self.metrics = engine_metrics()
        self.tracer = make_tracer(options, f"pdserve-{pool}")
        self.tags = {"pool": pool, "replica": replica_id}
        self.replica_id = replica_id
        self.probe = EngineProbe()
        engine.probe = self.probe
        self._counters = CounterSync()
        self._next = 0.0

    # ---- LoopHook (cluster/engine/loop.py) ----------------------------------------------------

    def after_step(self, now: float) -> None:
        pass  # the engine's probe already recorded the step

    def service(self, now: float, busy: bool = True) -> None:
        """Called every loop turn; exports at most every interval."""
        if now >= self._next:
            self._next = now + self.interval_s
            self.flush()

    def flush(self) -> None:
        batch = self.probe.drain()
        if self.metrics is not None:
            self._export_metrics(batch)
        if self.tracer is not None:
            for req, end in batch.finished:
                if req.ctx.trace_context:
                    self._export_spans(req, end)

    # ---- metrics ------------------------------------------------------------------------------

    def _export_metrics(self, batch: ProbeBatch) -> None:
        m, tags = self.metrics, self.tags
        for seqs, tokens in batch.steps:
            m.batch_size.observe(seqs, tags)
            m.tokens_per_step.observe(tokens, tags)
        for interval in batch.inter_token_s:
            m.inter_token_latency.observe(interval, tags)
        queried = hit = 0
        for req, end in batch.finished:
            for name, start, stop in phases(self.pool, req, end):
                if name == "queue" and req.first_scheduled_time is not None:
                    m.queue_time.observe(stop - start, tags)
                elif name == "prefill" and req.first_token_time is not None:
                    m.prefill_time.observe(stop - start, tags)
                elif name == "transfer" and req.first_scheduled_time is not None:
                    m.kv_import_time.observe(stop - start, tags)
            if req.first_token_time is not None:  # its prompt was computed (and looked up) here
                queried += req.num_prompt_tokens
                hit += max(req.num_cached_tokens, 0)
        if queried:
            m.prefix_queried_tokens.inc(queried, tags)
        if hit:
            m.prefix_hit_tokens.inc(hit, tags)

        load = self.engine.load()
        m.kv_usage.set(load.kv_usage, tags)
        m.running.set(load.running + load.importing, tags)
        m.waiting.set(load.waiting, tags)

        stats, sync = self.engine.stats, self._counters.sync
        sync(m.computed_tokens, tags, stats.tokens_computed)
        sync(m.generated_tokens, tags, stats.generation_tokens)
        sync(m.preemptions, tags, stats.preemptions)
        for reason, n in stats.finished_by_reason.items():
            sync(m.finished, {**tags, "reason": reason}, n)
        sync(m.spec_proposed, tags, stats.spec_proposed_tokens)
        sync(m.spec_accepted, tags, stats.spec_accepted_tokens)
        sync(m.spec_proposer_seconds, tags, stats.spec_proposer_s)
        for reason, n in stats.spec_off.items():
            sync(m.spec_off, {**tags, "reason": reason}, n)
        t = asdict(self.transfer)
        sync(m.transfer_bytes, tags, t["bytes_pulled"])
        sync(m.transfer_blocks, {**tags, "kind": "pulled"}, t["blocks_pulled"])
        sync(m.transfer_blocks, {**tags, "kind": "reused"}, t["blocks_reused"])
        for result, field in (("ok", "pulls_ok"), ("failed", "pulls_failed"), ("timed_out", "pulls_timed_out"),
                              ("refused_lease", "pulls_refused_lease")):
            sync(m.transfer_pulls, {**tags, "result": result}, t[field])
        sync(m.transfer_pull_seconds, tags, t["pull_seconds_sum"])
        sync(m.transfer_fallbacks, tags, t["fallbacks_recompute"])
        for event in ("granted", "released", "expired"):
            sync(m.leases, {**tags, "event": event}, t[f"leases_{event}"])
        if self.feed is not None:
            self._export_feed(m, tags)
        if self.replies is not None:
            for path, n in self.replies.legs.items():
                sync(m.reply_legs, {**tags, "path": path}, n)

    def _export_feed(self, m, tags: dict[str, str]) -> None:
        for lag in self.feed.drain_lags():
            m.router_feed_lag.observe(lag, tags)
        f, sync = self.feed.stats, self._counters.sync
        for result, n in (("sent", f.calls), ("refused", f.refused), ("unavailable", f.unavailable),
                          ("error", f.errors), ("snapshot", f.snapshots)):
            sync(m.router_feed_calls, {**tags, "result": result}, n)

    # ---- traces -------------------------------------------------------------------------------

    def _export_spans(self, req: "Request", end: float) -> None:
        parent = extract(req.ctx.trace_context)
        attrs = {"pdserve.request_id": req.request_id, "pdserve.pool": self.pool,
                 "pdserve.replica": self.replica_id, "pdserve.tenant": req.ctx.tenant}
        for name, start, stop in phases(self.pool, req, end):
            extra = {}
            if name == "prefill":
                extra = {"pdserve.prompt_tokens": req.num_prompt_tokens,
                         "pdserve.cached_tokens": max(req.num_cached_tokens, 0)}
            elif name == "decode":
                extra = {"pdserve.output_tokens": req.num_output_tokens,
                         "pdserve.finish_reason": req.status.finish_reason or ""}
            record_span(self.tracer, name, parent, start, stop, {**attrs, **extra})
