"""Telemetry: engines emit plain numbers (EngineStats, TransferStats, an EngineProbe); this package
turns them into `pdserve_*` metrics (Ray's metrics API) and OpenTelemetry spans. What an engine
step and a request's end tell telemetry is `cluster.engine.probe` (no Ray, no OpenTelemetry).

    metrics.py   the metric catalogue: names, labels, buckets
    tracing.py   the tracer per process (exporter from config), W3C context in and out, spans from times
    replica.py   a replica's exporter: drains the probe and the stats into metrics and phase spans

The ingress side (TTFT, end-to-end latency, tokens per tenant, refusals, routing) is
router/ingress/deployment/telemetry.py. Importing this package is cheap: Ray and OpenTelemetry load on first use.
"""
