"""Guardrail checks and a tenant's compiled policy (run by gateway/guardrails.py).

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
from dataclasses import dataclass
from typing import Protocol

from cluster.config import ClassifierCheckOptions, GuardrailPolicy, GuardrailRule
from cluster.guardrail_rules import compile_rule, fold
from router.ingress.gateway.guard_text import FOLDED, PLAIN
from router.ingress.status import Code, ServingError


class Stage(str, enum.Enum):
    INPUT = "input"
    OUTPUT = "output"


class Action(str, enum.Enum):
    REFUSED = "refused"  # the prompt: 400 / INVALID_ARGUMENT, no engine work
    STOPPED = "stopped"  # the output: generation stopped, finish reason content_filter
    PASSED_ON_ERROR = "passed_on_error"  # a check failed or timed out and the policy fails open
    REDACTED = "redacted"  # logprob alternatives left out of a reply (the text goes on)


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
    (with `text[:start]` as context for boundaries and lookbehind, at least `context` characters),
    `final` when no more text will come. `text` is a view's (guard_text.py): `reads` says which
    (PLAIN or FOLDED); `every_view`: each view, else the last (the JSON-decoded one when there is
    one). True = flagged; raise CheckFailed when the check could not decide (timeout, a classifier down)."""

    name: str
    stages: frozenset[Stage]
    remote: bool
    reads: int
    context: int
    every_view: bool

    def flags_input(self, text: str) -> bool: ...

    async def flags_output(self, text: str, start: int, final: bool) -> bool: ...


INPUT_CHUNK_CHARS = 4096  # a prompt is scanned in chunks this long, each within the rule's timeout


class RuleCheck:
    """A word list or regular expression, compiled once. A word list matches the folded text
    (`fold`), a pattern the plain one (guard_text.py: JSON-decoded when the output is JSON).

    Every search is bounded by `timeout_s`. On output it scans the window (the last
    `holdback_chars` and what is held). A prompt is scanned in chunks of `INPUT_CHUNK_CHARS`, each
    search with its own `timeout_s` (a chunk overlaps the next by the rule's span, so a match
    across their seam is found whole): the bound grows with the prompt, and a search costs the
    same per character wherever it is, so padding a prompt neither times the check out nor
    hides a match. A rule with no bounded span (input-only) is one search bounded by
    `timeout_s` per chunk of the prompt's length."""

    def __init__(self, rule: GuardrailRule, timeout_s: float):
        self.name = rule.name
        self.stages = STAGES[rule.applies_to]
        self.remote = False
        self.every_view = True
        self.reads = FOLDED if rule.words else PLAIN
        compiled = compile_rule(rule.words, rule.pattern)
        self.pattern = compiled.pattern
        self.span = compiled.span
        self.lookahead = compiled.lookahead
        self.context = compiled.lookbehind
        self.timeout_s = timeout_s

    def _search(self, text: str, pos: int, endpos: int, deadline: float):
        try:
            return self.pattern.search(text, pos, endpos, timeout=max(deadline - time.monotonic(), 1e-6))
        except TimeoutError as e:
            raise CheckFailed(Cause.TIMEOUT, f"rule {self.name} timed out") from e

    def flags_input(self, text: str) -> bool:
        text = fold(text) if self.reads == FOLDED else text
        chunks = range(0, max(len(text), 1), INPUT_CHUNK_CHARS)
        if self.span is None:
            return self._search(text, 0, len(text), time.monotonic() + self.timeout_s * len(chunks)) is not None
        for start in chunks:  # a match starting in the chunk ends, lookahead included, before endpos
            m = self._search(text, start, min(len(text), start + INPUT_CHUNK_CHARS + self.span),
                             time.monotonic() + self.timeout_s)
            if m is not None and m.start() < start + INPUT_CHUNK_CHARS:
                return True
        return False

    async def flags_output(self, text: str, start: int, final: bool) -> bool:
        return self.scan(text, start, final)

    def scan(self, text: str, start: int, final: bool) -> bool:
        """A settled match in text[start:]: one with `lookahead` characters after it (or the end)."""
        deadline = time.monotonic() + self.timeout_s
        pos = start
        while (m := self._search(text, pos, len(text), deadline)) is not None:
            if final or m.end() + self.lookahead <= len(text):
                return True
            pos = m.start() + 1  # not settled yet: the text is held; look for a settled one after it
        return False

    def touches(self, text: str, boundary: int) -> bool:
        """A match in `text` (complete: nothing follows) that ends past `boundary`."""
        deadline = time.monotonic() + self.timeout_s
        pos = max(0, boundary - (self.span or len(text)))
        while (m := self._search(text, pos, len(text), deadline)) is not None:
            if m.end() > boundary:
                return True
            pos = m.start() + 1
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
        self.every_view = False  # the last view: the text as the client reads it
        self.reads, self.context = PLAIN, 0
        self.threshold = options.threshold
        self.timeout_s = options.timeout_s
        self.chunk, self.overlap = options.input_chunk_chars, options.input_overlap_chars
        self.concurrency = asyncio.Semaphore(options.input_concurrency)
        self.handle = handle

    async def flags_input(self, text: str) -> bool:
        """The prompt in overlapping chunks of `input_chunk_chars`, `input_concurrency` calls at a
        time, each bounded by `timeout_s`: the bound grows with the prompt. Flagged when any
        chunk is; otherwise a chunk that could not be classified fails the check."""
        step = self.chunk - self.overlap
        chunks = [text[i:i + self.chunk] for i in range(0, max(len(text) - self.overlap, 1), step)]

        async def one(chunk: str) -> "bool | CheckFailed":
            async with self.concurrency:
                try:
                    return await self._classify(chunk)
                except CheckFailed as e:
                    return e
        verdicts = await asyncio.gather(*(one(c) for c in chunks))
        if True in verdicts:
            return True
        failed = next((v for v in verdicts if isinstance(v, CheckFailed)), None)
        if failed is not None:
            raise failed
        return False

    async def flags_output(self, text: str, start: int, final: bool) -> bool:
        return await self._classify(text[start:])

    async def _classify(self, text: str) -> bool:
        """One call, within timeout_s. A call given up on (timed out, or its request cancelled) is
        cancelled on the classifier too: Serve does not when its awaiting task is cancelled, and
        abandoned calls would hold the replica's slots (max_ongoing_requests) until they end."""
        response = self.handle.classify.remote(text)
        try:
            score = await asyncio.wait_for(response, self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as e:
            response.cancel()
            raise CheckFailed(Cause.TIMEOUT, f"classifier {self.name} timed out") from e
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as e:  # noqa: BLE001 — down, dying, refusing: the policy decides
            raise CheckFailed(Cause.ERROR, f"classifier {self.name} failed: {e}") from e
        return score >= self.threshold


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

    @property
    def context(self) -> int:
        """Characters before a scan's start that an output check reads (the widest lookbehind)."""
        return max((c.context for c in self.for_stage(Stage.OUTPUT)), default=1)


def compile_policy(name: str, policy: GuardrailPolicy, classifier=None) -> CompiledPolicy:
    """Rules first (cheap), then the classifier; `classifier` is its deployment's handle."""
    checks: tuple = tuple(RuleCheck(r, policy.rule_timeout_s) for r in policy.rules)
    if policy.classifier is not None:
        if classifier is None:
            raise ValueError(f"guardrail policy {name!r} names a classifier, and no classifier deployment is given")
        checks += (ClassifierCheck(policy.classifier, classifier),)
    return CompiledPolicy(name, checks, policy.holdback_chars, policy.on_error)
