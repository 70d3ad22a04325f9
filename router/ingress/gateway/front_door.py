"""The front door the edges call: `authorize` (who is calling) and `serve` (one ClientRequest,
every choice started, or a refusal). Everything between an edge and a version's flow is here:

    serve(request) -> version (versions/catalog.py) -> its sampling (flow/sampling.py)
                   -> n choices, each: gateway stages (gateway/stages.py) -> flow -> stages' wrappers
                   -> the version's watchers (rollout gate, shadow) -> the edge

`FrontDoor.build` assembles it for a config: one flow and one gateway per model version, sharing
the app's admission (slots, quotas, keys), telemetry and audit shipper.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, NamedTuple

from cluster.config import AppConfig
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import Tokenizer
from cluster.errors import InvalidRequestError
from router.ingress.flow.request_flow import RequestFlow
from router.ingress.flow.tools import ToolUse
from router.ingress.gateway.admission import Admission, AdmissionStage, QuotaStage, Quotas, TakeFn
from router.ingress.gateway.audit import AuditShipper, AuditStage, refusal_record, shadow_record
from router.ingress.gateway.budget import Budget, BudgetStage
from router.ingress.gateway.capacity import Capacity, CapacityStage
from router.ingress.gateway.guardrails import Guardrails, GuardStage
from router.ingress.gateway.idempotency import Idempotent
from router.ingress.gateway.response_cache import ResponseCache, ResponseCacheStage
from router.ingress.gateway.stages import Gateway, Outcome, Stage
from router.replies import ReplyInbox
from router.ingress.gateway.telemetry import IngressTelemetry, TelemetryStage
from router.ingress.request import ClientRequest, Delta
from router.ingress.status import Code, Rejected, ServingError
from router.ingress.versions.catalog import PIN, ModelCatalog, Routed


class Choice(NamedTuple):
    stream: AsyncIterator[Delta]  # the deltas after `first`
    first: Delta
    outcome: Outcome  # what the gateway decided about it (a response-cache hit, ...)


@dataclass(frozen=True)
class Reply:
    """A request's started choices, and what the edges need to shape them."""

    choices: list[Choice]
    model: str
    version: str  # the label of the version that serves ("" for a model of one version)
    use: ToolUse  # how the request uses its tools (the edges shape calls from the text)
    tokenizer: Tokenizer  # the version's: logprobs' token text, a token-id prompt's echo


def local_quotas() -> TakeFn:
    """The quota buckets in this process (no quota actor: tests and tools)."""
    quotas = Quotas()

    async def take(*args):
        return quotas.take(*args)

    return take


class RequestIds:
    """Request ids, 128 random bits each (as uuid4's hex), read from the OS `batch` ids at a time:
    `os.urandom` releases the GIL, and on the front door's loop a release can hand it to another
    thread for a while (gateway/metric_batch.py). One loop's thread uses it."""

    def __init__(self, batch: int = 256):
        self.size = 16 * batch
        self._bytes, self._at = b"", self.size

    def next(self) -> str:
        at = self._at
        if at >= self.size:
            self._bytes, at = os.urandom(self.size), 0
        self._at = at + 16
        return self._bytes[at:at + 16].hex()


class FrontDoor:
    def __init__(self, config: AppConfig, catalog: ModelCatalog, gateways: dict[str, Gateway],
                 capacities: dict[str, Capacity], admission: Admission, telemetry: IngressTelemetry | None = None,
                 idempotent: Idempotent | None = None, audit: AuditShipper | None = None):
        self.config = config  # the app's: limits, keys, tenants
        self.catalog = catalog
        self.gateways = gateways  # serving group (a version) -> its stages
        self.capacities = capacities  # serving group -> its measured capacity
        self.admission = admission
        self.telemetry = telemetry
        self.idempotent = idempotent  # runs a request with an Idempotency-Key once (HTTP)
        self.audit = audit
        self.replies = None  # the decode legs' ReplyInbox (router/replies.py), when built with one
        self._ids = RequestIds()
        # calls that reached the door (authorized or not, or refused on arrival), on its loop: the
        # ingress collects garbage when this has not moved for a while (cluster/telemetry/gc_pauses.py)
        self.arrivals = 0

    @classmethod
    def build(cls, config: AppConfig, pools: dict, *, routers: dict | None = None, take: TakeFn | None = None,
              key_digests: dict | None = None, telemetry: IngressTelemetry | None = None,
              audit: AuditShipper | None = None, ledger: Callable[[], object] | None = None, classifier=None,
              guard_metrics=None, idempotency_actor=None, replies: ReplyInbox | None = None) -> "FrontDoor":
        """`pools`: serving group -> (prefill handle or None, decode handle), one per version;
        `routers`: serving group -> its router actor (None: Serve's own replica choice);
        `take`: the shared quota buckets (the quota actor's `take`; default: this process's);
        `ledger`: the budget ledger actor's getter, when budgets are configured; `replies`: where
        decode replicas write the legs' outputs (router/replies.py; None: on Serve's calls)."""
        admission = Admission(config, take or local_quotas(), key_digests)
        flows, gateways, capacities = {}, {}, {}
        for v in config.served_versions():
            prefill, decode = pools[v.config.serving_group]
            flow = RequestFlow(v.config, prefill, decode, None if routers is None else routers[v.config.serving_group],
                               sampling_defaults=v.sampling.overrides(), replies=replies)
            flows[v.name, v.label] = flow
            capacities[flow.group] = Capacity(v.config.admission_bounds)
            metrics = None if telemetry is None else telemetry.metrics
            budget = None if ledger is None else Budget(v.config, ledger, metrics)
            gateways[flow.group] = Gateway(version_stages(
                flow, admission, capacities[flow.group], telemetry, audit, budget, classifier, guard_metrics))
        idempotent = None if idempotency_actor is None else Idempotent(idempotency_actor, admission)
        door = cls(config, ModelCatalog.build(config, flows), gateways, capacities, admission, telemetry, idempotent,
                   audit)
        door.replies = replies
        if audit is not None:  # a mirror runs a tenant's prompt on a candidate version: audited too
            door.catalog.shadow.audit = door.audit_mirror
        return door

    # ---- who, and what is served ----------------------------------------------------------------

    def authorize(self, authorization: str | None, model: str | None) -> str:
        """The caller's tenant, for both edges: refuses an unknown key (UNAUTHENTICATED) or model
        (NOT_FOUND), counting the refusal."""
        self.arrivals += 1
        tenant = "unknown"
        try:
            tenant = self.admission.authenticate(authorization)
            if model:
                self.catalog.lookup(model)
        except ServingError as e:
            if self.telemetry is not None:
                self.telemetry.refused(e, tenant)
            self.audit_refusal(e, tenant, model)
            raise
        return tenant

    def shedding(self, authorization: str | None, in_transit: int = 0) -> tuple[str, ServingError] | None:
        """(tenant, refusal) when every model version's capacity refuses all work now, behind the
        `in_transit` calls let through that have not reached this loop yet, and the caller's key is
        valid: the gRPC server asks as a call's first step, before its work starts (with two loops,
        on the transport's thread, before the call reaches this loop), so a burst is refused at the
        rate it arrives (api/grpc_server.py). It only reads. None: the call goes on
        to authorize and serve (an unknown key is refused there, as UNAUTHENTICATED). Off with an
        audit log: every refusal is a record the gateway writes."""
        if self.audit is not None:
            return None
        refusal = None
        for capacity in self.capacities.values():
            if (refusal := capacity.shedding(in_transit)) is None:
                return None
        if refusal is None:
            return None
        try:
            tenant = self.admission.authenticate(authorization)
        except ServingError:
            return None
        return tenant, Rejected(f"{refusal.message} (refused on arrival)", refusal.retry_after_s, refusal.reason)

    def refused(self, error: ServingError, tenant: str = "unknown") -> None:
        """A call refused at an edge before authorize (its key, by the gRPC interceptor or the HTTP
        middleware, before its message or body was read): counted as authorize counts one."""
        self.arrivals += 1
        if self.telemetry is not None:
            self.telemetry.refused(error, tenant)
        self.audit_refusal(error, tenant)

    def audit_refusal(self, error: BaseException, tenant: str, model: str | None = None,
                      label: str | None = None) -> None:
        """The audit record of a request refused before its version's gateway (its key, its model, a
        pin, a bad parameter: audit.refusal_record); the gateway records every later outcome."""
        opts = self.config.tenants.get(tenant)
        if self.audit is not None and (opts is None or opts.audit):
            self.audit.refused(refusal_record(tenant, model, label, error))

    def audit_mirror(self, candidate: RequestFlow, request: ClientRequest, rid: str, outcome: str) -> None:
        """A shadow mirror's audit record (versions/shadow.py calls it once the outcome is known)."""
        opts = self.config.tenants.get(request.tenant)
        if self.audit is not None and (opts is None or opts.audit):
            cfg = candidate.config
            self.audit.submit(shadow_record(rid, request.tenant, request.label, cfg.model_name, cfg.version or "",
                                            candidate.fingerprint, outcome))

    def count_refused(self, error: ServingError, tenant: str) -> None:
        """Count a refusal made before the front door (shedding); on this loop. It was offered to every
        version's capacity (shedding refuses only when all of them would)."""
        self.arrivals += 1
        for capacity in self.capacities.values():
            capacity.first_tokens.offered()
        if self.telemetry is not None:
            self.telemetry.refused(error, tenant)

    @property
    def capacity(self) -> Capacity:
        """The default version's (the first model's first): what /metrics reports."""
        return self.capacities[self.catalog.default.group]

    def model_info(self, tenant: str | None = None) -> list[dict]:
        """Every model and its versions; to a `tenant` (the listings: /v1/models, ListModels,
        /version) only the versions it can get, unless it may pin one (then every version,
        a canary at weight 0 included, as it may name them)."""
        return self.catalog.model_info(None if tenant is None or self.may_pin(tenant) else tenant)

    async def live(self, timeout_s: float) -> bool:
        """Every model version has a live decode replica (one bounded call each, at once), but those
        whose decode pool may sleep (min_replicas 0): asleep is not down, and a call would wake it."""
        awake = [f for f in self.catalog.flows if not may_sleep(f.config)]
        return all(await asyncio.gather(*(f.decode_live(timeout_s) for f in awake)))

    # ---- serving ----------------------------------------------------------------------------------

    async def serve(self, request: ClientRequest) -> Reply:
        """Every choice started and past its first delta. Bad input (InvalidRequestError) and
        refusals (ServingError) raise here, before any delta; later failures raise from a
        choice's stream. A refusal before the version's gateway is audited here."""
        try:
            if request.model and PIN in request.model:
                self._check_pin(request)
            routed = self.catalog.select(request.model, request.tenant, request.session)
            flow = routed.flow
            sampling = flow.sampling(request.sampling, request.tools)
            self.config.ingress_limits.check_choices(request.n)
            if request.label is not None:  # the client's label: echoed and traced, so capped like any input
                self._check_label(flow, request)
        except (InvalidRequestError, ServingError) as e:
            self.audit_refusal(e, request.tenant, request.model, request.label)
            raise
        if request.n > 1 and request.session is None:  # choices stay on choice 0's replicas while load allows
            request = replace(request, session=f"choices:{uuid.uuid4().hex}")
        choices = await self._start_choices(routed.for_choices(request.n), request, sampling.params)
        return Reply(choices, flow.config.model_name, flow.config.version or "", sampling.use, flow.tokenizer)

    def may_pin(self, tenant: str) -> bool:
        """Pinning a version is a tenant's permission (`pin_versions`; anyone's without auth)."""
        opts = self.config.tenants.get(tenant)
        return not self.admission.auth_enabled or (opts is not None and opts.pin_versions)

    def _check_pin(self, request: ClientRequest) -> None:
        if not self.may_pin(request.tenant):
            e = ServingError(Code.PERMISSION_DENIED, f"model: tenant {request.tenant!r} may not pin a version "
                                                     "(model@label; the tenant's pin_versions)")
            if self.telemetry is not None:
                self.telemetry.refused(e, request.tenant)
            raise e

    def _check_label(self, flow: RequestFlow, request: ClientRequest) -> None:
        try:
            flow.validator.check_request_id(request.label)
        except InvalidRequestError as e:
            if self.telemetry is not None:
                self.telemetry.start(request.tenant, None, flow.config.model_name, flow.config.version or "").end(e)
            raise

    def _run(self, routed: Routed, request: ClientRequest, sampling: SamplingParams) -> tuple[AsyncIterator[Delta],
                                                                                            Outcome]:
        """One choice through its version's gateway and flow, watched by the version's gate."""
        o = Outcome(self._ids.next(), request, sampling, routed.flow)
        stream = self.gateways[routed.flow.group].run(o)
        ctx = None if routed.shadow is None else self.admission.context(request.tenant, request.deadline)
        return routed.watch(stream, request, sampling, ctx, self._busy), o

    def _busy(self) -> bool:
        """Too loaded to mirror: half the in-flight cap is taken."""
        return 2 * self.admission.total_inflight > self.admission.max_inflight()

    async def _start_choices(self, routed: Routed, request: ClientRequest, sampling: SamplingParams) -> list[Choice]:
        """As vLLM does for n > 1, each choice is a request of its own (choice i samples with
        seed + i when a seed is given). Choice 0 runs first, and the others start once it has its
        second token: by then its prompt's full blocks are cached where it was prefilled and, after
        its KV pull, on its decode replica, so the others compute only the prompt's last partial
        block and pull only that (the full blocks are shared, not copied). Refusals and early
        failures raise here, and stop every choice started."""
        def start(i: int):
            return self._run(routed, request, sampling if i == 0 or sampling.seed is None
                             else replace(sampling, seed=sampling.seed + i))

        started = [start(0)]
        streams = [started[0][0]]
        try:
            firsts = [await anext(streams[0])]
            if request.n > 1:
                if firsts[0].finish_reason is None:  # its second delta: its decode leg holds the prompt
                    second = await anext(streams[0], None)
                    if second is not None:
                        streams[0] = prepend(second, streams[0])
                started += [start(i) for i in range(1, request.n)]
                streams += [s for s, _ in started[1:]]
                rest = await asyncio.gather(*(anext(s) for s in streams[1:]), return_exceptions=True)
                if failed := next((r for r in rest if isinstance(r, BaseException)), None):
                    raise failed
                firsts += rest
        except BaseException:
            await close_streams(streams)
            raise
        return [Choice(s, first, o) for s, first, (_, o) in zip(streams, firsts, started)]


def version_stages(flow: RequestFlow, admission: Admission, capacity: Capacity, telemetry: IngressTelemetry | None,
                   audit: AuditShipper | None, budget: Budget | None, classifier, guard_metrics) -> list[Stage]:
    """One version's gateway, in order (gateway/stages.py says what the order means). A policy
    no tenant of this version uses has no stage: the hot path skips it."""
    config = flow.config
    stages: list[Stage] = []
    if telemetry is not None:
        stages.append(TelemetryStage(telemetry, config.model_name, config.version or ""))
    if audit is not None:
        stages.append(AuditStage(audit, config, flow.fingerprint))
    stages += [AdmissionStage(admission, flow.route_timeout_s * 4), CapacityStage(capacity)]
    cache = ResponseCache.from_config(config, flow.salt.decode(), guard_metrics)
    if cache.tenants:  # outside the output guardrail: what it stores passed the checks
        stages.append(ResponseCacheStage(cache))
    guardrails = Guardrails(config, guard_metrics, classifier)
    if guardrails.by_tenant:
        stages.append(GuardStage(guardrails))
    stages.append(QuotaStage(admission))
    if budget is not None:
        stages.append(BudgetStage(budget))
    return stages


def may_sleep(config: AppConfig) -> bool:
    auto = config.decode.autoscaling
    return auto is not None and auto.min_replicas == 0


async def prepend(item: Delta, stream: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """`item`, then the rest of `stream` (closing this closes `stream`)."""
    async with aclosing(stream):
        yield item
        async for d in stream:
            yield d


async def close_streams(streams) -> None:
    for s in streams:
        try:
            await s.aclose()  # the gateway's and the flow's cleanup: cancels the request on both legs
        except Exception:  # noqa: BLE001 — a stream that already failed has nothing to close
            pass
