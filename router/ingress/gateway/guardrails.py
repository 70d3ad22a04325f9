"""Guardrails: per-tenant checks on the prompt (before any engine work) and on the output stream.

Output is released on a hold-back window (gateway/guard_text.py). The flow's deltas are held until
the text after them is at least `holdback_chars` long (or the stream ends), and each check scans
the text that is not yet released plus the `holdback_chars` before it. Both are measured on the
text rules match: normalised (invisible characters removed, NFKC, casefold) for word lists, and
with JSON escapes decoded when the client parses the output as JSON (tools, a JSON response
format), so `b\u200bomb` and `"\u0062omb"` read as `bomb`. Every output rule's match (and the lookahead it
reads) is at most `holdback_chars` long (cluster/guardrail_rules.py; refused at config load
otherwise), so a match touching unreleased text is found before any of it is released: flagged
text never reaches the client. A match at the very end of the text is not acted on until the
characters it may depend on have come (a word boundary: "kill" may become "killer"), or the
stream ends.

On a flag the flow's stream is closed: that is the flow's cancel path, which aborts the decode leg
and releases prefill's lease, so both pools free the request's blocks. The client gets the text
released so far, then a final delta with finish reason `content_filter`.

A remote check (the classifier) reads the stream once per `holdback_chars` of new text (and at
its end), not once per delta; nothing is released between its reads, so what is held grows to up
to twice the window with one.

Logprob alternatives (`top_logprobs`, `prompt_logprobs`' top) are read by the local output rules
(`Alternatives`): a flagged one is left out, the text goes on.

The checks, their verdicts and a tenant's compiled policy are in gateway/guard_checks.py.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING, AsyncIterator, Callable

from cluster.config import AppConfig
from cluster.engine.outputs import FinishReason
from router.ingress.gateway.guard_checks import (Action, Cause, CheckFailed, CompiledPolicy, GuardrailRejected,
                                                 Intervention, Stage, compile_policy)
from router.ingress.gateway.guard_text import FOLDED, PLAIN, HoldBack, MatchView, joins
from router.ingress.gateway.stages import Outcome, Stage as GatewayStage

if TYPE_CHECKING:
    from router.ingress.request import Delta


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


class Guardrails:
    """Each tenant's compiled policy (once, at the ingress's start) and its metrics."""

    def __init__(self, config: AppConfig, metrics=None, classifier=None):
        compiled = {name: compile_policy(name, p, classifier) for name, p in config.guardrail_policies.items()}
        self.by_tenant = {t: compiled[o.guardrail_policy] for t, o in config.tenants.items() if o.guardrail_policy}
        if config.guardrail_policy is not None:
            self.by_tenant.setdefault("default", compiled[config.guardrail_policy])
        self.metrics = metrics  # GuardrailMetrics (cluster/telemetry/metrics.py) or None

    def for_request(self, tenant: str, interventions: list | None = None, json_output: bool = False,
                    tokenizer=None) -> "RequestGuard | None":
        """`json_output`: the client parses the output as JSON (its escapes are decoded before
        matching); `tokenizer`: the version's, to read logprob alternatives (None: not checked)."""
        policy = self.by_tenant.get(tenant)
        return None if policy is None else RequestGuard(policy, tenant, self.metrics, interventions, json_output,
                                                        tokenizer)

    def window(self, tenant: str) -> int:
        policy = self.by_tenant.get(tenant)
        return 0 if policy is None else policy.window


class RequestGuard:
    """One request under its tenant's policy: the input check, then the output stream."""

    def __init__(self, policy: CompiledPolicy, tenant: str, metrics=None, interventions: list | None = None,
                 json_output: bool = False, tokenizer=None):
        self.policy = policy
        self.tenant = tenant
        self.metrics = metrics
        self.interventions: list[Intervention] = [] if interventions is None else interventions  # the Outcome's
        self._input: tuple[str, str] | None = None  # (prompt text, param) for the remote input checks
        self.json_output = json_output  # read as generated and JSON-decoded: the last view is the decoded one
        rules = tuple(c for c in policy.for_stage(Stage.OUTPUT) if not c.remote)
        self.alternatives = None if tokenizer is None or not rules else Alternatives(self, rules, tokenizer, policy.window)

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

    def views(self) -> tuple[MatchView, ...]:
        return (MatchView(), MatchView(decode_json=True)) if self.json_output else (MatchView(),)

    async def _flagged(self, hold: HoldBack, final: bool, remote: bool = True) -> bool:
        """`remote`: the remote checks (a classifier) read it too; else only the local ones."""
        last = len(hold.views) - 1
        for check in self.policy.for_stage(Stage.OUTPUT):
            if check.remote and not remote:
                continue
            try:
                for v in range(len(hold.views)) if check.every_view else (last,):
                    text, start = hold.views[v].window_text(check.reads, hold.scan_from(v, check.reads), check.context)
                    if await check.flags_output(text, start, final):
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
        hold = HoldBack(self.policy.window, self.views(), self.policy.context)
        # A remote check (the classifier) reads the stream once per window of new text, not per
        # delta: nothing is released between its calls, so every released character was read by
        # it with the window after it, as before; the local rules still read every delta.
        remote = any(c.remote for c in self.policy.for_stage(Stage.OUTPUT))
        read_to = 0  # the raw text's length at the last remote read
        async with aclosing(deltas):
            async for d in deltas:
                if self.alternatives is not None:
                    d = self.alternatives.redact(d, hold.views)
                final = d.finish_reason is not None
                hold.add(d, final)
                batch = not remote or final or hold.length - read_to >= self.policy.window
                if await self._flagged(hold, final, remote=batch):
                    await deltas.aclose()  # the flow's cancel path: both legs stop and free their blocks
                    yield replace(d, text="", token_ids=[], logprobs=None, finish_reason=FinishReason.CONTENT_FILTER)
                    return
                if not batch:
                    continue
                read_to = hold.length
                released = hold.release(final)
                if released:
                    yield _merge(released)


class Alternatives:
    """Logprob alternatives (each generated token's `top`, and the prompt's in `prompt_logprobs`)
    read by the policy's local output rules, as the text is: each alternative's token text alone
    and after the text before its token (the reply's, or the prompt's), in every view. A flagged
    one is left out of its token's `top` (the token and its logprob are the text's, checked by the
    window) and recorded once per check (`redacted`); a check that cannot decide follows
    `on_error`. The classifier does not read them: one call per alternative is not affordable,
    and a token is no text to classify."""

    def __init__(self, guard: "RequestGuard", rules: tuple, tokenizer, window: int):
        self.guard, self.rules, self.tok = guard, rules, tokenizer
        self.keep = window + max(r.context for r in rules)  # the text before a token that a match may read
        self.recorded: set[tuple[str, Action]] = set()
        self.alone: dict[tuple[int, bool], MatchView] = {}

    def redact(self, d: "Delta", views: tuple[MatchView, ...]) -> "Delta":
        """`views`: the stream's text before `d`."""
        logprobs, prompt = d.logprobs, d.prompt_logprobs
        if logprobs and any(lp.top for lp in logprobs):
            logprobs = self._read([lp.token_id for lp in logprobs], logprobs, [v.clone(self.keep) for v in views])
        if prompt and d.prompt_token_ids and any(lp is not None and lp.top for lp in prompt):
            prompt = self._read(d.prompt_token_ids, prompt, [MatchView(v.decode_json) for v in views])
        return d if (logprobs, prompt) == (d.logprobs, d.prompt_logprobs) else replace(
            d, logprobs=logprobs, prompt_logprobs=prompt)

    def _read(self, token_ids: list[int], lps: list, context: list[MatchView]) -> list:
        out = []
        for token_id, lp in zip(token_ids, lps):
            if lp is not None and lp.top:
                closed = [None if v.pending else v.clone(self.keep).feed("", True) for v in context]
                top = tuple((t, v) for t, v in lp.top if t == lp.token_id or not self._flagged(t, context, closed))
                lp = lp if len(top) == len(lp.top) else replace(lp, top=top)
            out.append(lp)
            context = [v.feed(self.tok.token_text(token_id), False).clone(self.keep) for v in context]
        return out

    def _flagged(self, token_id: int, context: list[MatchView], closed: list) -> bool:
        """`closed`: each context view with its open unit complete (None while an escape is open)."""
        alt = self.tok.token_text(token_id)
        if not alt:
            return False
        reads = []
        for v, c in zip(context, closed):
            alone = self._alone(token_id, alt, v.decode_json)
            if c is None or joins(alt[0]):  # it may change the text before it: read the two together
                c, alone_after = v.clone(self.keep).feed(alt, True), ("", "")
            else:
                alone_after = alone.text
            reads.append((alone, [c.text[w] + alone_after[w] for w in (PLAIN, FOLDED)], v.length(PLAIN) - c.base[PLAIN],
                          v.length(FOLDED) - c.base[FOLDED]))
        for check in self.rules:
            w = check.reads
            try:  # a match in the alternative alone, or one it ends after the text before it
                if any(check.touches(alone.text[w], 0) or check.touches(after[w], bounds[w])
                       for alone, after, *bounds in reads):
                    return self._once(check.name, Action.REDACTED, Cause.FLAGGED)
            except CheckFailed as e:  # closed: as flagged; open: kept, recorded
                closed_policy = self.guard.policy.on_error == "closed"
                if self._once(check.name, Action.REDACTED if closed_policy else Action.PASSED_ON_ERROR, e.cause):
                    return True
        return False

    def _alone(self, token_id: int, alt: str, decode_json: bool) -> MatchView:
        """An alternative's text read alone (kept per token: the same ones come again and again)."""
        key = (token_id, decode_json)
        if (view := self.alone.get(key)) is None:
            view = self.alone[key] = MatchView(decode_json).feed(alt, True)
        return view

    def _once(self, check: str, action: Action, cause: Cause) -> bool:
        """Records the event the first time (per check and action); True: `action` redacts."""
        if (check, action) not in self.recorded:
            self.recorded.add((check, action))
            self.guard._record(check, Stage.OUTPUT, action, cause)
        return action is Action.REDACTED


def json_output(request) -> bool:
    """The client parses the output as JSON: tools it may call, or a JSON response format."""
    tools, fmt = request.tools, request.sampling.response_format
    return bool(tools and tools.functions and tools.choice != "none") or (fmt is not None and fmt.type != "text")


class GuardStage(GatewayStage):
    """The tenant's policy on the prompt (local rules in the tokenizing thread, then the remote
    classifier) and on the output (a hold-back window inside the response cache, so what is
    stored passed the checks)."""

    def __init__(self, guardrails: Guardrails):
        self.guardrails = guardrails

    async def admit(self, o: Outcome) -> None:
        tokenizer = None if o.flow is None else o.flow.tokenizer
        o.guard = self.guardrails.for_request(o.tenant, o.interventions, json_output(o.request), tokenizer)

    def inspect(self, o: Outcome, text: Callable[[], str]) -> None:
        if o.guard is not None:
            o.guard.check_input(text(), o.request.param)

    async def charge(self, o: Outcome) -> None:
        if o.guard is not None:
            await o.guard.check_input_remote()  # a classifier: on the loop, bounded by its timeout

    def wrap(self, o: Outcome, deltas: AsyncIterator["Delta"]) -> AsyncIterator["Delta"]:
        return deltas if o.guard is None else o.guard.output(deltas)
