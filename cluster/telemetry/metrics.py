"""The `pdserve_*` metric catalogue, recorded through Ray's metrics API (`ray.util.metrics`), so
every metric shows in the Ray dashboard and on each node's Prometheus endpoint, where Ray adds the
prefix `ray_` (and `_total` to counters): `pdserve_ttft_seconds` is scraped as
`ray_pdserve_ttft_seconds_bucket`/`_count`/`_sum`.

Labels are bounded: pool, replica (Serve's replica id), tenant, code (gRPC status name), reason
(a fixed vocabulary), kind/result/event — never a request id. Ray's OpenTelemetry recorder
re-aggregates histograms at the node's agent from bucket counts, so `_count` and `_bucket` are
exact and `_sum` is approximate (bucket midpoints).

Metric objects are made once per process, on first use (`ingress_metrics()`, `engine_metrics()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cluster.config import LATENCY_BUCKETS_S, TOKEN_INTERVAL_BUCKETS_S

LATENCY_S = list(LATENCY_BUCKETS_S)
TOKEN_INTERVAL_S = list(TOKEN_INTERVAL_BUCKETS_S)
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
STEP_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]

REPLICA = ("pool", "replica")


@dataclass(frozen=True)
class IngressMetrics:
    """Recorded by each ingress replica, per request: what clients see."""

    requests: object
    rejected: object
    streams: object
    ttft: object
    tpot: object
    e2e: object
    prompt_tokens: object
    generation_tokens: object
    cached_prompt_tokens: object
    route_decisions: object
    route_latency: object
    route_prompt_tokens: object
    route_predicted_cached_tokens: object
    audit_dropped: object
    audit_unacked: object
    spend: object
    contained: object


@dataclass(frozen=True)
class EngineMetrics:
    """Recorded by each prefill and decode replica from its engine's plain counters and probe."""

    inter_token_latency: object
    queue_time: object
    prefill_time: object
    kv_import_time: object
    batch_size: object
    tokens_per_step: object
    kv_usage: object
    running: object
    waiting: object
    prefix_queried_tokens: object
    prefix_hit_tokens: object
    computed_tokens: object
    generated_tokens: object
    finished: object
    preemptions: object
    transfer_bytes: object
    transfer_blocks: object
    transfer_pulls: object
    transfer_pull_seconds: object
    transfer_fallbacks: object
    leases: object
    spec_proposed: object
    spec_accepted: object
    spec_proposer_seconds: object
    spec_off: object
    router_feed_lag: object
    router_feed_calls: object
    reply_legs: object


@lru_cache(maxsize=None)
def ingress_metrics() -> IngressMetrics:
    from ray.util.metrics import Counter, Gauge, Histogram  # noqa: PLC0415

    t = ("tenant", "model", "version")  # the model version that served (empty: refused before one was chosen)
    return IngressMetrics(
        requests=Counter("pdserve_requests", "Requests that reached the request flow, by final status code "
                         "(OK, or the gRPC code the client got)", ("tenant", "model", "version", "code")),
        rejected=Counter("pdserve_requests_rejected", "Requests refused before they ran (bad input, auth, "
                         "quotas, overload), by code and reason", ("tenant", "code", "reason")),
        streams=Counter("pdserve_streams", "Requests that started (not refused), by outcome: completed (ended "
                        "with a finish reason: stop or length), cancelled (by the client), failed (anything else)",
                        ("tenant", "model", "version", "outcome")),
        ttft=Histogram("pdserve_ttft_seconds", "Time to first token at the ingress (request in -> first token "
                       "out)", LATENCY_S, t),
        tpot=Histogram("pdserve_tpot_seconds", "Time per output token after the first, per successful request "
                       "with at least two tokens", TOKEN_INTERVAL_S, t),
        e2e=Histogram("pdserve_e2e_latency_seconds", "End-to-end latency of successful requests at the ingress",
                      LATENCY_S, t),
        prompt_tokens=Counter("pdserve_prompt_tokens", "Prompt tokens of requests that produced output", t),
        generation_tokens=Counter("pdserve_generation_tokens", "Tokens sent to clients", t),
        cached_prompt_tokens=Counter("pdserve_cached_prompt_tokens", "Prompt tokens served from a prefix "
                                     "cache (engine-observed, as reported in usage)", t),
        route_decisions=Counter("pdserve_route_decisions", "Routing decisions by reason: cache, load, "
                                "local_prefill, no_prefill_pool, remembered (router unavailable: its last choice for the prefix), fallback (router unavailable)", ("reason",)),
        route_latency=Histogram("pdserve_route_latency_seconds", "Router call latency seen by the ingress",
                                LATENCY_S, ()),
        route_prompt_tokens=Counter("pdserve_route_prompt_tokens", "Prompt tokens of routed requests", ()),
        route_predicted_cached_tokens=Counter(
            "pdserve_route_predicted_cached_tokens", "Prompt tokens the router predicted cached on the replica "
            "that computes the prompt (RouteDecision.predicted_cached_tokens)", ()),
        audit_dropped=Counter("pdserve_audit_dropped", "Audit records dropped because the ingress's buffer of "
                              "unacknowledged records was full (audit.when_full: drop)", ()),
        audit_unacked=Gauge("pdserve_audit_unacked", "Audit records an ingress holds that the writer has not "
                            "acknowledged yet (grows while the writer is down)", ()),
        spend=Counter("pdserve_spend_usd", "Settled cost of requests in USD at budgets.prices", ("tenant",)),
        contained=Counter("pdserve_requests_contained", "Requests whose forward failed a replica, ended there "
                          "(INTERNAL) and not retried or migrated onto another replica (poison containment), by the "
                          "pool it failed on", ("model", "version", "pool")),
    )


@dataclass(frozen=True)
class LedgerMetrics:
    """Recorded by the ledger actor (one process): each tenant's month so far."""

    spent: object
    budget: object


@lru_cache(maxsize=None)
def ledger_metrics() -> LedgerMetrics:
    from ray.util.metrics import Gauge  # noqa: PLC0415

    return LedgerMetrics(
        spent=Gauge("pdserve_budget_spent_usd", "A tenant's spend this month (settled + reserved), USD", ("tenant",)),
        budget=Gauge("pdserve_budget_limit_usd", "A tenant's monthly budget, USD (tenants with a budget)", ("tenant",)),
    )


@dataclass(frozen=True)
class AuditWriterMetrics:
    records: object


@lru_cache(maxsize=None)
def audit_writer_metrics() -> AuditWriterMetrics:
    from ray.util.metrics import Counter  # noqa: PLC0415

    return AuditWriterMetrics(records=Counter(
        "pdserve_audit_records", "Audit records the writer received, by result: written (chained, fsynced) "
        "or duplicate (a resend of a request id already in the log)", ("result",)))


@dataclass(frozen=True)
class GuardrailMetrics:
    """Recorded by each ingress replica (router/ingress/gateway/guardrails.py, response_cache.py); tenant,
    policy and check names come from the config; stage, action, cause and result are closed sets."""

    interventions: object
    cache_requests: object


@lru_cache(maxsize=None)
def guardrail_metrics() -> GuardrailMetrics:
    from ray.util.metrics import Counter  # noqa: PLC0415

    return GuardrailMetrics(
        interventions=Counter(
            "pdserve_guardrail_interventions", "Guardrail events: stage input|output, action refused|stopped|"
            "passed_on_error, cause flagged|timeout|error", ("tenant", "policy", "check", "stage", "action", "cause")),
        cache_requests=Counter(
            "pdserve_response_cache_requests", "Requests of tenants that opted in to the response cache, by result: "
            "hit, miss, bypass (not cacheable: temperature is not 0)", ("tenant", "result")),
    )


@lru_cache(maxsize=None)
def engine_metrics() -> EngineMetrics:
    from ray.util.metrics import Counter, Gauge, Histogram  # noqa: PLC0415

    r = REPLICA
    return EngineMetrics(
        inter_token_latency=Histogram(
            "pdserve_inter_token_latency_seconds", "Interval between consecutive tokens of a request produced "
            "on this replica (decode steps; includes waits for preemption and recompute)", TOKEN_INTERVAL_S, r),
        queue_time=Histogram("pdserve_queue_time_seconds", "Submission -> first scheduled, for prompts computed "
                             "on this replica (pool = phase)", LATENCY_S, r),
        prefill_time=Histogram("pdserve_prefill_time_seconds", "First scheduled -> first token (chunked "
                               "prefill), for prompts computed on this replica", LATENCY_S, r),
        kv_import_time=Histogram("pdserve_kv_import_seconds", "Decode: KV handle received -> first decode "
                                 "step (the pull of missing blocks plus the wait for a step)", LATENCY_S, r),
        batch_size=Histogram("pdserve_batch_size", "Sequences per engine step", BATCH_SIZES, r),
        tokens_per_step=Histogram("pdserve_tokens_per_step", "Tokens through the model per engine step",
                                  STEP_TOKENS, r),
        kv_usage=Gauge("pdserve_kv_usage", "Fraction of the replica's KV blocks held by requests", r),
        running=Gauge("pdserve_running_requests", "Requests running or importing KV", r),
        waiting=Gauge("pdserve_waiting_requests", "Requests waiting for admission to the engine", r),
        prefix_queried_tokens=Counter("pdserve_prefix_cache_queried_tokens", "Prompt tokens computed on this "
                                      "replica, looked up in its prefix cache", r),
        prefix_hit_tokens=Counter("pdserve_prefix_cache_hit_tokens", "Of those, tokens found in the prefix "
                                  "cache (not computed)", r),
        computed_tokens=Counter("pdserve_engine_computed_tokens", "Tokens through the model (prompt chunks, "
                                "recomputes, decodes)", r),
        generated_tokens=Counter("pdserve_engine_generated_tokens", "Tokens sampled on this replica", r),
        finished=Counter("pdserve_engine_finished_requests", "Requests the engine ended, by finish reason",
                         (*r, "reason")),
        preemptions=Counter("pdserve_preemptions", "Requests preempted (blocks freed, recomputed later)", r),
        transfer_bytes=Counter("pdserve_kv_transfer_bytes", "KV bytes pulled from prefill replicas", r),
        transfer_blocks=Counter("pdserve_kv_transfer_blocks", "Prompt KV blocks by kind: pulled, or reused "
                                "from this replica's own prefix cache", (*r, "kind")),
        transfer_pulls=Counter("pdserve_kv_transfer_pulls", "KV pulls by result: ok, failed, timed_out",
                               (*r, "result")),
        transfer_pull_seconds=Counter("pdserve_kv_transfer_pull_seconds", "Time spent in successful pulls "
                                      "(mean latency = rate of this / rate of ok pulls)", r),
        transfer_fallbacks=Counter("pdserve_kv_transfer_fallbacks", "Failed pulls recomputed locally", r),
        leases=Counter("pdserve_kv_leases", "Prefill KV leases by event: granted, released (pulled), expired",
                       (*r, "event")),
        spec_proposed=Counter("pdserve_spec_proposed_tokens", "Speculative decoding: draft tokens verified by "
                              "the model (acceptance rate = rate of accepted / rate of this)", r),
        spec_accepted=Counter("pdserve_spec_accepted_tokens", "Speculative decoding: draft tokens accepted "
                              "(each one a decode step saved)", r),
        spec_proposer_seconds=Counter("pdserve_spec_proposer_seconds", "Speculative decoding: time spent "
                                      "proposing drafts", r),
        spec_off=Counter("pdserve_spec_off", "Speculative decoding turned off, by reason: per request for "
                         "grammar, logprobs, penalties, logit_bias, and each low_acceptance pause; per step "
                         "for batch (more requests decoding than max_batch) and cost (a request held back: its expected "
                         "accepted drafts do not pay for their measured cost at the current batch)", (*r, "reason")),
        router_feed_lag=Histogram("pdserve_router_feed_lag_seconds", "Staleness of the router's view of this "
                                  "replica: per feed call, from the oldest change it carried (a block event, a queue "
                                  "that moved) to the router's answer seen here", LATENCY_S, r),
        router_feed_calls=Counter("pdserve_router_feed_calls", "Feed calls to the router by result: sent (each), "
                                  "snapshot (of them, full snapshots), refused (a gap: resync), unavailable, error",
                                  (*r, "result")),
        reply_legs=Counter("pdserve_decode_reply_legs", "Decode legs by how their outputs went to the ingress: "
                           "framed (on its reply socket), streamed (on the Serve call), fell_back (framed, then the "
                           "rest on the Serve call when the connection closed)", (*r, "path")),
    )
