"""The models one ingress serves (issue 18): every version of every model has a RequestFlow of its
own (its tokenizer, its pools, its router group), and each model a traffic policy
(router/traffic.py) that assigns a request to one version before anything else happens. Both
replicas of a request are then chosen within that version, so no request mixes versions.

A request names a model (`model`; none: the first one configured) or pins a version with
`name@label` (an operator's probe of a canary, a test: a permission of the tenant's, checked by the
front door, and no sample for the rollout gate); an unknown model or version is NOT_FOUND and the
message lists what exists. The sticky key is the request's session key (x-session-id,
prompt_cache_key or the OpenAI `user`), scoped to its tenant as the routing key is.
"""

from __future__ import annotations

import asyncio
import logging
import random
from contextlib import aclosing

import ray
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from cluster.config import AppConfig
from cluster.engine.request import RequestContext
from cluster.engine.sampling_params import SamplingParams
from router.ingress.flow.request_flow import RequestFlow
from router.ingress.request import ClientRequest, Delta
from router.ingress.versions.rollout import Recorder
from router.ingress.versions.shadow import ShadowRunner
from router.ingress.status import Code, ServingError
from router.traffic import Assignment, Shadow, TrafficPolicy

log = logging.getLogger(__name__)

PIN = "@"  # model@label
SYNC_TIMEOUT_S = 5.0
ECHO_CHARS = 64  # of a client's unknown model name or version quoted back in the error


@dataclass(frozen=True)
class ServedModel:
    name: str
    policy: TrafficPolicy
    flows: dict[str, RequestFlow]  # version label -> flow, in config order (the first: the baseline)
    shadow_cap: int = 0  # mirrors at once on this ingress (shadow.max_inflight)

    def info(self, tenant: str | None = None) -> dict:
        """Its limits (those of the first version listed) and its version labels. `tenant`: only
        the versions its requests can get unpinned (a weight above 0 in the live split, or its
        tenant override): a canary at weight 0 stays unlisted; None: every version."""
        weights = dict(self.policy.split)
        labels = [label for label in self.flows if tenant is None or weights.get(label, 0.0) > 0
                  or self.policy.tenant_overrides.get(tenant) == label]
        base = self.flows[labels[0]] if labels else next(iter(self.flows.values()))  # a split's sum is > 0
        return {**base.model_info(), "versions": [label for label in labels if label]}


@dataclass(frozen=True)
class Routed:
    """A request's version (its flow) and, when the model's shadow picked it, the candidate it is
    mirrored to (router/ingress/versions/shadow.py)."""

    flow: RequestFlow
    assignment: Assignment
    shadow: RequestFlow | None = None
    runner: ShadowRunner | None = None
    shadow_cap: int = 0  # the model's shadow.max_inflight
    recorder: Recorder | None = None  # the rollout gate's outcomes by version (models with several)

    def watch(self, deltas: AsyncIterator[Delta], request: ClientRequest, sampling: SamplingParams,
              ctx: RequestContext, busy: Callable[[], bool]) -> AsyncIterator[Delta]:
        """A request's stream on this version, its errors naming the version (model@label), its
        outcome recorded for the rollout gate, mirrored to the candidate if there is one (not a
        request with a response_format or tools: their grammar is compiled for the served
        version's tokenizer)."""
        if self.flow.config.version is not None:
            deltas = named(deltas, self.flow.group)
        if self.recorder is not None:
            deltas = self.recorder.observe((self.flow.config.model_name, self.assignment.version), deltas)
        if self.shadow is None or sampling.response_format is not None or request.tools is not None:
            return deltas
        return self.runner.mirror(deltas, self.shadow, self.shadow_cap, request, sampling, ctx, busy)

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
        self.recorder = Recorder()
        self.generation = -1  # of the rollout actor's splits applied here (-1: the config's)
        self._sync: asyncio.Task | None = None
        self._actor, self._period_s = None, 1.0  # the rollout actor (connect), when a model has several versions

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
                policy = TrafficPolicy.of(opts.weights,
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

    def lookup(self, model: str | None) -> tuple[ServedModel, str | None]:
        """(model, pinned version label or None) for a request's `model`."""
        if not model:
            return next(iter(self.models.values())), None
        name, _, label = model.partition(PIN)
        served = self.models.get(name)
        if served is None:
            known = ", ".join(repr(n) for n in self.models)
            raise ServingError(Code.NOT_FOUND, f"model {_echo(model)} does not exist; this server serves {known}")
        if PIN in model and label not in served.flows:
            known = ", ".join(repr(v) for v in served.flows if v)
            raise ServingError(Code.NOT_FOUND,
                               f"model {name!r} has no version {_echo(label)} (versions: {known or 'none'})")
        return served, (label if PIN in model else None)

    def select(self, model: str | None, tenant: str, session: str | None) -> Routed:
        """The version that serves this request (and the one it is mirrored to, if any)."""
        self._ensure_sync()
        served, pinned = self.lookup(model)
        if pinned is not None:
            assignment = Assignment(pinned, "pinned")
        else:
            key = None if session is None else f"{tenant}\n{session}"  # as the routing key: tenants never share one
            assignment = served.policy.choose(key, tenant, self.rng)
        shadow = None if assignment.shadow is None else served.flows[assignment.shadow]
        # the gate judges a version by the traffic its split sends it: a probe pinned to it is no sample
        recorder = self.recorder if len(served.flows) > 1 and pinned is None else None
        return Routed(served.flows[assignment.version], assignment, shadow, self.shadow, served.shadow_cap, recorder)

    def model_info(self, tenant: str | None = None) -> list[dict]:
        """Every model, each with the versions `tenant` can get unpinned (None: every version)."""
        return [m.info(tenant) for m in self.models.values()]

    # ---- run-time splits (router/ingress/versions/rollout.py) ------------------------------------------

    def rollout_models(self) -> dict:
        """What the rollout actor is configured with: each model of several versions, its
        configured weights and gate options."""
        return {name: (opts.weights, opts.rollout)
                for name, opts in self.config.models.items() if len(opts.versions) > 1}

    def apply(self, generation: int, splits: dict[str, dict[str, float]]) -> None:
        """The rollout actor's splits: each model's policy keeps its overrides, shadow and salt."""
        for name, weights in splits.items():
            served = self.models.get(name)
            if served is not None and sum(weights.values()) > 0:
                policy = replace(served.policy, split=tuple((v, weights.get(v, 0.0)) for v in served.flows))
                self.models[name] = replace(served, policy=policy)
        self.generation = generation

    def connect(self, actor, timeout_s: float) -> None:
        """Configure the rollout actor and take its live splits now (before any request: a split
        changed at run time holds for a replica started after the change); the sync loop starts
        with the first request, on the replica's event loop."""
        models = self.rollout_models()
        self.apply(*ray.get(actor.configure.remote(models), timeout=timeout_s))
        self._actor, self._period_s = actor, min(o.evaluate_s for _, o in models.values())

    def _ensure_sync(self) -> None:
        if self._actor is not None and (self._sync is None or self._sync.done()):
            self._sync = asyncio.ensure_future(self._sync_loop(self._actor, self._period_s))

    async def _sync_loop(self, actor, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)  # a period: the reports' and the splits' cadence, not a wait on anything
            stats = self.recorder.drain()
            try:
                changed = await asyncio.wait_for(actor.sync.remote(stats, self.generation), SYNC_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 — the actor restarting: keep the split, resend next time
                log.info("rollout sync failed (%r); keeping the current split", e)
                for key, s in stats.items():
                    self.recorder.pending.setdefault(key, type(s)()).add(s)
                continue
            if changed is not None:
                self.apply(*changed)


async def named(deltas: AsyncIterator[Delta], version: str) -> AsyncIterator[Delta]:
    """`deltas`, a ServingError from them naming the version that failed (`model@label`), on
    both edges (their messages are the error's)."""
    async with aclosing(deltas):
        try:
            async for d in deltas:
                yield d
        except ServingError as e:
            error = type(e).__new__(type(e))  # a copy: one error object may be raised more than once
            error.__dict__.update(e.__dict__, message=f"{e.message} (version {version})")
            error.args = (error.message,)
            raise error from e


def _echo(value: str) -> str:
    """A client's value quoted in an error, at most ECHO_CHARS of it (the message stays small)."""
    return repr(value) if len(value) <= ECHO_CHARS else f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"
