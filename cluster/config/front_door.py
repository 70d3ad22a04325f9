"""The front door: API keys and tenants, admission, the ingress's input limits, the audit log and
budgets."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, StringConstraints

from cluster.config.common import Strict
from cluster.errors import InvalidRequestError


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
AUTO_QUEUE_WAIT_SHARE = 0.5  # max_queue_wait_s auto: this share of the TTFT objective (the rest is the prompt's own time)
AUTO_ITL_SHARE = 0.8  # target_itl_s auto: this share of the token-interval objective (headroom for the relay)
ApiKey = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]  # a blank key would match nothing


def state_home() -> Path:
    """This user's directory for state that must survive a reboot: $XDG_STATE_HOME/pdserve, else
    ~/.local/state/pdserve (the XDG base directory spec). Never /tmp: a reboot may empty it, and any
    local user may create files there first."""
    base = os.environ.get("XDG_STATE_HOME")
    return (Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "state") / "pdserve"


def state_path(configured: str | None, default: str) -> Path:
    """A configured path (`~` expanded), or `default` under state_home(). Resolved at use, in the
    process that uses it (the writer and ledger actors on the head node), not where the config was built."""
    return Path(os.path.expanduser(configured)) if configured else state_home() / default


class KeySources(Strict):
    """Where a tenant's API keys come from: inline, an environment variable or a secret file (one
    key a line, `#` comments; several keys in the variable are separated by commas or newlines).
    Only the ingress reads them, and keeps only their SHA-256; the engine replicas' config carries
    none of them (cluster/app/builder.py strips them)."""

    api_keys: list[ApiKey] = Field(
        default_factory=list, description="Keys in clear (prefer the env or file); never blank")
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
        None, min_length=1, description="Tenants with the same group share cached prefixes; default: the tenant's "
        "own (never empty: an empty group would share the unsalted cache of the default tenant)")
    guardrail_policy: str | None = Field(
        None, description="Name of a policy in guardrail_policies checking this tenant's prompts and output")
    response_cache: bool = Field(
        False, description="Serve repeated temperature-0 requests from the response cache (response_cache options)")
    monthly_budget_usd: float | None = Field(
        None, ge=0, description="Spend cap per calendar month (UTC) at budgets.prices; None = no cap "
        "(spend is still counted). Enforced across every ingress replica by the ledger actor")
    audit_text: bool = Field(
        False, description="Audit records carry the prompt and the output text (default: counts and ids only)")
    audit: bool = Field(
        True, description="With audit.enabled: each of this tenant's requests gets an audit record; False: none "
        "does (e.g. an internal load-test tenant), and a full audit buffer does not refuse its requests")
    pin_versions: bool = Field(
        False, description="May name a model version (`model@label`): any version, a canary at weight 0 or one "
        "rolled back included (an operator's probe). Pinned requests are no sample for the rollout gate. "
        "Without auth (no keys configured) the one caller may pin")


AUTO_FLOOR_MULTIPLE = 8.0  # an auto bound is never tighter than this many times the deployment's own floor


@dataclass(frozen=True)
class AdmissionBounds:
    """What the ingress's capacity checks enforce (router/ingress/gateway/capacity.py): the absolute
    part of each bound in seconds (None: that check is off) and, for a bound left `auto`, the multiple
    of the deployment's measured floor it is never tighter than (0: absolute, as configured)."""

    max_queue_wait_s: float | None
    target_itl_s: float | None
    queue_floor_multiple: float = 0.0
    itl_floor_multiple: float = 0.0
    batch_share: float = 0.5
    why: str = ""  # where the numbers came from, for the start-up line

    def describe(self) -> str:
        """One line for the start-up log: the bounds and how each was derived."""
        def bound(value: float | None, multiple: float, unit: str, floor: str) -> str:
            if value is None:
                return "off"
            text = f"{value:g} s" if unit == "s" else f"{value * 1e3:g} ms per token"
            return f"the larger of {text} and {multiple:g}x {floor}" if multiple else text
        wait = bound(self.max_queue_wait_s, self.queue_floor_multiple, "s",
                     "one request's own prompt time, as measured (never at one request ahead)")
        pace = bound(self.target_itl_s, self.itl_floor_multiple, "itl", "the fastest token interval measured")
        return (f"admission: refuse (429) work predicted to wait longer than {wait} for its prompt to start "
                f"(max_queue_wait_s), and new work while the decode streams run slower than {pace} (target_itl_s)"
                f"{f'; {self.why}' if self.why else ''}; 'none' turns either off")


class AdmissionOptions(Strict):
    max_inflight: int | Literal["auto"] = Field(
        "auto", description="Requests in flight per ingress replica; more get 429. auto: sized from the decode "
        "pool's KV (router/ingress/gateway/capacity.py InflightCap: twice the requests its blocks hold at the "
        "recent requests' prompt + max_tokens, this ingress's share, at least 64; 1024 until measured)")
    max_queue_wait_s: PositiveFloat | Literal["auto", "none"] | None = Field(
        "auto", description="Refuse (429) when the predicted wait before a request's prompt starts is "
        "longer (the ingress's own first-token queue, then the router's view of the replica). auto: the larger "
        "of half the TTFT objective and floor_multiple x one request's own prompt time as the deployment "
        "measures it, and never with at most one request ahead; a number: that bound alone; none (or null): off")
    target_itl_s: PositiveFloat | Literal["auto", "none"] | None = Field(
        "auto", description="Refuse (429) new work while the decode pool's streams, as the ingress relays "
        "them, would run slower than this per token (a limit on streams, set when they are measured slower, "
        "never under 2 or the streams just run within it, probed back up while they keep pace, lifted when "
        "the load falls back under it). auto: the larger of 0.8 of the token-interval objective and "
        "floor_multiple x the fastest interval the deployment has shown; a number: that bound alone; none: off")
    ttft_objective_s: PositiveFloat | None = Field(
        None, description="The TTFT objective auto bounds are derived from; default: telemetry.slo.ttft_threshold_s "
        "(which must be a histogram bucket bound; this need not: `pdserve plan --emit-config` writes its SLO here)")
    itl_objective_s: PositiveFloat | None = Field(
        None, description="The token-interval objective auto bounds are derived from; default: "
        "telemetry.slo.itl_threshold_s")
    floor_multiple: float = Field(
        AUTO_FLOOR_MULTIPLE, ge=0, description="An auto bound is never tighter than this many times what the "
        "deployment does at its own pace (a request's prompt time, a stream's token interval): a slow machine's "
        "ordinary load is not refused for missing an objective it can never meet. 0: the objective's share alone")
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

    def resolved(self, ttft_objective_s: float, itl_objective_s: float) -> AdmissionBounds:
        """The bounds the ingress enforces: `auto` derived from the objectives (this section's own, else
        the telemetry SLO's, passed in) and relative to the deployment's floors, `none` as None (off).
        Protection is on unless a config turns it off: a server that accepts everything in a burst misses
        every deadline in it (docs/benchmarks.md, 10x burst)."""
        ttft = self.ttft_objective_s or ttft_objective_s
        itl = self.itl_objective_s or itl_objective_s

        def value(v, auto: float) -> tuple[float | None, float]:
            if v == "auto":
                return auto, self.floor_multiple
            return (None if v in ("none", None) else v), 0.0
        wait, wait_multiple = value(self.max_queue_wait_s, AUTO_QUEUE_WAIT_SHARE * ttft)
        pace, pace_multiple = value(self.target_itl_s, AUTO_ITL_SHARE * itl)
        source = "admission" if self.ttft_objective_s or self.itl_objective_s else "telemetry.slo"
        return AdmissionBounds(wait, pace, wait_multiple, pace_multiple, self.batch_share,
                               why=f"objectives TTFT {ttft:g} s, token interval {itl * 1e3:g} ms ({source})")


class IngressLimits(Strict):
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
        4 * 2**20, ge=1024, description="gRPC request message size: a larger message is refused once read (400 "
        "INVALID_ARGUMENT naming this limit); the ingress's gRPC transport reads at most 4x this (more: "
        "RESOURCE_EXHAUSTED, unread)")
    grpc_max_concurrent_rpcs: int = Field(
        4096, ge=1, description="gRPC calls the ingress's server runs at once, streams and health checks "
        "included; one more is refused by gRPC at once (RESOURCE_EXHAUSTED), before its message is read. An "
        "outer bound on what a flood of calls holds: admission's max_inflight (429) refuses requests first")

    def check_choices(self, n: int) -> None:
        """OpenAI's `n` (HTTP) and GenerateRequest.n (gRPC): one bound, one message."""
        if not 1 <= n <= self.max_choices:
            raise InvalidRequestError("n", f"must be in [1, {self.max_choices}] (max_choices), got {n}")


class AuditOptions(Strict):
    """The audit log (router/ingress/gateway/audit*.py): one hash-chained JSON line per request, written by
    one writer actor on the head node; each ingress spools its records locally and resends until
    the writer acknowledges them (at-least-once; the writer drops duplicates by request id)."""

    enabled: bool = Field(False, description="Write an audit record for every request that reaches the flow")
    dir: str | None = Field(
        None, description="The log's directory, on the head node (the writer's); default: "
        "$XDG_STATE_HOME/pdserve/audit (~/.local/state/pdserve/audit) of the user the writer runs as")
    spool_dir: str | None = Field(
        None, description="Each ingress's local spool of unacknowledged records (created mode 0700); default: "
        "<dir>/spool (same node)")
    max_file_bytes: int = Field(64 * 2**20, ge=4096, description="Rotate to a new file past this size (and each UTC day)")
    batch_records: int = Field(512, ge=1, description="Most records an ingress sends the writer in one call")
    flush_interval_s: float = Field(
        1.0, gt=0, description="How long an ingress gathers records before a writer call (sooner when a batch is "
                               "full or it drains); records are in its local spool meanwhile")
    max_buffered: int = Field(
        100_000, ge=1, description="Unacknowledged records an ingress holds (writer down); past it: when_full")
    when_full: Literal["drop", "refuse"] = Field(
        "refuse", description="Buffer full: refuse new requests (503, fail closed) or drop their records (counted)")
    dedup_window: int = Field(
        200_000, ge=1, description="Recent request ids the writer remembers (read back from the log's tail at start)")
    writer_timeout_s: float = Field(5.0, gt=0, description="Bound on one writer call; on failure the ingress retries")

    def log_dir(self) -> Path:
        return state_path(self.dir, "audit")

    def spool_directory(self) -> Path:
        return state_path(self.spool_dir, "audit") if self.spool_dir else self.log_dir() / "spool"


class ModelPrice(Strict):
    prompt_per_1k: float = Field(0.0, ge=0, description="USD per 1,000 prompt tokens")
    completion_per_1k: float = Field(0.0, ge=0, description="USD per 1,000 completion tokens")


class BudgetOptions(Strict):
    """Prices and the spend ledger (router/ingress/gateway/budget*.py). A request of a tenant with a
    monthly budget reserves its worst case (prompt + max_tokens at the model's prices) before it
    runs and settles the actual cost at its end; the ledger refuses a reservation that would pass
    the budget, so spend never exceeds it (docs/architecture.md, Budgets)."""

    prices: dict[str, ModelPrice] = Field(
        default_factory=dict, description="Per served model name; a model without a price costs 0")
    ledger_path: str | None = Field(
        None, description="The ledger's file, on the head node; default: $XDG_STATE_HOME/pdserve/ledger.json "
        "(~/.local/state/pdserve/ledger.json) of the user the ledger actor runs as")
    when_unreachable: Literal["closed", "open"] = Field(
        "closed", description="Ledger unreachable at admission: refuse (503) or admit unchecked (charged later)")
    timeout_s: float = Field(1.0, gt=0, description="Bound on the ledger call at admission")
    reservation_ttl_s: float = Field(
        3600.0, gt=0, description="A reservation never settled (its ingress died) is charged in full after this")
    alert_fraction: float = Field(0.8, gt=0, le=1, description="The spend alert fires past this share of a budget")

    def ledger_file(self) -> Path:
        return state_path(self.ledger_path, "ledger.json")
