"""The app's configuration (`pdserve up --config`, `serve run`): `AppConfig` and its parts, one
module per concern, all importable from here.

    app.py         AppConfig: the whole app, its cross-field checks, YAML loading
    pools.py       each pool's replicas and engine, autoscaling, KV transfer, routing, fault tolerance
    front_door.py  API keys and tenants, admission, input limits, audit log, budgets
    safety.py      guardrail policies and the classifier, the response cache
    telemetry.py   metrics, traces, SLOs
    common.py      Strict: a frozen model that refuses unknown fields
"""

from cluster.config.app import AppConfig
from cluster.config.common import Strict
from cluster.config.front_door import (LOOPBACK_HOSTS, AdmissionBounds, AdmissionOptions, AuditOptions, BudgetOptions,
                                       IngressLimits, KeySources, ModelPrice, TenantOptions)
from cluster.config.pools import (AutoscalingOptions, FaultToleranceOptions, KVTransferOptions, PlannerOptions,
                                  PoolOptions, RoutingOptions, ServingEngineOptions)
from cluster.config.safety import (ClassifierCheckOptions, ClassifierDeploymentOptions, GuardrailPolicy, GuardrailRule,
                                   ResponseCacheOptions)
from cluster.config.telemetry import LATENCY_BUCKETS_S, TOKEN_INTERVAL_BUCKETS_S, SLOOptions, TelemetryOptions

__all__ = [
    "AppConfig", "Strict", "LOOPBACK_HOSTS", "AdmissionBounds", "AdmissionOptions", "AuditOptions", "BudgetOptions", "IngressLimits",
    "KeySources", "ModelPrice", "TenantOptions", "AutoscalingOptions", "FaultToleranceOptions", "KVTransferOptions",
    "PlannerOptions", "PoolOptions", "RoutingOptions", "ServingEngineOptions", "ClassifierCheckOptions", "ClassifierDeploymentOptions",
    "GuardrailPolicy", "GuardrailRule", "ResponseCacheOptions", "LATENCY_BUCKETS_S", "TOKEN_INTERVAL_BUCKETS_S",
    "SLOOptions", "TelemetryOptions",
]
