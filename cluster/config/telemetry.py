"""Metrics, traces and service-level objectives."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.config.common import Strict


# Histogram bucket bounds of the latency metrics (cluster/telemetry/metrics.py). They live here,
# below telemetry, because an SLO threshold must be one of them for the recording rules to be exact.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


TOKEN_INTERVAL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class SLOOptions(Strict):
    """Service-level objectives, turned into Prometheus recording and alerting rules by
    `pdserve slo-rules` (cluster/telemetry/slo.py; the defaults are deploy/prometheus/pdserve-rules.yml).
    A latency objective counts the fraction of events at or under a threshold, which must be one of
    the histogram's bucket bounds (below; cluster/telemetry/metrics.py records with them) so the rules read it exactly."""

    availability: float = Field(
        0.999, gt=0, lt=1, description="Requests that succeed, over those not refused for the client's own fault")
    ttft_threshold_s: float = Field(1.0, gt=0, description="Time to first token at the ingress (one of LATENCY_BUCKETS_S)")
    ttft: float = Field(0.99, gt=0, lt=1, description="Fraction of requests whose TTFT is <= ttft_threshold_s")
    itl_threshold_s: float = Field(0.1, gt=0, description="Interval between tokens on a replica (one of TOKEN_INTERVAL_BUCKETS_S)")
    itl: float = Field(0.99, gt=0, lt=1, description="Fraction of token intervals <= itl_threshold_s")
    period_days: float = Field(30.0, gt=0, description="The window the error budget is spent over")

    @model_validator(mode="after")
    def _thresholds_are_bucket_bounds(self) -> "SLOOptions":
        for name, value, bounds in (("ttft_threshold_s", self.ttft_threshold_s, LATENCY_BUCKETS_S),
                                    ("itl_threshold_s", self.itl_threshold_s, TOKEN_INTERVAL_BUCKETS_S)):
            if value not in bounds:
                raise ValueError(f"{name} {value:g} is not a bucket bound of its histogram: one of {bounds}")
        return self


class TelemetryOptions(Strict):
    """Metrics (Ray's metrics API: the Ray dashboard and its Prometheus endpoint) and traces
    (OpenTelemetry, one trace per request across the deployments). cluster/telemetry/."""

    metrics: bool = Field(True, description="Export pdserve_* metrics through Ray's metrics API")
    metrics_interval_s: float = Field(
        0.5, gt=0, description="How often each replica hands its buffered measurements to Ray's metrics")
    traces: Literal["none", "console", "otlp"] = Field(
        "none", description="Span exporter: none (no spans are made), console (the replicas' stdout), otlp")
    otlp_endpoint: str = Field("localhost:4317", description="OTLP/gRPC collector (traces: otlp)")
    otlp_insecure: bool = Field(True, description="Plain-text gRPC to the collector (no TLS)")
    trace_export_delay_s: float = Field(1.0, gt=0, description="Longest a finished span waits for export")
    slo: SLOOptions = SLOOptions()
