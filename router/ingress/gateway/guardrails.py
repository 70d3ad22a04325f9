"""Guardrails: per-tenant checks on the prompt (before any engine work) and on the output stream.

Output is released on a hold-back window. The flow's deltas are held until the text after them is
at least `holdback_chars` long (or the stream ends), and each check scans the text that is not yet
released plus the `holdback_chars` before it. Every output rule's match (and the lookahead it
reads) is at most `holdback_chars` long (cluster/guardrail_rules.py; refused at config load
otherwise), so a match touching unreleased text is found before any of it is released: flagged
text never reaches the client. A match at the very end of the text is not acted on until the
characters it may depend on have come (a word boundary: "kill" may become "killer"), or the
stream ends.

On a flag the flow's stream is closed: that is the flow's cancel path, which aborts the decode leg
and releases prefill's lease, so both pools free the request's blocks. The client gets the text
released so far, then a final delta with finish reason `content_filter`.

Checks are pluggable (`Check`): the built-in `RuleCheck` (a word list or regex, run with the
`regex` module's timeout); a classifier served as its own deployment would be another `Check`
whose failures and timeouts follow the policy's `on_error` (closed: as flagged; open: passed and
recorded). Every intervention is an `Intervention`, counted in metrics and kept in the request's
`Outcome` (gateway/stages.py), which the audit log reads; a refused prompt's error carries them too
(`GuardrailRejected.interventions`).
"""

from __future__ import annotations

import asyncio
import enum
import time
import unicodedata
from collections import deque
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol

from cluster.config import AppConfig, ClassifierCheckOptions, GuardrailPolicy, GuardrailRule
from cluster.engine.outputs import FinishReason
from cluster.guardrail_rules import compile_rule
from router.ingress.gateway.stages import Outcome, Stage as GatewayStage
from router.ingress.status import Code, ServingError

if TYPE_CHECKING:
    from router.ingress.request import Delta


class Stage(str, enum.Enum):
    INPUT = "input"
    OUTPUT = "output"


class Action(str, enum.Enum):
    REFUSED = "refused"  # the prompt: 400 / INVALID_ARGUMENT, no engine work
    STOPPED = "stopped"  # the output: generation stopped, finish reason content_filter
    PASSED_ON_ERROR = "passed_on_error"  # a check failed or timed out and the policy fails open


class Cause(str, enum.Enum):
    FLAGGED = "flagged"
    TIMEOUT = "timeout"  # the check ran past its bound (on_error decides)
    ERROR = "error"  # the check failed (a classifier down; on_error decides)


@dataclass(frozen=True)
class Intervention:
    """One guardrail event of a request: for the metrics and the audit record (never any text)."""

    policy: str
    check: str
    stage: Stage
    action: Action
    cause: Cause


class CheckFailed(Exception):
    def __init__(self, cause: Cause, detail: str = ""):
        super().__init__(detail or cause.value)
        self.cause = cause


class Check(Protocol):
    """A guardrail check. `flags_input` gets the whole prompt text: in a worker thread for a local
    check, awaited on the event loop for a `remote` one (a coroutine function then, so a slow
    classifier never holds a tokenize thread); `flags_output` on the event loop, on `text[start:]`
    (with `text[:start]` as context for boundaries and lookbehind), `final` when no more text will
    come. True = flagged; raise CheckFailed when the check could not decide (timeout, a classifier down)."""

    name: str
    stages: frozenset[Stage]
    remote: bool

    def flags_input(self, text: str) -> bool: ...

    async def flags_output(self, text: str, start: int, final: bool) -> bool: ...


def fold(text: str) -> str:
    """What a word rule sees: each character NFKC-normalised and casefolded on its own (a
    full-width or compatibility form, or any case, of a listed word matches it). Never what is
    delivered. Per character, so every character folds to one or more (never none): a match of n
    folded characters covers at most n generated ones, and the hold-back window, counted in
    generated characters, still holds every match that touches unreleased text."""
    if text.isascii():
        return text.lower()  # NFKC leaves ASCII as is; casefold is lower
    return "".join(unicodedata.normalize("NFKC", c).casefold() for c in text)


class RuleCheck:
    """A word list or regular expression, compiled once; each search bounded by `timeout_s`.
    A word list matches the folded text (`fold`); a pattern the text as generated."""

    def __init__(self, rule: GuardrailRule, timeout_s: float, input_timeout_s: float):
        self.name = rule.name
        self.stages = STAGES[rule.applies_to]
        self.remote = False
        self.folds = bool(rule.words)
        compiled = compile_rule(rule.words, rule.pattern)
        self.pattern = compiled.pattern
        self.lookahead = compiled.lookahead
        self.timeout_s = timeout_s
        self.input_timeout_s = input_timeout_s

    def _search(self, text: str, pos: int, deadline: float):
        try:
            return self.pattern.search(text, pos, timeout=max(deadline - time.monotonic(), 1e-6))
        except TimeoutError as e:
            raise CheckFailed(Cause.TIMEOUT, f"rule {self.name} timed out") from e

    def flags_input(self, text: str) -> bool:
        return self._search(fold(text) if self.folds else text, 0,
                            time.monotonic() + self.input_timeout_s) is not None

    async def flags_output(self, text: str, start: int, final: bool) -> bool:
        if self.folds:  # text[start:] folded, and the character before it: a word rule's lookbehind
            context = max(0, start - 1)
            before = fold(text[context:start])
            return self.scan(before + fold(text[start:]), len(before), final)
        return self.scan(text, start, final)

    def scan(self, text: str, start: int, final: bool) -> bool:
        """A settled match in text[start:]: one with `lookahead` characters after it (or the end)."""
        deadline = time.monotonic() + self.timeout_s
        pos = start
        while (m := self._search(text, pos, deadline)) is not None:
            if final or m.end() + self.lookahead <= len(text):
                return True
            pos = m.start() + 1  # not settled yet: the text is held; look for a settled one after it
        return False


STAGES = {"input": frozenset({Stage.INPUT}), "output": frozenset({Stage.OUTPUT}),
          "both": frozenset({Stage.INPUT, Stage.OUTPUT})}


class ClassifierCheck:
    """The classifier deployment (cluster/serving/classifier.py), called through its Serve handle:
    flagged when its score is >= threshold; a failed call or one past `timeout_s` is CheckFailed.
    On output it sees the text from `start` (the window's context and what is held)."""

    def __init__(self, options: ClassifierCheckOptions, handle):
        self.name = options.name
        self.stages = STAGES[options.applies_to]
        self.remote = True
        self.threshold = options.threshold
        self.timeout_s = options.timeout_s
        self.handle = handle

    async def flags_input(self, text: str) -> bool:
        return await self._classify(text)

    async def flags_output(self, text: str, start: int, final: bool) -> bool:
        return await self._classify(text[start:])

    async def _classify(self, text: str) -> bool:
        try:
            score = await asyncio.wait_for(self.handle.classify.remote(text), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as e:
            raise CheckFailed(Cause.TIMEOUT, f"classifier {self.name} timed out") from e
        except Exception as e:  # noqa: BLE001 — down, dying, refusing: the policy decides
            raise CheckFailed(Cause.ERROR, f"classifier {self.name} failed: {e}") from e
        return score >= self.threshold


class HoldBack:
    """The hold-back window over one stream's deltas (anything with `.text`): a delta is released
    once `window` characters of text follow its end, or when the stream ends. Plain and
    synchronous; the checks decide whether to release, this decides what."""

    def __init__(self, window: int):
        self.window = window
        self.text = ""
        self.released = 0  # characters released to the client
        self._pending: deque[tuple[int, object]] = deque()  # (end offset of its text, delta)

    def add(self, delta) -> None:
        self.text += delta.text
        self._pending.append((len(self.text), delta))

    @property
    def scan_from(self) -> int:
        """Where a check must start: a match touching unreleased text starts at most `window` before it."""
        return max(0, self.released - self.window)

    def release(self, final: bool) -> list:
        bound = len(self.text) if final else len(self.text) - self.window
        out = []
        while self._pending and self._pending[0][0] <= bound:
            self.released, d = self._pending.popleft()
            out.append(d)
        return out

    @property
    def held(self) -> int:
        return len(self.text) - self.released


def _merge(deltas: list["Delta"]) -> "Delta":
    """Deltas released together as one (as the flow merges what queued up): one message per
    release, so the client's token intervals stay the engine's, and the window's text at the
    end goes out in one piece."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None if all(d.logprobs is None for d in deltas) else [lp for d in deltas for lp in d.logprobs or ()]
    echo = next((d for d in deltas if d.prompt_logprobs is not None), last)  # the first delta's prompt logprobs
    return replace(last, text="".join(d.text for d in deltas), token_ids=[t for d in deltas for t in d.token_ids],
                   logprobs=logprobs, prompt_logprobs=echo.prompt_logprobs, prompt_token_ids=echo.prompt_token_ids)


class GuardrailRejected(ServingError):
    """A prompt flagged by the tenant's policy: 400 / INVALID_ARGUMENT, OpenAI error code
    `content_filter` (as OpenAI answers a prompt its content filter refuses), naming the policy and check."""

    reason = "guardrail"  # the refusal metric's reason
    openai_code = "content_filter"

    def __init__(self, intervention: Intervention, param: str, interventions: tuple[Intervention, ...]):
        why = "" if intervention.cause is Cause.FLAGGED else f" (the check {intervention.cause.value}; policy fails closed)"
        super().__init__(Code.INVALID_ARGUMENT, f"{param}: refused by guardrail policy {intervention.policy!r}, "
                                                f"check {intervention.check!r}{why}")
        self.param = param
        self.interventions = interventions


@dataclass(frozen=True)
class CompiledPolicy:
    name: str
    checks: tuple  # Check, in the config's order
    window: int
    on_error: str

    def for_stage(self, stage: Stage) -> tuple:
        return tuple(c for c in self.checks if stage in c.stages)


def compile_policy(name: str, policy: GuardrailPolicy, input_timeout_s: float, classifier=None) -> CompiledPolicy:
    """Rules first (cheap), then the classifier; `classifier` is its deployment's handle."""
    checks: tuple = tuple(RuleCheck(r, policy.rule_timeout_s, input_timeout_s) for r in policy.rules)
    if policy.classifier is not None:
        if classifier is None:
            raise ValueError(f"guardrail policy {name!r} names a classifier, and no classifier deployment is given")
        checks += (ClassifierCheck(policy.classifier, classifier),)
    return CompiledPolicy(name, checks, policy.holdback_chars, policy.on_error)


class Guardrails:
    """Each tenant's compiled policy (once, at the ingress's start) and its metrics."""

    INPUT_TIMEOUT_FACTOR = 20  # a prompt is up to the prompt cap long; its bound is this x the rule's

    def __init__(self, config: AppConfig, metrics=None, classifier=None):
        compiled = {name: compile_policy(name, p, p.rule_timeout_s * self.INPUT_TIMEOUT_FACTOR, classifier)
                    for name, p in config.guardrail_policies.items()}
        self.by_tenant = {t: compiled[o.guardrail_policy] for t, o in config.tenants.items() if o.guardrail_policy}
        if config.guardrail_policy is not None:
            self.by_tenant.setdefault("default", compiled[config.guardrail_policy])
        self.metrics = metrics  # GuardrailMetrics (cluster/telemetry/metrics.py) or None

    def for_request(self, tenant: str, interventions: list | None = None) -> "RequestGuard | None":
        policy = self.by_tenant.get(tenant)
        return None if policy is None else RequestGuard(policy, tenant, self.metrics, interventions)

    def window(self, tenant: str) -> int:
        policy = self.by_tenant.get(tenant)
        return 0 if policy is None else policy.window


class RequestGuard:
    """One request under its tenant's policy: the input check, then the output stream."""

    def __init__(self, policy: CompiledPolicy, tenant: str, metrics=None, interventions: list | None = None):
        self.policy = policy
        self.tenant = tenant
        self.metrics = metrics
        self.interventions: list[Intervention] = [] if interventions is None else interventions  # the Outcome's
        self._input: tuple[str, str] | None = None  # (prompt text, param) for the remote input checks

    def _record(self, check: str, stage: Stage, action: Action, cause: Cause) -> Intervention:
        iv = Intervention(self.policy.name, check, stage, action, cause)
        self.interventions.append(iv)
        if self.metrics is not None:
            self.metrics.interventions.inc(1, {"tenant": self.tenant, "policy": iv.policy, "check": iv.check,
                                               "stage": stage.value, "action": action.value, "cause": cause.value})
        return iv

    def _failed(self, check: str, stage: Stage, e: CheckFailed, flag_action: Action) -> bool:
        """A check that could not decide: flagged when the policy fails closed."""
        if self.policy.on_error == "closed":
            self._record(check, stage, flag_action, e.cause)
            return True
        self._record(check, stage, Action.PASSED_ON_ERROR, e.cause)
        return False

    def check_input(self, text: str, param: str) -> None:
        """The local checks (a worker thread: never the loop); the text is kept for the remote
        ones (`check_input_remote`). Raises GuardrailRejected naming the policy and check."""
        self._input = (text, param)
        for check in self.policy.for_stage(Stage.INPUT):
            if not check.remote:
                try:
                    flagged = check.flags_input(text)
                except CheckFailed as e:
                    flagged = e
                self._input_verdict(check.name, flagged, param)

    async def check_input_remote(self) -> None:
        """The remote checks (a classifier) on the prompt given to check_input, on the loop."""
        if self._input is None:
            return
        text, param = self._input
        for check in self.policy.for_stage(Stage.INPUT):
            if check.remote:
                try:
                    flagged = await check.flags_input(text)
                except CheckFailed as e:
                    flagged = e
                self._input_verdict(check.name, flagged, param)

    def _input_verdict(self, check: str, flagged: "bool | CheckFailed", param: str) -> None:
        if isinstance(flagged, CheckFailed):
            flagged = self._failed(check, Stage.INPUT, flagged, Action.REFUSED)
        elif flagged:
            self._record(check, Stage.INPUT, Action.REFUSED, Cause.FLAGGED)
        if flagged:
            raise GuardrailRejected(self.interventions[-1], param, tuple(self.interventions))

    async def _flagged(self, hold: HoldBack, final: bool) -> bool:
        for check in self.policy.for_stage(Stage.OUTPUT):
            try:
                if await check.flags_output(hold.text, hold.scan_from, final):
                    self._record(check.name, Stage.OUTPUT, Action.STOPPED, Cause.FLAGGED)
                    return True
            except CheckFailed as e:
                if self._failed(check.name, Stage.OUTPUT, e, Action.STOPPED):
                    return True
        return False

    async def output(self, deltas: AsyncIterator["Delta"]) -> AsyncIterator["Delta"]:
        """The flow's deltas, released through the hold-back window. On a flag the flow's stream
        is closed (both legs stop, blocks freed) and a last delta ends it with content_filter."""
        if not self.policy.for_stage(Stage.OUTPUT):
            async with aclosing(deltas):
                async for d in deltas:
                    yield d
            return
        hold = HoldBack(self.policy.window)
        async with aclosing(deltas):
            async for d in deltas:
                hold.add(d)
                final = d.finish_reason is not None
                if await self._flagged(hold, final):
                    await deltas.aclose()  # the flow's cancel path: both legs stop and free their blocks
                    yield replace(d, text="", token_ids=[], logprobs=None, finish_reason=FinishReason.CONTENT_FILTER)
                    return
                released = hold.release(final)
                if released:
                    yield _merge(released)


class GuardStage(GatewayStage):
    """The tenant's policy on the prompt (local rules in the tokenizing thread, then the remote
    classifier) and on the output (a hold-back window inside the response cache, so what is
    stored passed the checks)."""

    def __init__(self, guardrails: Guardrails):
        self.guardrails = guardrails

    async def admit(self, o: Outcome) -> None:
        o.guard = self.guardrails.for_request(o.tenant, o.interventions)

    def inspect(self, o: Outcome, text: Callable[[], str]) -> None:
        if o.guard is not None:
            o.guard.check_input(text(), o.request.param)

    async def charge(self, o: Outcome) -> None:
        if o.guard is not None:
            await o.guard.check_input_remote()  # a classifier: on the loop, bounded by its timeout

    def wrap(self, o: Outcome, deltas: AsyncIterator["Delta"]) -> AsyncIterator["Delta"]:
        return deltas if o.guard is None else o.guard.output(deltas)
