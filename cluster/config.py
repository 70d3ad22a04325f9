"""The whole app's configuration: one pydantic schema for `pdserve up --config` and `serve run`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.engine.config import EngineOptions
from cluster.errors import InvalidRequestError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServingEngineOptions(EngineOptions):
    """The engine's options (cluster/engine/config.py), with a server's defaults for overload: an
    in-process engine queues without bound, a replica refuses past these (429)."""

    max_waiting: int | None = Field(512, ge=0, description="Per replica; more waiting requests are refused (429)")
    queue_ttl_s: float | None = Field(30.0, gt=0, description="Not admitted within this long: rejected (429)")


class AutoscalingOptions(_Strict):
    """One pool's autoscaling (cluster/serving/autoscaling.py): prefill on queued prompt tokens and TTFT,
    decode on KV use and inter-token latency; up fast, down slowly. A pool reads only its own two
    targets. Set a target above what the pool can ever reach to scale on the other signal alone."""

    min_replicas: int = Field(1, ge=1, description="An autoscaled pool never goes to zero")
    max_replicas: int = Field(1, ge=1)
    target_queued_prefill_tokens: float = Field(
        8192, gt=0, description="prefill: prompt tokens waiting per replica (~ throughput x accepted queueing)")
    target_ttft_s: float = Field(1.0, gt=0, description="prefill: time to first token at the replica")
    target_kv_usage: float = Field(0.8, gt=0, le=1, description="decode: fraction of KV blocks held by requests")
    target_itl_s: float = Field(0.05, gt=0, description="decode: interval between a request's tokens")
    upscale_delay_s: float = Field(5.0, ge=0, description="Above target this long: add replicas (all needed at once)")
    downscale_delay_s: float = Field(300.0, ge=0, description="Slack this long: remove downscale_step replicas")
    downscale_threshold: float = Field(
        0.6, gt=0, lt=1, description="Slack = the pool would stay below this fraction of its targets with one fewer")
    downscale_step: int = Field(1, ge=1, description="Replicas removed per scale-down")
    look_back_period_s: float = Field(5.0, gt=0, description="Serve averages each replica's reports over this window")
    metrics_interval_s: float = Field(1.0, gt=0, description="How often replicas send their reports to Serve")

    @model_validator(mode="after")
    def _consistent(self) -> "AutoscalingOptions":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("look_back_period_s must be longer than metrics_interval_s")
        return self


class PoolOptions(_Strict):
    num_replicas: int = Field(1, ge=0, description="0 for the prefill pool: decode prefills locally")
    autoscaling: AutoscalingOptions | None = None
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica, e.g. {pdserve_decode: 1}: "
        "the pool runs only on nodes that advertise them (deploy/cluster.yaml)")
    max_ongoing_requests: int = Field(256, ge=1)
    compute_nice: int = Field(
        10, ge=0, le=19, description="OS niceness of the engine's compute thread (and the torch threads it "
        "starts): where engines share cores with the front door, its event loops (admission, token relay) "
        "run first; 0 = same priority (docs/architecture.md, 'CPU priority')")
    engine: ServingEngineOptions | None = Field(None, description="Overrides the app-wide engine options")

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name} is not a custom resource: use num_cpus / num_gpus")
            if amount <= 0:
                raise ValueError(f"resource {name}: must be > 0, got {amount}")
        return resources


class KVTransferOptions(_Strict):
    lease_s: float = Field(30.0, gt=0, description="How long prefill holds a request's blocks for decode")
    timeout_s: float = Field(10.0, gt=0, description="Decode gives up on a pull after this long")
    min_lease_left_s: float | None = Field(
        None, ge=0, description="Decode pulls only while the handle's lease has this long left, else it "
        "recomputes the prompt (prefill's wall clock: nodes need NTP); None = timeout_s")
    release_grace_s: float = Field(
        2.0, ge=0, description="Prefill keeps the blocks of a lease that expired or was released without a "
        "completed READ this much longer before reusing them (a decode may still be reading)")
    failure_policy: Literal["recompute", "fail"] = "recompute"
    required_transports: list[str] = Field(default_factory=list, description='e.g. ["cuda_ipc", "rc"]')
    nixl_threads: int = Field(0, ge=0)
    progress_thread: bool = Field(
        False, description="NIXL's progress thread: lower transfer latency, but it spins one core per replica")
    registry_timeout_s: float = Field(
        2.0, gt=0, description="Longest the engine loop waits for the registry actor (a handshake's peer "
        "lookup); no answer = a failed pull, which the failure policy handles")

    @model_validator(mode="after")
    def _lease_outlasts_margin(self) -> "KVTransferOptions":
        margin = self.timeout_s if self.min_lease_left_s is None else self.min_lease_left_s
        if margin >= self.lease_s:
            raise ValueError(f"min_lease_left_s ({margin:g}; default timeout_s) must be below lease_s "
                             f"({self.lease_s:g}), or every pull is refused")
        return self


class RoutingOptions(_Strict):
    enabled: bool = Field(True, description="Route through the router actor; off = Serve's power of two")
    strategy: Literal["cost", "round_robin", "power_of_two"] = Field(
        "cost", description="cost: prefix- and capacity-aware; the others are baselines for comparison")
    local_prefill_threshold: int = Field(
        64, ge=0, description="Fewer uncached prompt tokens than this on the decode replica: prefill there")
    hot_load_cap: int = Field(32, ge=1, description="Requests on a replica past which its cache earns no credit")
    slow_factor: float = Field(2.0, gt=1, description="Step time this many times the pool median: deprioritised")
    pull_block_cost: float | None = Field(
        None, ge=0, description="Tokens of work one KV block a decode replica lacks costs its pull (on top of the "
        "block itself); None: measured (decode's seconds per pulled block x the prefill pool's tokens/s)")
    evict_block_cost: float = Field(
        4.0, ge=0, description="Tokens charged for each cached block a prompt would push out of a replica's cache "
        "(what makes prefixes spread over the pool instead of thrashing one replica)")
    session_bonus: float = Field(
        256.0, ge=0, description="Tokens of work by which the replicas that served a session last are preferred "
        "(a soft preference: more load than this moves the session; 0 turns affinity off)")
    max_sessions: int = Field(100_000, ge=1, description="Sessions the router remembers (least recently used go first)")
    session_ttl_s: float = Field(600.0, gt=0, description="A session idle this long is forgotten by the router")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class KeySources(_Strict):
    """Where a tenant's API keys come from: inline, an environment variable or a secret file (one
    key a line, `#` comments; several keys in the variable are separated by commas or newlines).
    Only the ingress reads them, and keeps only their SHA-256; the engine replicas' config carries
    none of them (cluster/app/builder.py strips them)."""

    api_keys: list[str] = Field(default_factory=list, description="Keys in clear (prefer the env or file)")
    api_keys_env: str | None = Field(None, description="Environment variable holding the keys (read by the ingress)")
    api_keys_file: str | None = Field(None, description="Secret file holding the keys, one a line (read by the ingress)")

    @property
    def has_keys(self) -> bool:
        return bool(self.api_keys) or self.api_keys_env is not None or self.api_keys_file is not None

    def without_keys(self):
        return self.model_copy(update={"api_keys": [], "api_keys_env": None, "api_keys_file": None})


class TenantOptions(KeySources):
    """One tenant: its API keys (at least one source), scheduling class and quotas (None = unlimited)."""

    priority: Literal["interactive", "batch"] = "interactive"
    weight: float = Field(1.0, gt=0, description="Share of compute against tenants of the same priority")
    requests_per_min: float | None = Field(None, gt=0)
    tokens_per_min: float | None = Field(
        None, gt=0, description="prompt + max_tokens charged at admission; unused output tokens refunded")
    max_concurrent: int | None = Field(
        None, ge=1, description="Requests in flight; each ingress replica enforces its share")
    max_context: int | None = Field(None, ge=1, description="Most prompt + max_tokens per request")
    max_output_tokens: int | None = Field(None, ge=1)
    kv_budget: float = Field(1.0, gt=0, le=1, description="Most of a replica's KV pool its requests may hold")
    cache_group: str | None = Field(
        None, description="Tenants with the same group share cached prefixes; default: the tenant's own")
    guardrail_policy: str | None = Field(
        None, description="Name of a policy in guardrail_policies checking this tenant's prompts and output")
    response_cache: bool = Field(
        False, description="Serve repeated temperature-0 requests from the response cache (response_cache options)")
    monthly_budget_usd: float | None = Field(
        None, ge=0, description="Spend cap per calendar month (UTC) at budgets.prices; None = no cap "
        "(spend is still counted). Enforced across every ingress replica by the ledger actor")
    audit_text: bool = Field(
        False, description="Audit records carry the prompt and the output text (default: counts and ids only)")


class AdmissionOptions(_Strict):
    max_inflight: int = Field(1024, ge=1, description="Requests in flight per ingress replica; more get 429")
    max_queue_wait_s: float | None = Field(
        None, gt=0, description="Refuse (429) when the predicted wait before a request's prompt starts is "
        "longer (the ingress's own first-token queue, then the router's view of the replica); None = off")
    target_itl_s: float | None = Field(
        None, gt=0, description="Refuse (429) new work while the decode pool's streams, as the ingress relays "
        "them, would run slower than this per token (their measured interval x streams sets the cap); None = off")
    batch_share: float = Field(
        0.5, gt=0, le=1, description="Batch-priority tenants are refused at this share of max_queue_wait_s and "
        "of max_inflight and of the target_itl_s cap: under overload batch work is shed before interactive work")
    rate_limit_lease: float = Field(
        0.05, gt=0, le=1, description="Share of a tenant's per-minute budget an ingress takes per actor call")
    idempotency_ttl_s: float = Field(600.0, gt=0, description="How long a non-streaming result is kept by key")
    idempotency_max_keys: int = Field(
        1024, ge=1, description="Idempotency records kept per tenant (least recently used finished ones go first; "
        "a tenant with this many still running gets 429 for a new key)")
    idempotency_max_waiters: int = Field(
        8, ge=0, description="Duplicates that may wait for one running Idempotency-Key; more get 429")
    idempotency_wait_s: float = Field(300.0, gt=0, description="Longest a duplicate waits for the running request")
    actor_timeout_s: float = Field(
        1.0, gt=0, description="Bound on each admission-actor call on the request path (rate limits fail "
        "open, idempotency fails closed: docs/architecture.md)")


class AuditOptions(_Strict):
    """The audit log (router/ingress/audit*.py): one hash-chained JSON line per request, written by
    one writer actor on the head node; each ingress spools its records locally and resends until
    the writer acknowledges them (at-least-once; the writer drops duplicates by request id)."""

    enabled: bool = Field(False, description="Write an audit record for every request that reaches the flow")
    dir: str = Field("/tmp/pdserve-audit", description="The log's directory, on the head node (the writer's)")
    spool_dir: str | None = Field(
        None, description="Each ingress's local spool of unacknowledged records; default: <dir>/spool (same node)")
    max_file_bytes: int = Field(64 * 2**20, ge=4096, description="Rotate to a new file past this size (and each UTC day)")
    batch_records: int = Field(512, ge=1, description="Most records an ingress sends the writer in one call")
    flush_interval_s: float = Field(0.05, gt=0, description="How long an ingress gathers records before sending")
    max_buffered: int = Field(
        100_000, ge=1, description="Unacknowledged records an ingress holds (writer down); past it: when_full")
    when_full: Literal["drop", "refuse"] = Field(
        "refuse", description="Buffer full: refuse new requests (503, fail closed) or drop their records (counted)")
    dedup_window: int = Field(
        200_000, ge=1, description="Recent request ids the writer remembers (read back from the log's tail at start)")
    writer_timeout_s: float = Field(5.0, gt=0, description="Bound on one writer call; on failure the ingress retries")


class ModelPrice(_Strict):
    prompt_per_1k: float = Field(0.0, ge=0, description="USD per 1,000 prompt tokens")
    completion_per_1k: float = Field(0.0, ge=0, description="USD per 1,000 completion tokens")


class BudgetOptions(_Strict):
    """Prices and the spend ledger (router/ingress/budget*.py). A request of a tenant with a
    monthly budget reserves its worst case (prompt + max_tokens at the model's prices) before it
    runs and settles the actual cost at its end; the ledger refuses a reservation that would pass
    the budget, so spend never exceeds it (docs/architecture.md, Budgets)."""

    prices: dict[str, ModelPrice] = Field(
        default_factory=dict, description="Per served model name; a model without a price costs 0")
    ledger_path: str = Field("/tmp/pdserve-ledger.json", description="The ledger's file, on the head node")
    when_unreachable: Literal["closed", "open"] = Field(
        "closed", description="Ledger unreachable at admission: refuse (503) or admit unchecked (charged later)")
    timeout_s: float = Field(1.0, gt=0, description="Bound on the ledger call at admission")
    reservation_ttl_s: float = Field(
        3600.0, gt=0, description="A reservation never settled (its ingress died) is charged in full after this")
    alert_fraction: float = Field(0.8, gt=0, le=1, description="The spend alert fires past this share of a budget")


class IngressLimits(_Strict):
    """Caps checked at the edges before any work: the body before it is parsed, headers before
    they are used. The engine's RequestLimits (engine.limits) cap stop strings, ids and prompts."""

    max_body_bytes: int = Field(
        4 * 2**20, ge=1024, description="HTTP request body, counted as it streams in; more -> 413")
    max_chat_messages: int = Field(256, ge=1, description="Messages in one chat request; more -> 400 (messages)")
    max_choices: int = Field(8, ge=1, le=128, description="OpenAI `n`: choices per request (each one a request); more -> 400 (n)")
    max_authorization_chars: int = Field(512, ge=16, description="Longest authorization header/metadata; more -> 401")
    max_timeout_header_chars: int = Field(32, ge=4, description="Longest x-pdserve-timeout-s value; more -> 400")
    max_session_id_chars: int = Field(
        128, ge=8, description="Longest session key (x-session-id header/metadata, prompt_cache_key); more -> 400")
    grpc_max_receive_bytes: int = Field(
        4 * 2**20, ge=1024, description="gRPC request message size. Serve's gRPC proxy reads it only from "
        "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE in its environment (`pdserve up` sets it for the Ray it starts; "
        "a cluster sets it on its nodes); the ingress refuses larger messages itself too")

    def check_choices(self, n: int) -> None:
        """OpenAI's `n` (HTTP) and GenerateRequest.n (gRPC): one bound, one message."""
        if not 1 <= n <= self.max_choices:
            raise InvalidRequestError("n", f"must be in [1, {self.max_choices}] (max_choices), got {n}")


class FaultToleranceOptions(_Strict):
    max_migrations: int = Field(
        2, ge=0, description="Times a request may move to another decode replica when its replica dies")
    stuck_loop_s: float = Field(
        30.0, gt=0, description="An engine loop turn running this long fails the replica's health check")
    max_consecutive_step_errors: int = Field(
        8, ge=1, description="This many engine steps failing in a row (none ran since) fails the replica's "
        "health check; the router avoids a replica whose last step failed")
    fault_injection: bool = Field(
        False, description="Allow inject_fault() on replicas (chaos tests and drills; off in production)")


# Histogram bucket bounds of the latency metrics (cluster/telemetry/metrics.py). They live here,
# below telemetry, because an SLO threshold must be one of them for the recording rules to be exact.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
TOKEN_INTERVAL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class SLOOptions(_Strict):
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


class TelemetryOptions(_Strict):
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


class GuardrailRule(_Strict):
    """A built-in check: a word list (whole words, case-insensitive) or a regular expression.
    Compiled once (router/ingress/guardrails.py) with the `regex` module and run with a timeout.
    A rule that checks output must have a bounded match length that fits the policy's hold-back
    window (so no match can reach released text): refused at load otherwise. Output rules use
    Python `re` syntax (how their length is bounded); lookbehind is fine, lookahead adds its width."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Metric label and audit name")
    words: list[str] = Field(default_factory=list, max_length=10_000, description="Whole words or phrases")
    pattern: str | None = Field(None, max_length=4096, description="A regular expression (instead of words)")
    applies_to: Literal["input", "output", "both"] = "both"

    @model_validator(mode="after")
    def _one_kind(self) -> "GuardrailRule":
        if bool(self.words) == (self.pattern is not None):
            raise ValueError(f"rule {self.name!r}: give words or pattern (exactly one)")
        if any(not w.strip() or len(w) > 256 for w in self.words):
            raise ValueError(f"rule {self.name!r}: words must be non-blank, at most 256 characters")
        return self


class ClassifierCheckOptions(_Strict):
    """A policy's call to the guardrail classifier deployment (AppConfig.guardrail_classifier):
    flagged when its score is >= threshold. A call that fails or runs past timeout_s follows the
    policy's on_error. On output it is called once per release (each delta), over the window."""

    name: str = Field("classifier", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Metric label and audit name")
    threshold: float = Field(0.5, gt=0, le=1)
    timeout_s: float = Field(0.5, gt=0, le=30, description="Bound on one call (input and output alike)")
    applies_to: Literal["input", "output", "both"] = "both"


class ClassifierDeploymentOptions(_Strict):
    """The guardrail classifier, its own Serve deployment with its own resources (never an engine's
    step). Deployed when a policy names a classifier. kind keyword_stand_in: a RULE-BASED STAND-IN
    for a classifier model (cluster/serving/classifier.py), scoring 1.0 when one of `words` occurs."""

    kind: Literal["keyword_stand_in"] = "keyword_stand_in"
    words: list[str] = Field(default_factory=list, max_length=10_000)
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.25, ge=0)
    max_text_chars: int = Field(200_000, ge=1, description="Longer texts are refused by the deployment (an error)")


class GuardrailPolicy(_Strict):
    """Checks on a tenant's prompt (before any engine work) and output stream. Output reaches
    the client only after the checks covering it passed: the last `holdback_chars` characters
    are held back until more text (or the end) comes."""

    rules: list[GuardrailRule] = Field(default_factory=list, max_length=256)
    classifier: ClassifierCheckOptions | None = Field(None, description="Also ask the classifier deployment")
    holdback_chars: int = Field(
        64, ge=1, le=4096, description="Hold-back window, in characters of output text: at least every "
        "output rule's longest match plus its lookahead (one character for word boundaries)")
    rule_timeout_s: float = Field(
        0.05, gt=0, le=1, description="Bound on one rule's scan of an output delta (the `regex` module's timeout, "
        "wall clock: a loaded machine needs slack); a prompt's scan gets 20 times this")
    on_error: Literal["closed", "open"] = Field(
        "closed", description="A check that times out or fails: closed = treat as flagged, open = pass (counted)")

    @model_validator(mode="after")
    def _rules_fit(self) -> "GuardrailPolicy":
        names = [r.name for r in self.rules] + ([self.classifier.name] if self.classifier else [])
        if len(set(names)) != len(names):
            raise ValueError("guardrail rule names must be unique within a policy")
        from cluster.guardrail_rules import compile_rule, RuleError  # noqa: PLC0415

        for rule in self.rules:
            try:
                compiled = compile_rule(rule.words, rule.pattern)
            except RuleError as e:
                raise ValueError(f"rule {rule.name!r}: {e}") from None
            if rule.applies_to != "input":
                if compiled.span is None:
                    raise ValueError(f"rule {rule.name!r}: an output rule needs a bounded match length "
                                     f"(no *, + or {{n,}}): {compiled.why_unbounded}")
                if compiled.span > self.holdback_chars:
                    raise ValueError(f"rule {rule.name!r}: a match and its lookahead span up to {compiled.span} "
                                     f"characters, more than holdback_chars {self.holdback_chars}")
        return self


class ResponseCacheOptions(_Strict):
    """The response cache (router/ingress/response_cache.py): each ingress replica keeps finished
    temperature-0 completions of the tenants that opt in, keyed by tenant, model, prompt token
    ids and every sampling parameter."""

    default_tenant: bool = Field(False, description="The 'default' tenant (no tenants configured) opts in")
    ttl_s: float = Field(60.0, gt=0, le=86_400, description="An entry is served for this long after it was stored")
    max_entries: int = Field(1024, ge=1, description="Entries per ingress replica (least recently used go first)")
    max_bytes: int = Field(16 * 2**20, ge=1024, description="Bytes of stored text, token ids and logprobs")
    max_entry_bytes: int = Field(256 * 2**10, ge=256, description="A larger completion is not stored")


class AppConfig(_Strict):
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: a prefill pool computes prompts and decode pulls their "
        "KV; colocated: no prefill pool, decode replicas prefill locally (a conventional server)")
    model: str | None = Field(None, description="HF checkpoint directory; None = SmolLM2-135M-Instruct (embedded default)")
    served_model_name: str | None = Field(None, description="Model id in the APIs; default: the dir name")
    engine: ServingEngineOptions = ServingEngineOptions()
    prefill: PoolOptions = PoolOptions()
    decode: PoolOptions = PoolOptions()
    ingress_replicas: int = Field(1, ge=1)
    kv_transfer: KVTransferOptions = KVTransferOptions()
    routing: RoutingOptions = RoutingOptions()
    host: str = Field(
        "127.0.0.1", description="HTTP bind address. Not loopback: API keys are required unless "
        "allow_unauthenticated (Serve's gRPC proxy binds all interfaces whatever this says)")
    allow_unauthenticated: bool = Field(
        False, description="Serve on a non-loopback host with no API keys (a trusted network only)")
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(9000, ge=1, le=65535)
    default_max_tokens: int = Field(16, ge=1)
    generation_config: Literal["auto", "none"] = Field(
        "auto", description="auto: a request's unset temperature, top_p and top_k come from the checkpoint's "
        "generation_config.json, as in vLLM; none: pdserve's defaults (1.0, 1.0, off)")
    tool_call_parser: Literal["none", "hermes"] = Field(
        "none", description="How tool calls are found in this model's free text, for OpenAI tool_choice 'auto' "
        "(vLLM's names; hermes: <tool_call>{\"name\", \"arguments\"}</tool_call>); none: 'auto' is refused with 400")
    api_keys: list[str] = Field(
        default_factory=list, description="Bearer keys of the 'default' tenant (no quotas); no keys and no tenants = no auth")
    api_keys_env: str | None = Field(None, description="Env var with the 'default' tenant's keys (ingress only)")
    api_keys_file: str | None = Field(None, description="Secret file with the 'default' tenant's keys (ingress only)")
    tenants: dict[str, TenantOptions] = Field(default_factory=dict)
    tenant_cache_isolation: bool = Field(
        True, description="Salt block hashes per tenant (cache_group), so tenants never share cached prefixes")
    admission: AdmissionOptions = AdmissionOptions()
    audit: AuditOptions = AuditOptions()
    budgets: BudgetOptions = BudgetOptions()
    ingress_limits: IngressLimits = IngressLimits()
    fault_tolerance: FaultToleranceOptions = FaultToleranceOptions()
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0, description="How long a stopping replica drains")
    health_check_period_s: float = Field(2.0, gt=0, description="How often Serve checks engine replicas")
    telemetry: TelemetryOptions = TelemetryOptions()
    guardrail_policies: dict[str, GuardrailPolicy] = Field(default_factory=dict, max_length=64)
    guardrail_policy: str | None = Field(None, description="The 'default' tenant's policy (a guardrail_policies name)")
    guardrail_classifier: ClassifierDeploymentOptions = ClassifierDeploymentOptions()
    response_cache: ResponseCacheOptions = ResponseCacheOptions()

    @model_validator(mode="after")
    def _decode_pool_exists(self) -> "AppConfig":
        for name, policy in [("default", self.guardrail_policy),
                             *((n, t.guardrail_policy) for n, t in self.tenants.items())]:
            if policy is not None and policy not in self.guardrail_policies:
                raise ValueError(f"tenant {name!r}: guardrail_policy {policy!r} is not in guardrail_policies")
        if self.decode.num_replicas < 1 and self.decode.autoscaling is None:
            raise ValueError("decode.num_replicas must be >= 1 (the decode pool serves every request)")
        seen: dict[str, str] = {}
        for name, keys in [("default", self.api_keys), *((n, t.api_keys) for n, t in self.tenants.items())]:
            for key in keys:
                if key in seen:
                    raise ValueError(f"an API key of tenant {name!r} is also a key of tenant {seen[key]!r}")
                seen[key] = name
        return self

    @property
    def default_keys(self) -> KeySources:
        return KeySources(api_keys=self.api_keys, api_keys_env=self.api_keys_env, api_keys_file=self.api_keys_file)

    @property
    def has_keys(self) -> bool:
        return self.default_keys.has_keys or any(t.has_keys for t in self.tenants.values())

    def check_startable(self) -> None:
        """Refuse to serve what would be open to anyone: a non-loopback bind with no API keys
        (unless allow_unauthenticated), or a tenant no key leads to. Checked by the builder and
        the ingress, not on every AppConfig: engine replicas get a config without keys."""
        for name, t in self.tenants.items():
            if not t.has_keys:
                raise ValueError(f"tenant {name!r} has no API keys (api_keys, api_keys_env or api_keys_file)")
        if self.host not in LOOPBACK_HOSTS and not self.has_keys and not self.allow_unauthenticated:
            raise ValueError(f"host {self.host!r} is not loopback and no API keys are configured: set api_keys_file, "
                             f"api_keys_env, api_keys or tenants, or allow_unauthenticated: true on a trusted network")

    def without_keys(self) -> "AppConfig":
        """This config with every API key source removed: what the engine replicas get."""
        return self.model_copy(update={"api_keys": [], "api_keys_env": None, "api_keys_file": None,
                                       "tenants": {n: t.without_keys() for n, t in self.tenants.items()}})

    @property
    def uses_classifier(self) -> bool:
        """A guardrail policy calls the classifier: the app deploys it."""
        return any(p.classifier is not None for p in self.guardrail_policies.values())

    @property
    def has_prefill_pool(self) -> bool:
        """Disaggregated with prefill replicas. Colocated ignores the prefill section; a
        disaggregated app with `prefill.num_replicas: 0` serves as colocated does."""
        return self.mode == "disaggregated" and (self.prefill.num_replicas > 0 or self.prefill.autoscaling is not None)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppConfig":
        return cls.model_validate(yaml.safe_load(Path(path).read_text()) or {})

    def engine_for(self, pool: Literal["prefill", "decode"]) -> ServingEngineOptions:
        return getattr(self, pool).engine or self.engine

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model or "pdserve-demo").name
