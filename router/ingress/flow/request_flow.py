"""One request's path through one model version's pools, and nothing else: no policy.

    prefill replica: prompt -> first token + KVHandle      (sent to the client at once)
    decode replica:  KVHandle -> pull missing blocks -> the rest of the tokens, streamed

With no prefill replica (or a failed prefill) the decode replica prefills locally. Text is
detokenized here, over the whole stream, so the first token's text and the rest join up.

Request identity: every request has its own id (a uuid, given by the caller), which engines,
leases, KV notifications, migrations and releases use; the client's `request_id` is only a
label, echoed in the deltas. Two clients with the same request_id never meet inside a replica.

Who may run, and what wraps the stream (admission, guardrails, the response cache, telemetry,
audit), is the gateway's (router/ingress/gateway/): it calls `prepare`, then `run`, and learns
what happens on the way through an `Observer`. Engines end a request at its deadline themselves
("deadline"), and refuse work when their queues are full or a request waited past its
time-to-live ("rejected").
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import asdict
from typing import AsyncIterator, Callable

from cluster.config import AppConfig
from cluster.engine.chat_template import render_chat, render_chat_pieces
from cluster.engine.kv_cache import extend_salt, hash_request_blocks
from cluster.engine.model.identity import model_identity
from cluster.engine.model_config import ModelConfig
from cluster.engine.request import Request, RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from cluster.engine.validation import RequestValidator
from cluster.errors import InvalidRequestError
from router.ingress.flow.legs import DecodeLegs, PrefillLeg
from router.ingress.flow.sampling import Sampling, to_sampling
from router.ingress.flow.stream import ClientStream
from router.ingress.flow.route_memory import RouteMemory
from router.ingress.request import ClientRequest, Delta, SamplingSpec, ToolsSpec

log = logging.getLogger(__name__)

TOKENIZE_THREADS = 2  # chat rendering and tokenizing run here, never on the event loop
# A token-id prompt up to this long is checked on the event loop (1,024 ids: 0.06 ms on this VM; a
# round trip through the tokenizing threads cost the front door ~0.07 ms a request, and two wake-ups)
INLINE_TOKEN_IDS = 1024


class Observer:
    """What a run tells its caller as it happens. `routed` may raise to refuse the request (a
    queue the decision predicts too long); nothing has run on a replica by then."""

    def started(self) -> None:
        """The run begins (before routing): a run never iterated (a response-cache hit) never starts."""

    def routed(self, decision, started: float, num_prompt_tokens: int, ctx: RequestContext) -> None:
        """The router's decision (None: it was unavailable, Serve chose); `started`: monotonic."""

    def first_token(self, computed_tokens: int) -> None:
        """The first token arrived; `computed_tokens`: prompt tokens no cache held."""


def make_validator(config: AppConfig) -> RequestValidator:
    """What the ingress needs to reject bad input before any replica sees it (no weights)."""
    pools = ["prefill", "decode"] if config.has_prefill_pool else ["decode"]
    return RequestValidator.for_model(config.model, [config.engine_for(p) for p in pools])


class RequestFlow:
    def __init__(self, config: AppConfig, prefill_handle, decode_handle, router=None,
                 route_timeout_s: float = 0.5, sampling_defaults: dict | None = None, replies=None):
        """`config`: one model version's (AppConfig.served_versions); `sampling_defaults`: its
        manifest's, over the checkpoint's generation_config. `router`: the router actor (None:
        Serve's own replica choice). `replies`: the ingress's ReplyInbox (router/replies.py; None:
        decode outputs stream on Serve's calls)."""
        self.config = config
        self.group = config.serving_group  # the version: the router picks both replicas within it
        self.validator = make_validator(config)
        self.tokenizer: Tokenizer = self.validator.tokenizer
        self.router = router
        self.route_timeout_s = route_timeout_s
        self.memory = RouteMemory()  # where prefixes went, for while the router cannot answer
        mc = ModelConfig.from_dir(config.model)
        self.fingerprint = model_identity(config.model, mc)  # architecture + weights digest
        self.salt = self.fingerprint.encode()  # the engines' block-hash salt, before a tenant's part
        # what a request that leaves temperature/top_p/top_k unset gets (both edges)
        self.sampling_defaults = {} if config.generation_config == "none" else {
            k: v for k, v in asdict(mc.generation_defaults).items() if v is not None}
        self.sampling_defaults.update(sampling_defaults or {})
        self.block_size = config.engine.block_size
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="pdserve-tokenize")
        self._decode_handle = decode_handle
        ft = config.fault_tolerance
        # a replica is reached through its home deployment, whichever role it plays now
        homes = {"decode": decode_handle} if prefill_handle is None else {"prefill": prefill_handle,
                                                                          "decode": decode_handle}
        self._prefill = None if prefill_handle is None else PrefillLeg(prefill_handle, ft.replica_wait_s, homes)
        self._decode = DecodeLegs(decode_handle, ft.max_migrations, self._prefill, ft.replica_wait_s, homes, replies)

    # ---- before a request runs -----------------------------------------------------------------

    def sampling(self, spec: SamplingSpec, tools: ToolsSpec | None = None) -> Sampling:
        """The client's sampling fields in this version's terms (400 naming the field)."""
        return to_sampling(spec, tools, self.validator, self.config.default_max_tokens, self.sampling_defaults,
                           self.config.tool_call_parser)

    async def prepare(self, rid: str, request: ClientRequest, sampling: SamplingParams,
                      inspect: Callable[[Callable[[], str]], None] | None = None) -> Request:
        """Validate and tokenize in a worker thread (never on the event loop). Chat messages are
        rendered first; the rendered text meets the prompt caps (characters, valid Unicode)
        before it is tokenized, and errors name `messages`. `inspect` (same thread) is then given
        the prompt's text, to ask for: the text given, or the capped token ids decoded.
        A prompt of at most INLINE_TOKEN_IDS token ids with nothing to inspect is only checked,
        here: that costs less than the two thread hops."""
        ids = request.prompt_token_ids
        if inspect is None and ids is not None and request.messages is None and len(ids) <= INLINE_TOKEN_IDS:
            return self._make_request(rid, request, sampling, None)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, self._make_request, rid, request, sampling, inspect)

    def _make_request(self, rid: str, request: ClientRequest, sampling: SamplingParams,
                      inspect: Callable[[Callable[[], str]], None] | None) -> Request:
        prompt, ids = request.prompt, request.prompt_token_ids
        if request.messages is not None:
            tools = None if request.tools is None else [t.template() for t in request.tools.functions] or None
            prompt, ids = None, self.chat_ids(list(request.messages), tools)
        req = self.validator.make_request(rid, prompt, None if ids is None else list(ids), sampling)
        if inspect is not None:
            inspect(lambda: prompt if prompt is not None else self.tokenizer.decode(req.prompt_token_ids))
        return req

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render the model's chat template (cluster/engine/chat_template.py), ready to tokenize."""
        return render_chat(self.tokenizer, messages, tools=tools)

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A chat's prompt token ids: the template rendered (a template's own error is the
        client's: 400 on `messages`), then the rendered text meets the prompt caps before it is
        tokenized without adding special tokens again. Only the template's own special tokens
        become special ids: one in a message is text (no forged roles; chat_template.py)."""
        if not messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        try:
            pieces = render_chat_pieces(self.tokenizer, messages, tools=tools)
        except ValueError as e:
            raise InvalidRequestError("messages", str(e)) from e
        try:
            return self.validator.tokenize_chat(pieces)
        except InvalidRequestError as e:
            raise InvalidRequestError("messages", e.message) from e

    # ---- the run ------------------------------------------------------------------------------

    async def run(self, rid: str, label: str, ids: list[int], sampling: SamplingParams, ctx: RequestContext,
                  routing_key: str | None = None, observer: Observer = Observer()) -> AsyncIterator[Delta]:
        """The first-token leg (none, local or remote prefill), then the decode legs. `rid` is
        the internal id, `label` what the client's deltas carry. Closing this generator closes
        the legs' at once: both pools free the request's blocks."""
        observer.started()
        stream = ClientStream(label, IncrementalDetokenizer(self.tokenizer, ids, sampling.stop), ids)
        decision = await self._route(ids, ctx, routing_key, observer)
        kv_handle = None
        first_seen = False
        if self._prefill is not None and not (decision is not None and decision.mode == "local"):
            first = await self._prefill.first_token(rid, ids, sampling, ctx, decision.prefill if decision else None,
                                                    stream, decision.prefill_deployment if decision else None)
            if first is not None:
                observer.first_token(len(ids) - stream.cached)
                first_seen = True
                d, kv_handle = first
                try:
                    yield d
                except BaseException:  # the client left before decode took the handle
                    if kv_handle is not None and d.finish_reason is None:
                        await self._prefill.release(rid, kv_handle.engine_id)
                    raise
                if d.finish_reason is not None or kv_handle is None:
                    return

        async def reroute():  # a fresh decision's decode replica (the one named first does not decode now)
            again = await self._route(ids, ctx, routing_key, Observer())
            return (None, None) if again is None else (again.decode, again.decode_deployment)

        async with aclosing(self._decode.stream(rid, ids, sampling, ctx, kv_handle,
                                                decision.decode if decision else None, stream,
                                                decision.decode_deployment if decision else None, reroute)) as legs:
            async for d in legs:
                if not first_seen:
                    observer.first_token(len(ids) - d.cached_prompt_tokens)
                    first_seen = True
                yield d

    async def _route(self, ids: list[int], ctx: RequestContext, routing_key: str | None, observer: Observer):
        """One router call per request; any failure (router down, slow, no replicas known yet)
        falls back to the decision last made for the same session or first block (route_memory.py),
        else to Serve's own choice (power of two on local load). A session's call carries the
        replicas last chosen for it, which a restarted router adopts (router/sessions.py)."""
        if self.router is None:
            return None
        hashes = hash_request_blocks(ids, self.block_size, extend_salt(self.salt, ctx.cache_salt))
        started = time.monotonic()
        carried = self.memory.carried(routing_key, started)  # a restarted router's table learns the session
        try:
            decision = await asyncio.wait_for(self.router.route.remote(hashes, len(ids), routing_key, self.group,
                                                                       carried=carried), self.route_timeout_s)
        except Exception as e:  # noqa: BLE001
            decision = self.memory.recall(hashes, routing_key)
            log.debug("routing fell back to %s: %s", "Serve's choice" if decision is None else "a remembered decision", e)
        else:
            self.memory.remember(hashes, routing_key, decision, started)
        observer.routed(decision, started, len(ids), ctx)
        return decision

    # ---- what probes and admission read -------------------------------------------------------

    async def decode_live(self, timeout_s: float) -> bool:
        """One bounded call to a decode replica (Serve picks a live one; with none it waits: the
        bound answers). Any failure is "not live"."""
        if self._decode_handle is None:
            return False
        try:
            await asyncio.wait_for(self._decode_handle.load.remote(), timeout_s)
            return True
        except Exception as e:  # noqa: BLE001
            log.info("health: no live decode replica (%r)", e)
            return False

    async def decode_kv_tokens(self, timeout_s: float) -> int | None:
        """The KV tokens of this version's decode pool, as the router knows them: replicas that
        decode now, of this serving group (the router reports every group's), not draining (a
        draining replica takes no new request, so its blocks are no room for one); None: no
        router, or it did not answer."""
        if self.router is None:
            return None
        try:
            loads = await asyncio.wait_for(self.router.live_loads.remote(), timeout_s)
        except Exception as e:  # noqa: BLE001
            log.debug("reading the decode pool's KV failed: %s", e)
            return None
        return sum(r.total_blocks for r in loads
                   if r.role == "decode" and r.group == self.group and not r.draining) * self.block_size

    def model_info(self) -> dict:
        return {"id": self.config.model_name, "version": self.config.version or "",
                "max_model_len": self.validator.max_model_len, "vocab_size": self.validator.vocab_size}
