"""Metrics of the guardrails and the response cache (router/ingress/guardrails.py,
response_cache.py), recorded by each ingress replica. Labels are bounded: tenant, policy and check
names come from the config; stage, action, cause and result are closed sets."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class GuardrailMetrics:
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
