"""The models one ingress serves (issue 18): every version of every model has a RequestFlow of its
own (its tokenizer, its pools, its router group), and each model a traffic policy
(router/traffic.py) that assigns a request to one version before anything else happens. Both
replicas of a request are then chosen within that version, so no request mixes versions.

A request names a model (`model`; none: the first one configured) or pins a version with
`name@label` (an operator's probe of a canary, a test); an unknown model or version is NOT_FOUND
and the message lists what exists. The sticky key is the request's session key (x-session-id,
prompt_cache_key or the OpenAI `user`), scoped to its tenant as the routing key is.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace

from cluster.config import AppConfig
from cluster.engine.sampling_params import SamplingParams
from router.ingress.flow import RequestFlow
from router.ingress.shadow import ShadowRunner
from router.ingress.status import Code, ServingError
from router.traffic import Assignment, Shadow, TrafficPolicy

log = logging.getLogger(__name__)

PIN = "@"  # model@label


@dataclass(frozen=True)
class ServedModel:
    name: str
    policy: TrafficPolicy
    flows: dict[str, RequestFlow]  # version label -> flow, in config order (the first: the baseline)
    shadow_cap: int = 0  # mirrors at once on this ingress (shadow.max_inflight)

    def info(self) -> dict:
        base = next(iter(self.flows.values())).model_info()
        return {**base, "versions": [label for label in self.flows if label]}


@dataclass(frozen=True)
class Routed:
    """A request's version (its flow) and, when the model's shadow picked it, the candidate it is
    mirrored to (router/ingress/shadow.py)."""

    flow: RequestFlow
    assignment: Assignment
    shadow: RequestFlow | None = None
    runner: ShadowRunner | None = None
    shadow_cap: int = 0  # the model's shadow.max_inflight

    def generate(self, prompt, ids, sampling: SamplingParams, request_id: str | None = None, **kw):
        """As RequestFlow.generate, mirrored to the candidate if there is one (not a request with
        a response_format or tools: their grammar is compiled for the served version's tokenizer)."""
        deltas = self.flow.generate(prompt, ids, sampling, request_id, **kw)
        if self.shadow is None or sampling.response_format is not None or kw.get("tools"):
            return deltas
        return self.runner.mirror(deltas, self.shadow, self.shadow_cap, prompt, ids, sampling, kw["tenant"],
                                  kw.get("deadline"), kw.get("messages"), kw.get("tools"))

    def for_choices(self, n: int) -> "Routed":
        """What serves each of n choices: a request with n > 1 is not mirrored."""
        return self if n == 1 or self.shadow is None else replace(self, shadow=None)


class ModelCatalog:
    def __init__(self, config: AppConfig, models: dict[str, ServedModel], rng: random.Random | None = None):
        if not models:
            raise ValueError("a catalog serves at least one model")
        self.config = config  # the app's: limits, keys, tenants
        self.models = models
        self.default = next(iter(next(iter(models.values())).flows.values()))  # probes, /version, /metrics
        self.rng = rng or random.Random()
        self.shadow = ShadowRunner()  # the mirrors of every model, and their outcomes

    @classmethod
    def build(cls, config: AppConfig, flows: dict[tuple[str, str | None], RequestFlow],
              rng: random.Random | None = None) -> "ModelCatalog":
        """`flows`: (model name, version label) -> flow, for every AppConfig.served_versions() entry."""
        models = {}
        for version in config.served_versions():
            models.setdefault(version.name, {})[version.label or ""] = flows[version.name, version.label]
        served = {}
        for name, by_label in models.items():
            opts = config.models.get(name)
            if opts is None:  # a single-model app: one version, all its traffic
                policy = TrafficPolicy.of({label: 1.0 for label in by_label}, salt=name)
            else:
                shadow = None if opts.shadow is None else Shadow(opts.shadow.version, opts.shadow.fraction)
                policy = TrafficPolicy.of({label: v.weight for label, v in opts.versions.items()},
                                          tenant_overrides=dict(opts.tenant_overrides), shadow=shadow, salt=name)
            cap = 0 if opts is None or opts.shadow is None else opts.shadow.max_inflight
            served[name] = ServedModel(name, policy, by_label, cap)
        return cls(config, served, rng)

    @classmethod
    def of(cls, flow: RequestFlow) -> "ModelCatalog":
        """A single-model app's catalog: its one flow (tests and tools that build a flow themselves)."""
        return cls.build(flow.config, {(flow.config.model_name, flow.config.version): flow})

    @property
    def flows(self) -> list[RequestFlow]:
        return [f for m in self.models.values() for f in m.flows.values()]

    def authorize(self, authorization: str | None, model: str | None) -> str:
        """The caller's tenant, for both edges: refuses an unknown key (UNAUTHENTICATED) or model
        (NOT_FOUND), counting the refusal."""
        tenant = "unknown"
        flow = self.default
        try:
            tenant = flow.admission.authenticate(authorization)
            if model:
                self._lookup(model)
        except ServingError as e:
            if flow.telemetry is not None:
                flow.telemetry.refused(e, tenant)
            raise
        return tenant

    def _lookup(self, model: str | None) -> tuple[ServedModel, str | None]:
        """(model, pinned version label or None) for a request's `model`."""
        if not model:
            return next(iter(self.models.values())), None
        name, _, label = model.partition(PIN)
        served = self.models.get(name)
        if served is None:
            known = ", ".join(repr(n) for n in self.models)
            raise ServingError(Code.NOT_FOUND, f"model {model!r} does not exist; this server serves {known}")
        if PIN in model and label not in served.flows:
            known = ", ".join(repr(v) for v in served.flows if v)
            raise ServingError(Code.NOT_FOUND, f"model {name!r} has no version {label!r} (versions: {known or 'none'})")
        return served, (label if PIN in model else None)

    def select(self, model: str | None, tenant: str, session: str | None) -> Routed:
        """The version that serves this request (and the one it is mirrored to, if any)."""
        served, pinned = self._lookup(model)
        if pinned is not None:
            assignment = Assignment(pinned, "pinned")
        else:
            key = None if session is None else f"{tenant}\n{session}"  # as the routing key: tenants never share one
            assignment = served.policy.choose(key, tenant, self.rng)
        shadow = None if assignment.shadow is None else served.flows[assignment.shadow]
        return Routed(served.flows[assignment.version], assignment, shadow, self.shadow, served.shadow_cap)

    def model_info(self) -> list[dict]:
        return [m.info() for m in self.models.values()]
