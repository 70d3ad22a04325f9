"""One request's path through the pools, independent of the API that carried it in.

    prefill replica: prompt -> first token + KVHandle      (sent to the client at once)
    decode replica:  KVHandle -> pull missing blocks -> the rest of the tokens, streamed

With no prefill replica (or a failed prefill) the decode replica prefills locally. Text is
detokenized here, over the whole stream, so the first token's text and the rest join up.

Request identity: every request gets its own id here (a uuid), which engines, leases, KV
notifications, migrations and releases use; the client's `request_id` is only a label, echoed
in the responses. Two clients with the same request_id never meet inside a replica.

Before any of it, admission (router/ingress/admission.py) decides whether the tenant's request runs,
and gives it the RequestContext both engines schedule it by (priority, fair share, KV budget,
cache salt, deadline). Engines end a request at its deadline themselves ("deadline"), and
refuse work when their queues are full or a request waited past its time-to-live ("rejected").
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import asdict, dataclass, replace
from typing import AsyncIterator, Sequence

from cluster.config import AppConfig
from cluster.engine.chat_template import render_chat
from cluster.engine.kv_cache import extend_salt, hash_request_blocks
from cluster.engine.model.identity import model_identity
from cluster.engine.model_config import ModelConfig
from cluster.engine.outputs import FinishReason, RequestOutput, TokenLogprob, merge_outputs
from cluster.engine.request import RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from cluster.engine.validation import RequestValidator
from cluster.errors import ErrorKind, InvalidRequestError, QueueFullError
from router.ingress.admission import DEFAULT_TENANT, Admission, Quotas
from router.ingress.audit import AuditShipper, AuditTrail
from router.ingress.budget import Budget
from router.ingress.capacity import Capacity, Pending
from router.ingress.guardrails import Guardrails, Intervention, RequestGuard
from router.ingress.relay import coalesce
from router.ingress.response_cache import ResponseCache
from router.ingress.status import Code, Rejected, ServingError

log = logging.getLogger(__name__)

OVERLOAD_RETRY_S = 1.0  # retry-after for an engine's refusal (full queue, queue time-to-live)
TOKENIZE_THREADS = 2  # chat rendering and tokenizing run here, never on the event loop


@dataclass
class Delta:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    # The first delta's, when the request asked for them: one per prompt token (None for the
    # first), and the prompt's token ids they score
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None
    # The final delta's record of the request's guardrail events (router/ingress/guardrails.py): the audit reads it
    guardrail_interventions: tuple[Intervention, ...] = ()
    response_cache_hit: bool = False  # replayed from the response cache: no engine saw the request


class _Stream:
    """One request's text as the client sees it: one detokenizer over every leg's tokens."""

    def __init__(self, rid: str, detok: IncrementalDetokenizer, prompt_ids: list[int]):
        self.rid = rid
        self.detok = detok
        self.prompt_ids = prompt_ids
        self.generated: list[int] = []  # every token sent to the client, in order
        self.cached = 0  # prompt tokens found in a prefix cache

    def delta(self, tokens: list[int], final_reason: str | None, logprobs: list[TokenLogprob] | None = None,
              prompt_logprobs: list[TokenLogprob | None] | None = None) -> Delta:
        for t in tokens:
            self.detok.add(t)
        self.generated.extend(tokens)
        reason = FinishReason.STOP if self.detok.stopped else final_reason
        return Delta(self.rid, self.detok.take(final=reason is not None), tokens, reason, len(self.prompt_ids),
                     len(self.generated), self.cached, logprobs, prompt_logprobs,
                     None if prompt_logprobs is None else self.prompt_ids)


def make_validator(config: AppConfig) -> RequestValidator:
    """What the ingress needs to reject bad input before any replica sees it (no weights)."""
    pools = ["prefill", "decode"] if config.has_prefill_pool else ["decode"]
    return RequestValidator.for_model(config.model, [config.engine_for(p) for p in pools])


def _local_quotas():
    quotas = Quotas()

    async def take(*args):
        return quotas.take(*args)

    return take


FIRST_OUTPUT_GRACE_S = 1.0  # past the deadline: a replica that has the request ends it itself, first


class _ReplicaDied(Exception):
    """The decode replica serving a leg was lost (the request may migrate)."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


FAILED = (FinishReason.ERROR, FinishReason.DEADLINE, FinishReason.REJECTED)  # an engine ended it unfinished


def _ended(rid: str, reason: FinishReason, error: str | None, sent: int,
           kind: ErrorKind | None = None) -> ServingError:
    """The error for a request an engine ended without finishing it."""
    if kind == ErrorKind.INVALID_INPUT:  # its own numbers failed it (e.g. sampling overflow): a 400
        return ServingError(Code.INVALID_ARGUMENT, f"request {rid}: {error}")
    if reason == FinishReason.DEADLINE:
        return ServingError(Code.DEADLINE_EXCEEDED, f"request {rid}: {error or 'deadline exceeded'}")
    if reason == FinishReason.REJECTED:
        return Rejected(f"request {rid}: {error or 'overloaded'}", OVERLOAD_RETRY_S)
    return ServingError(Code.ABORTED if sent else "INTERNAL", f"request {rid} failed after {sent} tokens: {error}")


class RequestFlow:
    def __init__(self, config: AppConfig, prefill_handle, decode_handle, router=None,
                 route_timeout_s: float = 0.5, admission: Admission | None = None, telemetry=None,
                 guard_metrics=None, classifier=None, audit: AuditShipper | None = None,
                 budget: Budget | None = None, sampling_defaults: dict | None = None):
        """`config`: one model version's (AppConfig.served_versions); `sampling_defaults`: its
        manifest's, over the checkpoint's generation_config."""
        self.config = config
        self.group = config.serving_group  # the version: the router picks both replicas within it
        self._labels = (config.model_name, config.version or "")  # its requests' metric labels
        self.admission = admission or Admission(config, _local_quotas())
        self.validator = make_validator(config)
        self.tokenizer: Tokenizer = self.validator.tokenizer
        self.prefill = prefill_handle  # None: no prefill pool
        self.decode = decode_handle
        self.router = router  # None: Serve's own replica choice
        self.route_timeout_s = route_timeout_s
        self.telemetry = telemetry  # IngressTelemetry (router/ingress/telemetry.py): routing decisions; None: off
        self.audit = audit  # router/ingress/audit.py: one record per request; None: off
        self.budget = budget  # router/ingress/budget.py: cost, reservations against monthly budgets; None: off
        self.max_migrations = config.fault_tolerance.max_migrations
        mc = ModelConfig.from_dir(config.model)
        self.fingerprint = model_identity(config.model, mc)  # architecture + weights digest
        self.salt = self.fingerprint.encode()  # the engines' block-hash salt, before a tenant's part
        # what a request that leaves temperature/top_p/top_k unset gets (both edges apply it)
        self.sampling_defaults = {} if config.generation_config == "none" else {
            k: v for k, v in asdict(mc.generation_defaults).items() if v is not None}
        self.sampling_defaults.update(sampling_defaults or {})
        self.block_size = config.engine.block_size
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="pdserve-tokenize")
        self.guardrails = Guardrails(config, guard_metrics, classifier)  # classifier: its deployment's handle
        self.response_cache = ResponseCache.from_config(config, self.salt.decode(), guard_metrics)
        self.capacity = Capacity(config.admission)  # the queue ahead of a new request and the streams' pace
        self._background: set[asyncio.Task] = set()  # reads off the request path (kept referenced)

    async def generate(
        self,
        prompt: str | None,
        prompt_token_ids: Sequence[int] | None,
        sampling: SamplingParams,
        request_id: str | None = None,
        tenant: str = DEFAULT_TENANT,
        deadline: float | None = None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        session: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Raises InvalidRequestError (bad input) or Rejected (admission) before the first delta;
        ServingError on failures. `deadline` is wall-clock time (time.time()). `messages` (chat)
        replace the prompt: rendered with the model's chat template (and `tools`, for templates
        that render them). Telemetry, when on, observes the whole request (refusals too); its
        span's context travels to both pools. `session`: the request's session key
        (router/ingress/session.py), a routing preference only.

        Order: an in-flight slot is reserved before any await, then the request rate; only then
        is the prompt rendered and tokenized (in a worker thread), and the size and token quotas
        checked: an over-limit caller costs no tokenizing, and the loop never tokenizes."""
        if request_id is not None:  # the client's label: echoed and traced, so capped like any input
            try:
                self.validator.check_request_id(request_id)
            except InvalidRequestError as e:
                if self.telemetry is not None:
                    self.telemetry.start(tenant, None, *self._labels).end(e)
                raise
        observed = self.telemetry.start(tenant, request_id, *self._labels) if self.telemetry is not None else None
        error: BaseException | None = None
        rid = uuid.uuid4().hex  # ours: the engines' id; the client's request_id only labels replies
        trail = self._audit_trail(rid, request_id, tenant, prompt, prompt_token_ids, messages)
        hold = None
        try:
            refusal = None if trail is None else self.audit.refusal()
            if refusal is not None:  # the audit buffer is full (`when_full: refuse`): nothing runs unaudited
                trail = None  # its record could not be kept either; the refusal is counted in the metrics
                raise refusal
            label = request_id or rid
            if self.admission.max_inflight.due() and self.router is not None:
                self._read_decode_kv()
            ticket = self.admission.reserve(tenant, deadline)
            completion = prompt_tokens = 0
            guard = self.guardrails.for_request(tenant)  # None: the tenant has no policy
            place: Pending | None = None
            streaming = False
            try:
                self.capacity.check(ticket.ctx)  # no await yet: a refusal here touched nothing
                await self.admission.start(ticket)
                req = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize_pool, self._make_request, rid, prompt, prompt_token_ids, sampling, messages, guard,
                    tools)
                prompt_tokens = req.num_prompt_tokens
                self.admission.max_inflight.admitted(req.num_prompt_tokens + sampling.max_tokens)
                if guard is not None:
                    await guard.check_input_remote()  # a classifier: on the loop, bounded by its timeout
                await self.admission.charge(ticket, req.num_prompt_tokens, sampling.max_tokens)
                if self.budget is not None:
                    hold = await self.budget.reserve(tenant, rid, req.num_prompt_tokens, sampling.max_tokens)
                ctx = ticket.ctx
                if observed is not None and observed.trace_context:
                    ctx = replace(ctx, trace_context=observed.trace_context)
                routing_key = None if session is None else f"{tenant}\n{session}"  # tenants never share one
                # not started: a cache hit never starts it
                place = self.capacity.first_tokens.admit(req.num_prompt_tokens)
                deltas = self._run(rid, label, req.prompt_token_ids, sampling, ctx, routing_key, place)
                if guard is not None:
                    deltas = guard.output(deltas)
                async for d in self.response_cache.through(tenant, req.prompt_token_ids, sampling, label, deltas):
                    if streaming:
                        self.capacity.pace.tokens(len(d.token_ids))
                        if d.finish_reason is not None:  # ended now, not when the client's side lets go
                            self.capacity.pace.end()
                            streaming = False
                    elif d.finish_reason is None:
                        self.capacity.pace.start()
                        streaming = True
                    completion = d.completion_tokens
                    if observed is not None:
                        observed.delta(d)
                    if trail is not None:  # the final delta's record is spooled before the client gets it
                        final = d.finish_reason is not None
                        trail.delta(d, self._cost(d.prompt_tokens, d.completion_tokens) if final else None)
                    yield d
            finally:
                if place is not None:
                    place.done()  # no first token (refused, failed, cancelled): nothing measured
                if streaming:
                    self.capacity.pace.end()
                ticket.done(completion)
                if hold is not None:
                    hold.settle(prompt_tokens, completion)
        except BaseException as e:
            error = e
            raise
        finally:
            if trail is not None:
                trail.end(error, None if hold is None else hold.cost / 1e6)
            if observed is not None:
                observed.end(error)

    def _audit_trail(self, rid: str, request_id: str | None, tenant: str, prompt, ids, messages) -> AuditTrail | None:
        opts = self.config.tenants.get(tenant)
        if self.audit is None or (opts is not None and not opts.audit):
            return None
        keep_text = opts is not None and opts.audit_text
        prompt_input = None
        if keep_text:
            prompt_input = messages if messages is not None else prompt if prompt is not None else list(ids or ())
        return AuditTrail(self.audit, rid, request_id, tenant, self.config.model_name, self.fingerprint, keep_text,
                          prompt_input)

    def _cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return 0.0 if self.budget is None or not completion_tokens else self.budget.cost_usd(prompt_tokens,
                                                                                           completion_tokens)

    def _make_request(self, rid: str, prompt: str | None, ids: Sequence[int] | None, sampling: SamplingParams,
                      messages: list[dict] | None, guard: RequestGuard | None = None,
                      tools: list[dict] | None = None):
        """Validate and tokenize (a worker thread: never on the event loop). Chat messages are
        rendered first; the rendered text meets the prompt caps (characters, valid Unicode)
        before it is tokenized, and errors name `messages`. Then the tenant's guardrail checks
        the prompt's text (the text given, or the capped token ids decoded)."""
        param = "prompt" if messages is None else "messages"
        if messages is not None:
            prompt, ids = None, self.chat_ids(messages, tools)
        req = self.validator.make_request(rid, prompt, ids, sampling)
        if guard is not None:
            guard.check_input(prompt if prompt is not None else self.tokenizer.decode(req.prompt_token_ids), param)
        return req

    async def _run(self, rid: str, label: str, ids: list[int], sampling: SamplingParams,
                   ctx: RequestContext, session: str | None = None,
                   place: Pending | None = None) -> AsyncIterator[Delta]:
        """The first-token leg (none, local or remote prefill), then the decode legs. `rid` is
        the internal id, `label` what the client's deltas carry; `place` leaves the first-token
        queue with the first token."""
        stream = _Stream(label, IncrementalDetokenizer(self.tokenizer, ids, sampling.stop), ids)
        decision = await self._route(ids, ctx, session)
        if decision is not None:
            self.capacity.check_queue_wait(f"request {rid}", decision.queue_wait_s, ctx)
        kv_handle = None  # closing this generator closes the legs' at once (aclosing): a guardrail's stop frees both pools
        if self.prefill is not None and not (decision is not None and decision.mode == "local"):
            first = await self._first_token(rid, ids, sampling, ctx, decision.prefill if decision else None, stream)
            if first is not None:
                if place is not None:
                    place.done(len(ids) - stream.cached)
                d, kv_handle = first
                try:
                    yield d
                except BaseException:  # the client left before decode took the handle
                    if kv_handle is not None and d.finish_reason is None:
                        await self._release(rid, kv_handle.engine_id)
                    raise
                if d.finish_reason is not None or kv_handle is None:
                    return
        async with aclosing(self._decode_legs(rid, ids, sampling, ctx, kv_handle,
                                              decision.decode if decision else None, stream)) as legs:
            async for d in legs:
                if place is not None:
                    place.done(len(ids) - d.cached_prompt_tokens)
                    place = None
                yield d

    async def _first_token(self, rid: str, ids: list[int], sampling: SamplingParams, ctx: RequestContext,
                           target: str | None, stream: "_Stream"):
        """Remote prefill: the first token's delta (sent at once, before any transfer) and the
        handle of the prompt's KV for decode to pull (None when the first token ends the
        request). None when prefill failed: decode prefills locally."""
        result = await self._prefill(rid, ids, sampling, ctx, target)
        if result is None:
            return None
        stream.cached = result.num_cached_tokens
        first_lp = None if result.first_logprob is None else [result.first_logprob]
        if result.handle is None:  # the first token ends it
            return stream.delta([result.first_token], result.finish_reason, first_lp, result.prompt_logprobs), None
        d = stream.delta([result.handle.first_token], None, first_lp, result.prompt_logprobs)
        if d.finish_reason is not None:  # a stop string in the first token's text
            await self._release(rid, result.handle.engine_id)
        return d, result.handle

    async def _decode_legs(self, rid: str, ids: list[int], sampling: SamplingParams, ctx: RequestContext,
                           kv_handle, decode_target: str | None, stream: "_Stream") -> AsyncIterator[Delta]:
        """The decode leg, and its migrations. If its replica dies, another decode replica gets
        the prompt and every token sent so far, as the request's output (prefilled there: max_tokens,
        min_tokens and the penalties count them as before), and produces the rest, so the
        client's stream goes on without a gap or a repeat (greedy output is identical; a seeded
        sampler restarts its random stream at the migration)."""
        generated = stream.generated
        leg_rid, leg_generated = rid, []
        for migration in range(self.max_migrations + 1):
            if migration:
                leg_rid, leg_generated = f"{rid}.m{migration}", list(generated)
                log.warning("decode replica of %s died after %d tokens; migrating (%d of %d)",
                            rid, len(generated), migration, self.max_migrations)
            try:
                async with aclosing(self._decode(leg_rid, ids, sampling, kv_handle, ctx, decode_target,
                                                 stream, leg_generated)) as leg:
                    async for d in leg:
                        if kv_handle is None and migration == 0:
                            stream.cached = d.cached_prompt_tokens
                        d.cached_prompt_tokens = stream.cached  # a migrated leg's count covers tokens already sent
                        yield d
                        if d.finish_reason is not None:
                            return
            except _ReplicaDied as e:
                kv_handle, decode_target = None, None  # the next leg prefills on its own replica
                if migration < self.max_migrations:
                    continue
                if not generated:  # the last try never started
                    raise ServingError(Code.UNAVAILABLE, f"decode failed for {rid}: {e.cause}") from e
                raise ServingError(Code.ABORTED, f"decode replica of {rid} died after {len(generated)} tokens "
                                                 f"were sent ({self.max_migrations} migrations allowed): {e.cause}") from e
            raise ServingError(Code.INTERNAL, f"decode stream for {rid} ended without a finish")

    async def _decode(self, rid: str, ids: list[int], sampling: SamplingParams, kv_handle, ctx: RequestContext,
                      target: str | None, client: "_Stream", generated: list[int]) -> AsyncIterator[Delta]:
        """One decode leg: stream the replica's outputs as deltas. Raises _ReplicaDied when the
        replica is lost (the caller migrates), ServingError for the request's own failures.
        `generated`: tokens sent by earlier legs (the replica's output counts include them)."""
        from ray.exceptions import ActorUnavailableError, RayActorError  # noqa: PLC0415

        try:
            replies = self.decode.options(stream=True).generate.remote(
                rid, ids, sampling, kv_handle, ctx, target_replica=target, generated=generated)
        except Exception as e:  # noqa: BLE001
            raise ServingError(Code.UNAVAILABLE, f"no decode replica: {e}") from e
        finished = pulled = False
        # Until a replica takes the request, nothing enforces its deadline (a sleeping pool is
        # loading one, every replica's queue is full at Serve's router): bound that wait here. From
        # its first output the engine has it, and ends it at the deadline itself.
        remaining = ctx.remaining_s()
        loop = asyncio.get_running_loop()
        first_by = None if remaining is None else loop.time() + max(remaining, 0.0) + FIRST_OUTPUT_GRACE_S
        bound = None
        try:
            async with asyncio.timeout_at(first_by) as bound, aclosing(coalesce(
                    replies, merge_outputs, final=lambda o: o.finished, alone=lambda o: o.finish_reason in FAILED)) as outs:
                async for out in outs:
                    out: RequestOutput
                    if not pulled and first_by is not None:
                        bound.reschedule(None)
                    pulled = True
                    if out.finish_reason in FAILED:
                        raise _ended(rid, out.finish_reason, out.error, out.num_output_tokens, out.error_kind)
                    d = client.delta(out.token_ids, out.finish_reason if out.finished else None, out.logprobs,
                                     out.prompt_logprobs)
                    if kv_handle is None:  # the prompt was computed on this replica: what its cache saved
                        d.cached_prompt_tokens = out.num_cached_tokens
                    if d.finish_reason is not None:
                        finished = True
                    if d.text or d.token_ids or d.finish_reason:
                        yield d
                    if finished:
                        return
        except ServingError:
            raise
        except TimeoutError as e:
            if bound is None or not bound.expired():
                raise ServingError(Code.ABORTED if pulled else Code.UNAVAILABLE, f"decode failed for {rid}: {e!r}") from e
            raise ServingError(Code.DEADLINE_EXCEEDED, f"request {rid}: deadline exceeded before a decode replica "
                                                       "took it") from e
        except QueueFullError as e:  # the decode replica's queue is full (raised by its submit)
            raise Rejected(f"request {rid}: {e}", OVERLOAD_RETRY_S) from e
        except (RayActorError, ActorUnavailableError) as e:
            raise _ReplicaDied(e) from e
        except Exception as e:
            raise ServingError(Code.ABORTED if pulled else Code.UNAVAILABLE, f"decode failed for {rid}: {e}") from e
        finally:
            if not finished:
                replies.cancel()
            if kv_handle is not None and not pulled:
                await self._release(rid, kv_handle.engine_id)  # only the first leg has a handle

    def _read_decode_kv(self) -> None:
        """Read the decode pool's KV tokens from the router in the background, for the auto
        in-flight cap (router/ingress/capacity.py InflightCap); a failed read keeps the last one."""
        cap = self.admission.max_inflight
        cap.kv_read(None)  # not due again for REFRESH_S, whatever the read does

        async def read():
            try:
                loads = await asyncio.wait_for(self.router.live_loads.remote(), self.route_timeout_s * 4)
            except Exception as e:  # noqa: BLE001
                log.debug("reading the decode pool's KV failed: %s", e)
                return
            cap.kv_read(sum(r.total_blocks for r in loads if r.pool == "decode") * self.block_size)

        self._background.add(task := asyncio.ensure_future(read()))
        task.add_done_callback(self._background.discard)

    async def _route(self, ids: list[int], ctx: RequestContext, session: str | None = None):
        """One router call per request; any failure (router down, slow, no replicas known yet)
        falls back to Serve's own choice (power of two on local load)."""
        if self.router is None:
            return None
        hashes = hash_request_blocks(ids, self.block_size, extend_salt(self.salt, ctx.cache_salt))
        started = time.monotonic()
        try:
            decision = await asyncio.wait_for(self.router.route.remote(hashes, len(ids), session, self.group), self.route_timeout_s)
        except Exception as e:  # noqa: BLE001
            log.debug("routing fell back to Serve's choice: %s", e)
            decision = None
        if self.telemetry is not None:
            self.telemetry.routed(decision, started, len(ids), ctx)
        return decision

    async def _prefill(self, rid: str, ids: list[int], sampling: SamplingParams, ctx: RequestContext,
                       target: str | None):
        call = self.prefill.prefill.remote(rid, ids, sampling, ctx, target_replica=target)
        remaining = ctx.remaining_s()
        try:
            result = await (call if remaining is None else asyncio.wait_for(call, max(remaining, 0.0)))
        except (TimeoutError, asyncio.TimeoutError) as e:  # cancelling the call aborts the prefill
            raise ServingError(Code.DEADLINE_EXCEEDED, f"request {rid}: deadline exceeded during prefill") from e
        except QueueFullError as e:
            raise Rejected(f"request {rid}: {e}", OVERLOAD_RETRY_S) from e
        except Exception as e:  # noqa: BLE001 — any other prefill failure: decode prefills locally
            log.warning("prefill of %s failed (%s); prefilling on decode", rid, e)
            return None
        if result.finish_reason in (FinishReason.DEADLINE, FinishReason.REJECTED):
            raise _ended(rid, result.finish_reason, result.error, 0)
        if result.finish_reason == FinishReason.ERROR:
            log.warning("prefill of %s failed (%s); prefilling on decode", rid, result.error)
            return None
        return result

    async def _release(self, rid: str, holder: str) -> None:
        """End a lease early, on the prefill replica that holds it (the handle's engine id is its
        Serve replica id; the request router honours target_replica). If that replica is gone
        the router picks another, which holds nothing of `rid` (ids are ours and unique): a no-op."""
        try:
            await self.prefill.release.remote(rid, target_replica=holder)
        except Exception as e:  # noqa: BLE001 — the lease expires anyway
            log.warning("release of %s on %s failed (its lease will expire): %s", rid, holder, e)

    def model_info(self) -> dict:
        return {"id": self.config.model_name, "version": self.config.version or "",
                "max_model_len": self.validator.max_model_len, "vocab_size": self.validator.vocab_size}

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render the model's chat template (cluster/engine/chat_template.py), ready to tokenize."""
        return render_chat(self.tokenizer, messages, tools=tools)

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A chat's prompt token ids, for both edges: the template rendered (a template's own error
        is the client's: 400 on `messages`), then the rendered text meets the prompt caps before it
        is tokenized without adding special tokens again."""
        if not messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        try:
            text = self.chat_prompt(messages, tools)
        except ValueError as e:
            raise InvalidRequestError("messages", str(e)) from e
        try:
            return self.validator.tokenize(text, add_special_tokens=False)
        except InvalidRequestError as e:
            raise InvalidRequestError("messages", e.message) from e

