"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions (with SSE)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
import uuid
from contextlib import aclosing
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import IngressLimits
from cluster.errors import InvalidRequestError
from router.ingress import probes
from router.ingress.flow import Delta
from router.ingress.openai_schema import (ChatRequest, CompletionRequest, RequestBody, ToolUse, check_messages,
                                          to_sampling_params, tool_use)
from router.ingress.session import SESSION_HEADER, session_key
from router.ingress.tool_parser import ToolCallStream, openai_tool_calls
from router.ingress.status import Code, ServingError, retry_after_seconds

TIMEOUT_HEADER = "x-pdserve-timeout-s"  # the request's deadline, seconds from now (HTTP header or gRPC metadata)
IDEMPOTENCY_HEADER = "idempotency-key"


def parse_deadline(value: str | None, max_chars: int = 32) -> float | None:
    """Wall-clock deadline from a timeout header; None without one."""
    if value is None:
        return None
    if len(value) > max_chars:
        raise InvalidRequestError(TIMEOUT_HEADER, f"longer than {max_chars} characters")
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidRequestError(TIMEOUT_HEADER, f"must be a positive number of seconds, got {value!r}")
    return time.time() + seconds



def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


def serving_error_response(e: ServingError) -> JSONResponse:
    retry = e.retry_after_s
    kind = getattr(e, "error_type", None) or e.code.error_type  # a budget refusal: insufficient_quota
    code = getattr(e, "openai_code", None) or (  # a guardrail's refusal: "content_filter", as OpenAI's
        "model_not_found" if e.code is Code.NOT_FOUND else kind if kind != e.code.error_type
        else e.code.grpc_name.lower())
    return error_response(e.code.http_status, e.message, getattr(e, "param", None), kind, code,
                          None if retry is None else {"Retry-After": str(retry_after_seconds(retry))})


# The replica's flow and idempotency runner. Reached through module-level functions (pickled by
# reference), because Serve ships the ingress class, and any closure in it, to the replica by value.
_replica: dict[str, Any] = {}


def bind_replica(flow, idempotent) -> None:
    _replica["flow"], _replica["idempotent"] = flow, idempotent


def get_flow():
    return _replica["flow"]


def get_idempotent():
    return _replica["idempotent"]



def _limits() -> IngressLimits:
    flow = _replica.get("flow")
    return flow.config.ingress_limits if flow is not None else IngressLimits()


class BodyLimit:
    """ASGI middleware: a request body larger than `max_body_bytes` is refused with 413 before
    anything parses it: at once by its Content-Length, else as the streamed bytes pass the cap.
    The (bounded) body is then replayed to the app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cap = _limits().max_body_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            return await _too_large(scope, receive, send, cap)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            size += len(message.get("body", b""))
            if size > cap:
                return await _too_large(scope, receive, send, cap)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


async def _too_large(scope, receive, send, cap: int):
    await error_response(413, f"body: the request body is larger than {cap} bytes (max_body_bytes)", "body",
                         code="request_too_large")(scope, receive, send)


def _validation_message(err: dict, field: str) -> str:
    if err.get("type") == "extra_forbidden":
        return f"{field}: is not supported by this server"
    return f"{field}: {err.get('msg', 'invalid')}"


def build_openai_app() -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":  # loc is ("body", <byte offset>)
            error = (err.get("ctx") or {}).get("error", "JSON decode error")
            return error_response(400, f"body: is not valid JSON ({error})", "body")
        field = ".".join(str(p) for p in err.get("loc", ())[1:]) or "body"
        return error_response(400, _validation_message(err, field), field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        """FastAPI's own refusals (an unparsable body, an unknown path or method) in the OpenAI shape."""
        param = "body" if exc.status_code == 400 else None
        message = f"body: {exc.detail}" if param else str(exc.detail)
        return error_response(exc.status_code, message, param, headers=getattr(exc, "headers", None))

    def _check(request: Request, model: str | None):
        """The flow and the caller's tenant; refuses an unknown key or model."""
        flow = get_flow()  # module-level: see bind_replica
        return flow, flow.authorize(request.headers.get("authorization"), model)

    def _fail(e: Exception) -> JSONResponse:
        if isinstance(e, InvalidRequestError):
            return error_response(400, str(e), e.field)
        if isinstance(e, ServingError):
            return serving_error_response(e)
        raise e

    async def _serve(request: Request, body: "RequestBody", chat: bool):
        """Admit, run, respond; a non-streaming request with an Idempotency-Key runs at most once."""
        try:
            flow, tenant = _check(request, body.model)
            key = request.headers.get(IDEMPOTENCY_HEADER)
            if key is None or body.stream:
                return await _run(flow, tenant, request, body, chat)
            fingerprint = hashlib.sha256(
                json.dumps([request.url.path, body.model_dump(mode="json")], sort_keys=True).encode()).hexdigest()
            result = await get_idempotent().run(
                tenant, key, fingerprint, lambda: _run(flow, tenant, request, body, chat),
                succeeded=lambda r: isinstance(r, dict))
            return result
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    async def _run(flow, tenant: str, request: Request, body: "RequestBody", chat: bool):
        try:
            limits = flow.config.ingress_limits
            deadline = parse_deadline(request.headers.get(TIMEOUT_HEADER), limits.max_timeout_header_chars)
            session = session_key(request.headers.get(SESSION_HEADER), body.prompt_cache_key, body.user,
                                  limits.max_session_id_chars)
            messages, tools, use = None, None, tool_use(body, flow.config.tool_call_parser)
            if chat:  # rendered and tokenized by the flow, after admission, off the event loop
                if len(body.messages) > limits.max_chat_messages:
                    raise InvalidRequestError("messages", f"has {len(body.messages)} messages; at most "
                                                          f"{limits.max_chat_messages} are accepted")
                check_messages(body.messages)
                messages = [_message(m, i) for i, m in enumerate(body.messages)]
                tools = [t.model_dump(exclude_none=True) for t in body.tools] if use.active else None
                prompt, ids = None, None
            else:
                prompt, ids = _completion_prompt(body)
            stop = body.stop if isinstance(body.stop, list) else ()
            flow.config.engine.limits.check_counts(len(stop), len(body.stop_token_ids or ()))
            limits.check_choices(body.n)
            try:
                sp = to_sampling_params(body, flow.config.default_max_tokens, flow.validator, flow.sampling_defaults,
                                        use)
                choices = await _start_choices(flow, body.n, prompt, ids, sp, tenant, deadline, messages, tools,
                                               session)
            except InvalidRequestError as e:
                if use.forced is not None and e.field == "response_format":  # the tools' grammar: name what the client sent
                    raise InvalidRequestError("tools", e.message) from e
                raise
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        echo = None if chat or not body.echo else prompt if prompt is not None else flow.tokenizer.decode(ids)
        return await _respond(flow, body, choices, chat=chat, use=use, echo=echo)

    @app.get("/health")
    async def health():
        """200 when a decode replica of the model answers within a short bound, else 503."""
        flow = get_flow()
        if await probes.decode_live(flow):
            return {"status": "serving", "model": flow.config.model_name}
        return error_response(503, "no live decode replica", None, Code.UNAVAILABLE.error_type, "unavailable")

    @app.get("/version")
    async def version():
        return probes.version_info(get_flow())

    @app.get("/metrics")
    async def metrics(request: Request):
        """This ingress's own gauges in Prometheus text (the pdserve_* catalogue is Ray's endpoint).
        Needs an API key when auth is on: it names tenants."""
        try:
            flow, _ = _check(request, None)
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        return PlainTextResponse(probes.metrics_text(flow), media_type=probes.METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            flow, _ = _check(request, None)
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        info = flow.model_info()
        return {"object": "list", "data": [{"id": info["id"], "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": info["max_model_len"]}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _serve(request, body, chat=True)

    return app


def _text(content, index: int) -> str:
    """A message's text: a string, or text parts (other part types are refused, naming the part)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        field = f"messages.{index}.content.{j}"
        if part.get("type") != "text":
            raise InvalidRequestError(f"{field}.type", f"content part type {part.get('type')!r} is not supported")
        if set(part) - {"type", "text"}:
            raise InvalidRequestError(field, f"{sorted(set(part) - {'type', 'text'})} is not supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{field}.text", f"must be a string, got {type(text).__name__}")
        parts.append(text)
    return "".join(parts)


def _completion_prompt(body: CompletionRequest) -> tuple[str | None, list[int] | None]:
    p = body.prompt
    if isinstance(p, str):
        return p, None
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return None, list(p)
    if isinstance(p, list) and len(p) == 1:
        return (p[0], None) if isinstance(p[0], str) else (None, list(p[0]))
    raise InvalidRequestError("prompt", "give one prompt: a string or a list of token ids (batches are not supported)")


Choice = tuple[AsyncIterator[Delta], Delta]  # a running request's stream and its first delta


async def _start_choices(flow, n: int, prompt, ids, sp, tenant: str, deadline, messages,
                         tools: list[dict] | None = None, session: str | None = None) -> list[Choice]:
    """Start the request's n choices; return once each has its first delta. Bad input, refusals
    and early failures raise here (and stop every choice started), so they become HTTP errors.

    As vLLM does for n > 1, each choice is a request of its own (choice i samples with seed + i
    when a seed is given). Choice 0 runs first, and the others start once it has its second
    token: by then its prompt's full blocks are cached where it was prefilled and, after its KV
    pull, on its decode replica, so the others compute only the prompt's last partial block and
    pull only that (the full blocks are shared, not copied). Without a session key of their own,
    the choices share one (`choices:<id>`) so the router keeps them on choice 0's replicas while
    their load allows."""
    session = session if session is not None or n == 1 else f"choices:{uuid.uuid4().hex}"

    def start(i: int) -> AsyncIterator[Delta]:
        child = sp if i == 0 or sp.seed is None else replace(sp, seed=sp.seed + i)
        return flow.generate(prompt, ids, child, tenant=tenant, deadline=deadline, messages=messages, tools=tools,
                             session=session)

    streams = [start(0)]
    try:
        firsts = [await anext(streams[0])]
        if n > 1:
            if firsts[0].finish_reason is None:  # its second delta: its decode leg holds the prompt
                second = await anext(streams[0], None)
                if second is not None:
                    streams[0] = _prepend(second, streams[0])
            streams += [start(i) for i in range(1, n)]
            rest = await asyncio.gather(*(anext(s) for s in streams[1:]), return_exceptions=True)
            if failed := next((r for r in rest if isinstance(r, BaseException)), None):
                raise failed
            firsts += rest
    except BaseException:
        await _close(streams)
        raise
    return list(zip(streams, firsts))


async def _prepend(item: Delta, stream: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """`item`, then the rest of `stream` (closing this closes `stream`)."""
    async with aclosing(stream):
        yield item
        async for d in stream:
            yield d


async def _close(streams) -> None:
    for s in streams:
        try:
            await s.aclose()  # the flow's cleanup: cancels the request on both legs
        except Exception:  # noqa: BLE001 — a stream that already failed has nothing to close
            pass


async def _collect(stream: AsyncIterator[Delta], first: Delta) -> tuple[str, Delta, list]:
    text, last, logprobs = first.text, first, list(first.logprobs or ())
    async for d in stream:
        text += d.text
        last = d
        logprobs += d.logprobs or ()
    return text, last, logprobs


def _message(m, index: int) -> dict:
    """A chat message as the template sees it (tool calls and their results as OpenAI sends them)."""
    out = {"role": m.role, "content": _text(m.content, index)}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _tool_result(use: ToolUse, text: str, finish_reason: str | None) -> tuple[list[dict] | None, str | None, str | None]:
    """A tool-using output -> (tool_calls, content, finish_reason). Forced: the grammar makes the
    text valid JSON of the call's schema once it stopped; cut short (length), the text is
    returned as content, with its finish reason, and no call. "auto": the model's parser; its
    calls end with finish "tool_calls", else the text is content."""
    if use.parser is not None:  # calls only when the model stopped by itself (not length, not a guardrail's flag)
        out = use.parser.parse(text, use.names, use.parallel) if finish_reason == "stop" else None
        return (openai_tool_calls(out.calls), out.content, "tool_calls") if out and out.calls else (
            None, text, finish_reason)
    if finish_reason != "stop":
        return None, text, finish_reason
    try:
        parsed = json.loads(text)
    except ValueError:
        return None, text, finish_reason
    if use.forced == "named":
        calls = [(use.name, text)]
    else:
        calls = [(c["name"], json.dumps(c["parameters"], separators=(",", ":"))) for c in parsed]
    tool_calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                   "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
    # OpenAI: "tool_calls" when the model chose to call ("required"); "stop" for a named function
    return tool_calls, None, "tool_calls" if use.forced == "required" else "stop"


async def _respond(flow, body: RequestBody, choices: list[Choice], chat: bool, use: ToolUse = ToolUse(),
                   echo: str | None = None):
    """`echo` (completions): the prompt's text, put before each choice's completion (and, with
    logprobs, the prompt's logprobs before the completion's, the first token's null, as OpenAI)."""
    rid = ("chatcmpl-" if chat else "cmpl-") + choices[0][1].request_id
    created = int(time.time())
    model = flow.config.model_name
    shapers = [_Logprobs(flow.tokenizer, chat) if _asks_logprobs(body) else None for _ in choices]
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(choices, rid, created, model, chat, include_usage, shapers, use, echo),
                                 media_type="text/event-stream")
    tasks = [asyncio.ensure_future(_collect(s, first)) for s, first in choices]
    try:
        results = await asyncio.gather(*tasks)
    except ServingError as e:
        return serving_error_response(e)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close([s for s, _ in choices])
    out = []
    for i, ((text, last, logprobs), shaper, (_, first)) in enumerate(zip(results, shapers, choices)):
        if not chat:
            lp = None if shaper is None else shaper.shape(logprobs, first if echo is not None else None)
            out.append({"index": i, "text": (echo or "") + text, "logprobs": lp, "finish_reason": last.finish_reason})
            continue
        lp = None if shaper is None else shaper.shape(logprobs)
        calls, content, finish = _tool_result(use, text, last.finish_reason) if use.active else (
            None, text, last.finish_reason)
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": out, "usage": _usage([last for _, last, _ in results])}


def _usage(lasts: list[Delta]) -> dict:
    """The prompt once (every choice has the same), the completions summed, as OpenAI bills n > 1."""
    prompt, completion = lasts[0].prompt_tokens, sum(d.completion_tokens for d in lasts)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": lasts[0].cached_prompt_tokens}}
    if all(d.response_cache_hit for d in lasts):  # pdserve's field: every choice replayed from the response cache
        usage["pdserve_response_cache_hit"] = True
    return usage


def _asks_logprobs(body: RequestBody) -> bool:
    return bool(body.logprobs) if isinstance(body, ChatRequest) else body.logprobs is not None


class _Logprobs:
    """Engine logprobs (token ids) -> OpenAI's shapes. Chat: `{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}`; completions: `{tokens, token_logprobs,
    top_logprobs: [{token: logprob}] (the top k and the sampled token), text_offset}`. Offsets
    count the tokens' text from the start of the completion, across a stream's chunks."""

    def __init__(self, tokenizer, chat: bool):
        self.tok = tokenizer
        self.chat = chat
        self.offset = 0

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self.tok.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def shape(self, logprobs, echoed: Delta | None = None) -> dict | None:
        """`echoed` (completions with echo): the first delta, whose prompt logprobs come first."""
        if self.chat:
            return {"content": [{**self._entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if echoed is not None and echoed.prompt_token_ids:  # the first prompt token has no logprob: null
            text = self.tok.token_text(echoed.prompt_token_ids[0])
            for key, value in zip(out, (text, None, None, self.offset)):
                out[key].append(value)
            self.offset += len(text)
            logprobs = [*echoed.prompt_logprobs[1:], *logprobs]
        for lp in logprobs:
            text = self.tok.token_text(lp.token_id)
            top = {self.tok.token_text(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


async def _sse(choices: list[Choice], rid, created, model, chat: bool, include_usage: bool,
               shapers: list["_Logprobs | None"], use: ToolUse = ToolUse(), echo: str | None = None):
    """Server-sent events: every choice's deltas as they come (each chunk names its choice's
    index; a choice's first chunk carries the role), then usage (if asked) and [DONE]. A failure
    of any choice ends the stream with an error event and stops the other choices. A forced tool
    call is held back and sent whole (its tool_calls delta, with the finish reason) once the
    grammar completed it. tool_choice "auto": text streams until a call opener may begin; from
    there it is held, and sent at the end as the calls or, if none parse, as content."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    held_text, held_lps = [""] * len(choices), [[] for _ in choices]
    autos = [ToolCallStream(use.parser, use.names, use.parallel) if chat and use.parser else None for _ in choices]

    def payload(i: int, body: dict, finish: str | None, logprobs, echoed: Delta | None = None) -> str:
        shaper = shapers[i]
        lp = None if shaper is None or not (logprobs or echoed) else shaper.shape(logprobs or [], echoed)
        choice = ({"index": i, "delta": body, "logprobs": lp, "finish_reason": finish} if chat
                  else {"index": i, "text": body["content"], "logprobs": lp, "finish_reason": finish})
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return f"data: {json.dumps(out)}\n\n"

    def chunk(i: int, d: Delta, role: bool = False) -> str | None:
        head = {"role": "assistant"} if role else {}
        if not (chat and use.active):
            if role and echo is not None:  # the first chunk: the prompt, then the first token's text
                return payload(i, {"content": echo + d.text}, d.finish_reason, d.logprobs, d)
            return payload(i, head | {"content": d.text}, d.finish_reason, d.logprobs)
        if autos[i] is not None:
            return auto_chunk(i, d, head)
        held_text[i] += d.text
        held_lps[i] += d.logprobs or ()
        if d.finish_reason is None:
            return payload(i, head | {"content": None}, None, None) if role else None
        calls, content, finish = _tool_result(use, held_text[i], d.finish_reason)
        body = head | ({"content": None, "tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                       if calls else {"content": content})
        return payload(i, body, finish, held_lps[i])

    def auto_chunk(i: int, d: Delta, head: dict) -> str | None:
        s = autos[i]
        text, lps = s.feed(d.text), d.logprobs
        if s.opened:  # a held token's logprobs go with what it becomes
            held_lps[i] += lps or ()
            lps = None
        if d.finish_reason is None:
            return payload(i, head | {"content": text}, None, lps) if text or head or lps else None
        rest, calls = s.finish(stopped=d.finish_reason == "stop")
        lps = held_lps[i] + list(lps or ())
        if calls:
            tool_calls = [{"index": k, **c} for k, c in enumerate(openai_tool_calls(calls))]
            return payload(i, head | {"content": text or None, "tool_calls": tool_calls}, "tool_calls", lps)
        return payload(i, head | {"content": text + rest}, d.finish_reason, lps)

    lasts = [first for _, first in choices]
    for i, first in enumerate(lasts):
        if (c := chunk(i, first, role=True)) is not None:
            yield c
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]):
        try:
            async for d in stream:
                await queue.put((i, d))
            await queue.put((i, None))
        except ServingError as e:
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, (s, _) in enumerate(choices)]
    failed = False
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, ServingError):
                failed = True
                yield f"data: {json.dumps({'error': {'message': item.message, 'type': 'server_error', 'code': item.code.grpc_name}})}\n\n"
                break
            else:
                lasts[i] = item
                if (c := chunk(i, item)) is not None:
                    yield c
    finally:  # also when the client goes away: every choice stops at its source
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close([s for s, _ in choices])
    if include_usage and not failed and all(d.finish_reason is not None for d in lasts):
        payload = {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": _usage(lasts)}
        yield f"data: {json.dumps(payload)}\n\n"
    yield "data: [DONE]\n\n"
