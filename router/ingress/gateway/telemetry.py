"""The ingress side of telemetry: what clients see, per request and per tenant.

`TelemetryStage`, the gateway's first stage, observes every request (refusals too): it opens the
request's root span ("ingress"), puts its W3C context in the RequestContext both pools receive,
and at the end records TTFT, time per output token, end-to-end latency, tokens per tenant, and the
final status code, or the refusal's code and reason. The flow reports each routing decision
(reason, router latency, predicted cached tokens, and the "route" span). Metric names and labels:
cluster/telemetry/metrics.py.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from cluster.errors import InvalidRequestError
from cluster.telemetry.metrics import ingress_metrics
from cluster.telemetry.tracing import extract, inject, make_tracer, record_span
from router.ingress.flow.route_memory import REMEMBERED
from router.ingress.gateway.metric_batch import MetricBatch
from router.ingress.gateway.stages import Outcome, Stage
from router.ingress.status import Code, code_of, error_code

if TYPE_CHECKING:
    from cluster.config import TelemetryOptions
    from cluster.engine.request import RequestContext
    from router.ingress.request import Delta
    from router.policy import RouteDecision

def route_reason(decision: "RouteDecision | None") -> str:
    """A bounded label for a decision (its `reason` text names replicas and token counts)."""
    if decision is None:
        return "fallback"
    if decision.reason.startswith(REMEMBERED):  # the router did not answer: its last choice for the prefix
        return REMEMBERED
    if decision.mode == "remote":
        return "cache" if decision.predicted_cached_tokens else "load"
    return "no_prefill_pool" if decision.reason.startswith("no prefill pool") else "local_prefill"


def stream_outcome(code: str) -> str:
    """How a request that started ended (the stream-completion SLI's numerator and denominator)."""
    return {"OK": "completed", Code.CANCELLED.grpc_name: "cancelled"}.get(code, "failed")


def refusal_reason(error: BaseException) -> str:
    if isinstance(error, InvalidRequestError):  # the top-level field: "messages.3.content.0.text" -> "messages"
        return error.field.split(".", 1)[0]
    return getattr(error, "reason", None) or error_code(error).lower()


class IngressTelemetry:
    def __init__(self, options: "TelemetryOptions"):
        self.metrics = None
        self.batch = MetricBatch()  # recorded off the loop, counters summed a while (metric_batch.py)
        if options.metrics:
            self.metrics = ingress_metrics()
        self.tracer = make_tracer(options, "pdserve-ingress")

    def start(self, tenant: str, request_id: str | None, model: str = "", version: str = "") -> "RequestObservation":
        """One request's observation; the flow feeds it every delta and ends it once. `model` and
        `version`: the version serving it (config names only: a bounded label set)."""
        span, trace_context = None, ()
        if self.tracer is not None:
            attrs = {"pdserve.tenant": tenant, "pdserve.model": model, "pdserve.model_version": version,
                     **({"pdserve.request_id": request_id} if request_id else {})}
            span = self.tracer.start_span("ingress", attributes=attrs)
            trace_context = inject(span)
        return RequestObservation(self, {"tenant": tenant, "model": model, "version": version}, span, trace_context)

    def _record(self, tags: dict, code: str, error: BaseException | None, start: float, first: float | None,
                last_token: float | None, last: "Delta | None", span) -> None:
        end = time.monotonic()
        refused = last is None and error is not None and code_of(error).refusal
        if self.metrics is not None:
            m, tenant, inc, observe = self.metrics, {"tenant": tags["tenant"]}, self.batch.inc, self.batch.observe
            inc(m.requests, 1, {**tags, "code": code})
            if (pool := getattr(error, "contained_pool", None)) is not None:  # flow/legs.py ForwardFailed
                inc(m.contained, 1, {"model": tags["model"], "version": tags["version"], "pool": pool})
            if refused:
                inc(m.rejected, 1, {**tenant, "code": code, "reason": refusal_reason(error)})
            else:
                inc(m.streams, 1, {**tags, "outcome": stream_outcome(code)})
            if first is not None:
                observe(m.ttft, first - start, tags)
            if code == "OK":
                observe(m.e2e, end - start, tags)
                if last.completion_tokens > 1 and first is not None:  # a guardrail may stop one before any token went out
                    observe(m.tpot, (last_token - first) / (last.completion_tokens - 1), tags)
            if last is not None:
                for counter, n in ((m.prompt_tokens, last.prompt_tokens), (m.generation_tokens, last.completion_tokens),
                                   (m.cached_prompt_tokens, last.cached_prompt_tokens)):
                    if n > 0:
                        inc(counter, n, tags)
        if span is not None:
            from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415

            span.set_attribute("pdserve.code", code)
            if last is not None:
                span.set_attribute("pdserve.request_id", last.request_id)
                span.set_attribute("pdserve.prompt_tokens", last.prompt_tokens)
                span.set_attribute("pdserve.completion_tokens", last.completion_tokens)
            if code != "OK":
                span.set_status(Status(StatusCode.ERROR, str(error) if error is not None else code))
            span.end()

    def refused(self, error: BaseException, tenant: str = "unknown") -> None:
        """A refusal at an edge, before the flow (unknown API key, unknown model)."""
        if self.metrics is not None:
            code = error_code(error)
            self.batch.inc(self.metrics.requests, 1, {"tenant": tenant, "model": "", "version": "", "code": code})
            self.batch.inc(self.metrics.rejected, 1, {"tenant": tenant, "code": code, "reason": refusal_reason(error)})

    def routed(self, decision: "RouteDecision | None", started: float, num_prompt_tokens: int,
               ctx: "RequestContext") -> None:
        """One routing decision (None: the router was unavailable; Serve chose)."""
        ended = time.monotonic()
        if self.metrics is not None:
            m = self.metrics
            self.batch.inc(m.route_decisions, 1, {"reason": route_reason(decision)})
            self.batch.observe(m.route_latency, ended - started)
            if decision is not None:
                self.batch.inc(m.route_prompt_tokens, num_prompt_tokens)
                if decision.predicted_cached_tokens:
                    self.batch.inc(m.route_predicted_cached_tokens, decision.predicted_cached_tokens)
        if self.tracer is not None and ctx.trace_context:
            attrs = {"pdserve.route_reason": route_reason(decision)}
            if decision is not None:
                attrs.update({"pdserve.mode": decision.mode, "pdserve.decode": decision.decode,
                              "pdserve.prefill": decision.prefill or "",
                              "pdserve.predicted_cached_tokens": decision.predicted_cached_tokens,
                              "pdserve.reason": decision.reason})
            record_span(self.tracer, "route", extract(ctx.trace_context), started, ended, attrs)


class RequestObservation:
    """What the ingress saw of one request: called by the flow (`delta` per delta sent, `end`
    once, with the error that ended it or None); records metrics and the ingress span at the end."""

    def __init__(self, telemetry: IngressTelemetry, tags: dict, span, trace_context: tuple):
        self.telemetry = telemetry
        self.tags = tags  # tenant, model, version
        self.span = span
        self.trace_context = trace_context  # carried to both pools in the RequestContext
        self.start = time.monotonic()
        self.first: float | None = None
        self.last_token: float | None = None
        self.last: "Delta | None" = None

    def delta(self, d: "Delta") -> None:
        if d.token_ids:
            self.last_token = time.monotonic()
            self.first = self.first or self.last_token
        self.last = d

    def end(self, error: BaseException | None) -> None:
        finished = self.last is not None and self.last.finish_reason is not None
        code = "OK" if finished else error_code(error) if error is not None else "INTERNAL"
        self.telemetry._record(self.tags, code, error, self.start, self.first, self.last_token, self.last,
                               self.span)


class TelemetryStage(Stage):
    def __init__(self, telemetry: IngressTelemetry, model: str, version: str):
        self.telemetry = telemetry
        self.labels = (model, version)  # the version's metric labels

    async def admit(self, o: Outcome) -> None:
        o.observation = self.telemetry.start(o.tenant, o.request.label, *self.labels)

    async def charge(self, o: Outcome) -> None:
        if o.observation.trace_context:  # the span's context travels to both pools
            o.ctx = replace(o.ctx, trace_context=o.observation.trace_context)

    def delta(self, o: Outcome, d: "Delta") -> None:
        o.observation.delta(d)

    def routed(self, o: Outcome, decision, started: float, num_prompt_tokens: int, ctx: "RequestContext") -> None:
        self.telemetry.routed(decision, started, num_prompt_tokens, ctx)

    def finish(self, o: Outcome, error: BaseException | None) -> None:
        if o.observation is not None:
            o.observation.end(error)
