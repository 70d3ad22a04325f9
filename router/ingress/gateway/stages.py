"""The gateway: policy applied around a version's flow as an ordered list of stages.

A stage is a small object with one job (in-flight slots, capacity, quotas, guardrails, the
response cache, budgets, telemetry, audit), unaware of the others and of the flow's internals.
It implements the phases it needs; the list's order is the order of every phase:

    admit    before the prompt is tokenized: cheap refusals, so a request that may not run costs
             no tokenizing (in-flight slot, capacity, request rate)
    inspect  in the tokenizing worker thread, with the prompt's text (local guardrail rules)
    charge   once the prompt's length is known (remote checks, token quota, budget)
    wrap     around the flow's deltas (the response cache, the output guardrail): the first
             stage's wrapper is the outermost
    delta    each delta the client gets, before it is sent (telemetry, audit, the streams' pace)
    started, routed, first_token   what the flow reports as it runs (it may refuse at `routed`);
             a flow a wrapper never runs (a response-cache hit) reports nothing
    finish   always, in reverse order, for every stage whose admit ran (the error or None)

What a stage decides travels in the request's `Outcome`, which every stage sees; `Delta`
carries tokens and text only."""

from __future__ import annotations

import functools
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

from router.ingress.flow.request_flow import Observer, RequestFlow
from router.ingress.request import ClientRequest, Delta

if TYPE_CHECKING:
    from cluster.engine.request import Request, RequestContext
    from cluster.engine.sampling_params import SamplingParams


@dataclass
class Outcome:
    """One request (one choice) on its way through the gateway: what it is, and what the stages
    decided about it."""

    rid: str  # the engines' id (ours); the client's request_id only labels replies
    request: ClientRequest
    sampling: "SamplingParams"
    flow: RequestFlow
    ctx: "RequestContext | None" = None  # the admission's: what both engines schedule it by
    prepared: "Request | None" = None  # validated and tokenized
    interventions: list = field(default_factory=list)  # guardrail events (gateway/guardrails.py)
    cache_hit: bool = False  # replayed from the response cache: no engine saw it
    price: Callable[[int, int], float] | None = None  # USD for (prompt, completion) tokens, when priced
    cost_usd: float | None = None  # settled at the end, when budgets are on
    last: Delta | None = None  # the latest delta sent
    # each stage's own handle on the request (set by that stage only)
    observation: object = None  # telemetry's RequestObservation
    trail: object = None  # audit's AuditTrail
    ticket: object = None  # admission's Ticket: the in-flight slot, the output tokens charged
    place: object = None  # capacity's Pending: its place in the first-token queue
    streaming: object = None  # capacity's Stream while counted among the streams past their first token (pace.py)
    guard: object = None  # guardrails' RequestGuard (None: the tenant has no policy)
    hold: object = None  # budget's Hold: its reservation in the ledger

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def label(self) -> str:
        return self.request.label or self.rid

    @property
    def completion_tokens(self) -> int:
        return 0 if self.last is None else self.last.completion_tokens


class Stage:
    """A gateway stage: every phase is a no-op unless the stage overrides it."""

    async def admit(self, o: Outcome) -> None:
        pass

    def inspect(self, o: Outcome, text: Callable[[], str]) -> None:
        """`text()`: the prompt's text (decoded on the first call)."""

    async def charge(self, o: Outcome) -> None:
        pass

    def wrap(self, o: Outcome, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        return deltas

    def delta(self, o: Outcome, d: Delta) -> None:
        pass

    def started(self, o: Outcome) -> None:
        pass

    def routed(self, o: Outcome, decision, started: float, num_prompt_tokens: int, ctx: "RequestContext") -> None:
        pass

    def first_token(self, o: Outcome, computed_tokens: int) -> None:
        pass

    def finish(self, o: Outcome, error: BaseException | None) -> None:
        pass


def _overrides(stages: list[Stage], phase: str) -> tuple[Stage, ...]:
    return tuple(s for s in stages if getattr(type(s), phase) is not getattr(Stage, phase))


class _Reporter(Observer):
    """The flow's reports, handed to the stages that take them."""

    def __init__(self, gateway: "Gateway", o: Outcome):
        self.gateway, self.o = gateway, o

    def started(self) -> None:
        for s in self.gateway.phases["started"]:
            s.started(self.o)

    def routed(self, decision, started: float, num_prompt_tokens: int, ctx) -> None:
        for s in self.gateway.phases["routed"]:
            s.routed(self.o, decision, started, num_prompt_tokens, ctx)

    def first_token(self, computed_tokens: int) -> None:
        for s in self.gateway.phases["first_token"]:
            s.first_token(self.o, computed_tokens)


class Gateway:
    """One version's stages, in order (gateway/front_door.py builds them)."""

    PHASES = ("admit", "inspect", "charge", "wrap", "delta", "started", "routed", "first_token")

    def __init__(self, stages: list[Stage]):
        self.stages = list(stages)
        self.phases = {p: _overrides(self.stages, p) for p in self.PHASES}  # skip the no-ops on the hot path

    async def run(self, o: Outcome) -> AsyncIterator[Delta]:
        """The request through every stage and its flow. Refusals raise before the first delta."""
        entered: list[Stage] = []
        error: BaseException | None = None
        try:
            for s in self.stages:
                entered.append(s)
                await s.admit(o)
            inspect = self._inspector(o)
            o.prepared = await o.flow.prepare(o.rid, o.request, o.sampling, inspect)
            for s in self.phases["charge"]:
                await s.charge(o)
            async with aclosing(self._stream(o)) as deltas:
                async for d in deltas:
                    o.last = d
                    for s in self.phases["delta"]:
                        s.delta(o, d)
                    yield d
        except BaseException as e:
            error = e
            raise
        finally:
            for s in reversed(entered):
                s.finish(o, error)

    def _inspector(self, o: Outcome) -> Callable[[Callable[[], str]], None] | None:
        stages = self.phases["inspect"]
        if not stages:
            return None

        def inspect(text: Callable[[], str]) -> None:
            once = functools.cache(text)
            for s in stages:
                s.inspect(o, once)
        return inspect

    def _stream(self, o: Outcome) -> AsyncIterator[Delta]:
        routing_key = None if o.request.session is None else f"{o.tenant}\n{o.request.session}"  # tenants never share one
        deltas = o.flow.run(o.rid, o.label, o.prepared.prompt_token_ids, o.sampling, o.ctx, routing_key,
                            _Reporter(self, o))
        for s in reversed(self.phases["wrap"]):
            deltas = s.wrap(o, deltas)
        return deltas
