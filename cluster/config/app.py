"""The whole app's configuration: one pydantic schema for `pdserve up --config` and `serve run`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from cluster.config.common import Strict, overlay
from cluster.config.front_door import (LOOPBACK_HOSTS, AdmissionBounds, AdmissionOptions, ApiKey, AuditOptions,
                                       BudgetOptions, IngressLimits, KeySources, TenantOptions)
from cluster.config.models import MAX_MODELS, ModelOptions, SamplingDefaults, VersionOptions, check_name
from cluster.config.pools import (FaultToleranceOptions, KVTransferOptions, PlannerOptions, PoolOptions,
                                  RoutingOptions, ServingEngineOptions)
from cluster.config.safety import ClassifierDeploymentOptions, GuardrailPolicy, ResponseCacheOptions
from cluster.config.telemetry import TelemetryOptions


class AppConfig(Strict):
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: a prefill pool computes prompts and decode pulls their "
        "KV; colocated: no prefill pool, decode replicas prefill locally (a conventional server)")
    model: str | None = Field(None, description="HF checkpoint directory or Hub repo id (org/name); None = "
                                  "SmolLM2-135M-Instruct (embedded default)")
    served_model_name: str | None = Field(None, description="Model id in the APIs; default: the dir name")
    version: str | None = Field(
        None, description="This model's version label: reported with every response (OpenAI system_fingerprint, "
        "gRPC model_version) and in its metrics. With `models`, each version has its own")
    models: dict[str, ModelOptions] = Field(
        default_factory=dict, max_length=MAX_MODELS, description="Several models, each with versions and a traffic "
        "split, behind one endpoint (instead of model/served_model_name/version): `model` in a request picks one, "
        "the first listed when a request names none; each version gets its own prefill and decode pools")
    engine: ServingEngineOptions = ServingEngineOptions()
    prefill: PoolOptions = PoolOptions()
    decode: PoolOptions = PoolOptions()
    ingress_replicas: int = Field(1, ge=1)
    ingress_nice: int | None = Field(
        0, ge=-20, le=19, description="OS niceness an ingress replica's threads run at, or better: those Ray "
        "started above it (its worker_niceness, 15) are raised to it, so the front door (admission, refusals, "
        "token relay) gets the CPU before the engines' compute (compute_nice; 15 under Ray) where they share "
        "cores. Raising priority needs CAP_SYS_NICE (or Ray started with RAY_worker_niceness at or below it); "
        "without it, a warning and Ray's niceness. None: leave it as Ray set it (docs/architecture.md, 'CPU "
        "priority')")
    ingress_event_loops: Literal[1, 2] = Field(
        1, description="Event loops an ingress replica runs its gRPC server on. 1: the server on the front door's "
        "loop (no hand-off between threads a call and a response). 2: gRPC's transport on a loop and thread of its "
        "own, which takes new calls and refuses a bad key or a shedding door even while the front door's loop is "
        "stopped (docs/architecture.md, 'The gRPC server')")
    decode_replies: Literal["channel", "serve"] = Field(
        "channel", description="How a decode replica sends a leg's outputs to the ingress. channel: msgpack frames "
        "on a socket of their own, one per ingress (Unix on the same node, else TCP), the Serve call kept for "
        "placement, limits, cancellation and failure; serve: streamed on the Serve call (docs/architecture.md, "
        "'Decode outputs on a socket of their own')")
    kv_transfer: KVTransferOptions = KVTransferOptions()
    routing: RoutingOptions = RoutingOptions()
    planner: PlannerOptions = PlannerOptions()
    host: str = Field(
        "127.0.0.1", description="HTTP and gRPC bind address. Not loopback: API keys are required unless "
        "allow_unauthenticated")
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
    api_keys: list[ApiKey] = Field(
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
        if self.planner.enabled and self.mode == "colocated":
            raise ValueError("planner.enabled needs mode: disaggregated (a colocated app has one pool: nothing to split)")
        self._one_owner_per_pool_size("", {pool: getattr(self, pool) for pool in ("prefill", "decode")})
        for name, policy in [("default", self.guardrail_policy),
                             *((n, t.guardrail_policy) for n, t in self.tenants.items())]:
            if policy is not None and policy not in self.guardrail_policies:
                raise ValueError(f"tenant {name!r}: guardrail_policy {policy!r} is not in guardrail_policies")
        for name, p in self.guardrail_policies.items():  # a longer chunk: every prompt check an error
            if p.classifier is not None and p.classifier.input_chunk_chars > self.guardrail_classifier.max_text_chars:
                raise ValueError(f"guardrail_policies.{name}.classifier.input_chunk_chars "
                                 f"{p.classifier.input_chunk_chars} exceeds guardrail_classifier.max_text_chars "
                                 f"{self.guardrail_classifier.max_text_chars}")
        if self.models:
            if self.model is not None or self.served_model_name is not None or self.version is not None:
                raise ValueError("give either models or model/served_model_name/version, not both")
            known = {"default", *self.tenants}
            for name, m in self.models.items():
                check_name("model name", name)
                for tenant in m.tenant_overrides:
                    if tenant not in known:
                        raise ValueError(f"models.{name}.tenant_overrides: unknown tenant {tenant!r}")
            deployments = [d for name, m in self.models.items() for label in m.versions
                           for d in version_deployments(name, label)]
            if len(set(deployments)) != len(deployments):
                raise ValueError(f"models: two versions make the same deployment names ({sorted(deployments)})")
            for name, m in self.models.items():  # every version's sections laid over the app's hold
                for label, v in m.versions.items():
                    where = f"models.{name}.versions.{label}"
                    self._one_owner_per_pool_size(f"{where}.", self._version_sections(where, v))
        elif self.version is not None:
            check_name("version", self.version)
        for pool in ("prefill", "decode"):
            try:
                tp = self.engine_for(pool).tensor_parallel_size
            except ValueError as e:
                raise ValueError(f"{pool}.engine, laid over the app's engine: {e}") from e
            options = getattr(self, pool)
            if tp > 1 and options.num_cpus == 0 and options.num_gpus == 0:
                raise ValueError(f"{pool}: tensor_parallel_size {tp} needs num_cpus or num_gpus > 0 (each rank's "
                                 "placement group bundle asks for them)")
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
    def admission_bounds(self) -> AdmissionBounds:
        """The admission bounds with `auto` derived from the objectives (admission's own, else
        telemetry.slo's): what the ingress enforces and logs at start."""
        slo = self.telemetry.slo
        return self.admission.resolved(slo.ttft_threshold_s, slo.itl_threshold_s)

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
        """The pool's engine: its own `engine` keys laid over the app-wide (or version's) engine."""
        return overlay(self.engine, getattr(self, pool).engine)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model or "pdserve-demo").name

    @property
    def serving_group(self) -> str:
        """The replicas that may serve one request together, both pools: one model version. Replicas
        report it with their load and the router chooses within it, so a request's prefill and
        decode never run on two versions."""
        return self.model_name if self.version is None else f"{self.model_name}@{self.version}"

    def served_versions(self) -> list["ServedVersion"]:
        """Every (model, version) the app serves, in config order, each with the config its pools
        and its ingress flow are built from (the app's, with the version's checkpoint, pools,
        engine and default max_tokens in place: its `engine`, `prefill` and `decode` laid over the
        app's key by key, cluster.config.common.overlay). Without `models`: this config, once.
        Versions given by a manifest are resolved first (cluster.manifest.resolve_manifests, at
        deploy; `pdserve up` resolves them before Ray starts)."""
        if not self.models:
            return [ServedVersion(self.model_name, self.version, self, single=True)]
        out = []
        for name, m in self.models.items():
            for label, v in m.versions.items():
                if v.manifest is not None:
                    raise ValueError(f"models.{name}.versions.{label}: its manifest is not resolved yet")
                sampling = v.sampling or SamplingDefaults()
                cfg = self.model_copy(update={
                    "model": v.model, "served_model_name": name, "version": label, "models": {},
                    **self._version_sections(f"models.{name}.versions.{label}", v),
                    "default_max_tokens": sampling.max_tokens or self.default_max_tokens})
                out.append(ServedVersion(name, label, cfg, sampling=sampling))
        return out

    def _one_owner_per_pool_size(self, where: str, pools: dict) -> None:
        """Exactly one controller sizes a pool: the run-time planner moves replicas between prefill and
        decode (each move changes both sizes), an autoscaler adds and removes one pool's replicas. Both
        on the same pools would act on the same signals with nothing to arbitrate (one adding decode
        replicas while the other moves one away), so the config names one."""
        if not self.planner.enabled:
            return
        for pool in ("prefill", "decode"):
            if pools[pool].autoscaling is not None:
                raise ValueError(f"{where}{pool}.autoscaling and planner.enabled both size this pool: the planner "
                                 f"owns both pools' sizes while it is on (it moves replicas between them); drop "
                                 f"{where}{pool}.autoscaling, or turn planner.enabled off to let the autoscalers own them")

    def _version_sections(self, where: str, v: VersionOptions) -> dict:
        """A version's engine and pools: its keys laid over the app's (a ValueError names the
        section whose result is not valid)."""
        out = {}
        for section in ("engine", "prefill", "decode"):
            try:
                out[section] = overlay(getattr(self, section), getattr(v, section))
            except ValueError as e:
                raise ValueError(f"{where}.{section}, laid over the app's {section}: {e}") from e
        for pool in ("prefill", "decode"):
            try:
                overlay(out["engine"], out[pool].engine)
            except ValueError as e:
                raise ValueError(f"{where}.{pool}.engine, laid over its engine: {e}") from e
        return out


@dataclass(frozen=True)
class ServedVersion:
    name: str
    label: str | None  # None: a single-model app that names no version
    config: AppConfig
    single: bool = False  # the app's one model: its deployments keep the plain names prefill and decode
    sampling: SamplingDefaults = SamplingDefaults()  # over the checkpoint's generation_config

    @property
    def deployments(self) -> tuple[str, str]:
        """(prefill, decode) deployment names."""
        return ("prefill", "decode") if self.single else version_deployments(self.name, self.label)


def version_deployments(name: str, label: str) -> tuple[str, str]:
    return f"prefill-{name}-{label}", f"decode-{name}-{label}"
