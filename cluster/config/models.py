"""Several models, and several versions of each, behind one endpoint (issue 18): each version has its
own prefill and decode pools; each model a traffic policy over its versions (router/traffic.py)."""

from __future__ import annotations

import re

from pydantic import Field, FieldSerializationInfo, field_serializer, field_validator, model_validator

from cluster.config.common import Strict, as_written
from cluster.config.pools import PoolOptions, ServingEngineOptions

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # model names and version labels
MAX_MODELS = 16
MAX_VERSIONS = 8


def check_name(kind: str, v: str) -> str:
    if not NAME_RE.fullmatch(v):
        raise ValueError(f"{kind} {v!r}: 1-64 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit")
    return v


class SamplingDefaults(Strict):
    """What a request that leaves these unset gets (None: the checkpoint's generation_config, and
    the app's default_max_tokens)."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=1)

    def overrides(self) -> dict:
        """The sampling parameters it sets (max_tokens apart: that is the app's default_max_tokens)."""
        return self.model_dump(exclude={"max_tokens"}, exclude_none=True)


class VersionOptions(Strict):
    """One version of a model: its checkpoint (or a manifest pinning it), its share of the traffic
    and, where it differs from the app's, its pools and engine.

    `engine`, `prefill` and `decode` are laid over the app-wide sections key by key, at every
    level (cluster.config.common.overlay): the keys a version sets win, every other key is the
    app's. `engine: {max_num_seqs: 8}` keeps the app's `num_blocks`; `decode: {num_replicas: 2}`
    keeps the app's `num_cpus` (and its `autoscaling`, if it has one: set `autoscaling: null`
    to use num_replicas). A version given by a manifest: the app's, then the manifest's, then
    the version's own keys."""

    model: str | None = Field(None, description="HF checkpoint directory or Hub repo id (or give `manifest`)")
    manifest: str | None = Field(
        None, description="A model manifest (`pdserve models manifest`): the checkpoint at its source, refused at "
        "deploy if any pinned file changed; its engine, pool and sampling keys apply unless set here")
    weight: float = Field(1.0, ge=0, description="Share of the model's traffic (relative to its other versions)")
    engine: ServingEngineOptions | None = Field(
        None, description="Laid over the app-wide `engine` key by key: the keys set here win, the rest are the app's")
    prefill: PoolOptions | None = Field(
        None, description="Laid over the app's `prefill` key by key (its pool: prefill-<model>-<label>)")
    decode: PoolOptions | None = Field(
        None, description="Laid over the app's `decode` key by key (its pool: decode-<model>-<label>)")
    sampling: SamplingDefaults | None = Field(None, description="Defaults for what a request leaves unset")

    @field_serializer("engine", "prefill", "decode", "sampling")
    def _as_written(self, section, info: FieldSerializationInfo):
        return as_written(section, info)

    @model_validator(mode="after")
    def _one_source(self) -> "VersionOptions":
        if (self.model is None) == (self.manifest is None):
            raise ValueError("give exactly one of model (a checkpoint directory) or manifest")
        return self


class ShadowOptions(Strict):
    """Mirror a fraction of a model's requests to one of its versions: the mirror runs at the lowest
    priority, its output is compared with the answer the client got and counted, never returned,
    never billed, never counted against the tenant's quotas, and shed first."""

    version: str
    fraction: float = Field(ge=0, le=1, description="Of the requests served by another version")
    max_inflight: int = Field(4, ge=1, description="Mirrors running at once per ingress; more are shed (counted)")


class RolloutOptions(Strict):
    """The canary gate (router/ingress/versions/rollout.py): every `evaluate_s`, each version that is not the
    baseline (the first listed) and takes traffic is compared with the baseline over the last
    `window_s`; when it burns its error budget too fast, or its latency is too far behind, all its
    traffic goes back to the baseline and the decision is logged with its numbers."""

    auto_rollback: bool = Field(True, description="Roll back on a tripped gate (false: log the decision only)")
    window_s: float = Field(30.0, gt=0, le=3600, description="The window the versions are compared over")
    evaluate_s: float = Field(1.0, gt=0, le=60, description="How often the gate is evaluated")
    min_requests: int = Field(20, ge=1, description="A canary with fewer requests in the window is not judged")
    error_slo: float = Field(0.99, gt=0, lt=1, description="Target fraction of requests without a server fault")
    max_burn_rate: float = Field(
        10.0, gt=0, description="Roll back when the canary's error rate / (1 - error_slo) reaches this and its "
        "error rate is above the baseline's")
    max_ttft_ratio: float = Field(3.0, gt=1, description="... or its TTFT per prompt token reaches this x the baseline's")
    max_tpot_ratio: float = Field(3.0, gt=1, description="... or its mean time per output token this x the baseline's")
    max_candidate_share: float = Field(
        1.0, gt=0, le=1, description="Blast radius: the most of the model's traffic the versions other than the "
        "baseline may take together; a split past it (config or `pdserve rollout set`) is refused")


class ModelOptions(Strict):
    versions: dict[str, VersionOptions] = Field(min_length=1, max_length=MAX_VERSIONS,
                                                description="Version label -> version; the first is the baseline")
    tenant_overrides: dict[str, str] = Field(
        default_factory=dict, description="Tenant -> version label: the tenant always gets that version")
    shadow: ShadowOptions | None = None
    rollout: RolloutOptions = RolloutOptions()

    @field_validator("versions")
    @classmethod
    def _labels(cls, v: dict[str, VersionOptions]) -> dict[str, VersionOptions]:
        for label in v:
            check_name("version label", label)
        if sum(o.weight for o in v.values()) <= 0:
            raise ValueError("the versions' weights must have a positive sum")
        return v

    @property
    def weights(self) -> dict[str, float]:
        """Version label -> configured weight, in config order (the first: the baseline)."""
        return {label: v.weight for label, v in self.versions.items()}

    @model_validator(mode="after")
    def _known_versions(self) -> "ModelOptions":
        share = candidate_share(self.weights)
        if share > self.rollout.max_candidate_share + 1e-9:
            raise ValueError(f"the versions after the baseline take {share:.1%} of the traffic, over "
                             f"rollout.max_candidate_share {self.rollout.max_candidate_share:.1%}")
        for tenant, label in self.tenant_overrides.items():
            if label not in self.versions:
                raise ValueError(f"tenant_overrides.{tenant}: unknown version {label!r} (known: {list(self.versions)})")
        if self.shadow is not None and self.shadow.version not in self.versions:
            raise ValueError(f"shadow.version: unknown version {self.shadow.version!r} (known: {list(self.versions)})")
        return self


def candidate_share(weights: dict[str, float]) -> float:
    """The share of traffic the versions after the first (the baseline) take together."""
    total = sum(weights.values())
    return 0.0 if total <= 0 else (total - next(iter(weights.values()))) / total
