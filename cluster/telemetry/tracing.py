"""OpenTelemetry traces: one trace per request, one span per phase.

    ingress (root, at the ingress replica)
      route                      ingress: the router call
      queue, prefill             the replica that computes the prompt: submitted -> scheduled -> first token
      transfer                   decode replica, when prefill ran elsewhere: KV handle -> first decode step
      decode                     decode replica: -> the request's end

The ingress injects its span's W3C context into `RequestContext.trace_context`, which travels in
the calls' arguments to both pools. Engine replicas make their spans after the fact, from the phase
times an EngineProbe stamped on the request (cluster/engine/probe.py), so the engine step never
touches OpenTelemetry. With `telemetry.traces: none` there is no tracer, no context is injected,
and no span object is ever made.

One TracerProvider per process (not the global one), with a BatchSpanProcessor: spans are exported
off the request path, at most `trace_export_delay_s` after they end.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from cluster.config import TelemetryOptions

log = logging.getLogger(__name__)

_providers: dict[tuple, object] = {}  # (service, exporter settings) -> TracerProvider, one per process


def make_tracer(options: "TelemetryOptions", service: str) -> "Tracer | None":
    """The tracer for this process's role, or None when traces are off."""
    if options.traces == "none":
        return None
    key = (service, options.traces, options.otlp_endpoint, options.otlp_insecure, options.trace_export_delay_s)
    provider = _providers.get(key)
    if provider is None:
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(
            _exporter(options), schedule_delay_millis=options.trace_export_delay_s * 1000))
        _providers[key] = provider
        log.info("traces: %s exporter for %s", options.traces, service)
    return provider.get_tracer("pdserve")


def _exporter(options: "TelemetryOptions"):
    if options.traces == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter  # noqa: PLC0415

        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

    return OTLPSpanExporter(endpoint=options.otlp_endpoint, insecure=options.otlp_insecure)


def inject(span: "Span") -> tuple[tuple[str, str], ...]:
    """The span's W3C trace context (traceparent, tracestate), for RequestContext.trace_context."""
    from opentelemetry.trace import set_span_in_context  # noqa: PLC0415
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return tuple(sorted(carrier.items()))


def extract(trace_context: tuple[tuple[str, str], ...]):
    """The parent context carried by a request (an OpenTelemetry Context)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415

    return TraceContextTextMapPropagator().extract(dict(trace_context))


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading of this process as OpenTelemetry's epoch nanoseconds."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def record_span(tracer: "Tracer", name: str, parent, start: float, end: float,
                attributes: Mapping[str, object]) -> None:
    """A finished span from two monotonic times of this process."""
    span = tracer.start_span(name, context=parent, start_time=epoch_ns(start), attributes=dict(attributes))
    span.end(end_time=epoch_ns(max(end, start)))
