"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions (with SSE)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import IngressLimits
from cluster.errors import InvalidRequestError
from router.ingress import probes
from router.ingress.flow import Delta
from router.ingress.session import SESSION_HEADER, session_key
from router.ingress.openai_schema import ChatRequest, CompletionRequest, RequestBody, to_sampling_params
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
    return error_response(e.code.http_status, e.message, None, e.code.error_type,
                          "model_not_found" if e.code is Code.NOT_FOUND else e.code.grpc_name.lower(),
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
            messages = None
            if chat:  # rendered and tokenized by the flow, after admission, off the event loop
                if len(body.messages) > limits.max_chat_messages:
                    raise InvalidRequestError("messages", f"has {len(body.messages)} messages; at most "
                                                          f"{limits.max_chat_messages} are accepted")
                messages = [{"role": m.role, "content": _text(m.content, i)} for i, m in enumerate(body.messages)]
                prompt, ids = None, None
            else:
                prompt, ids = _completion_prompt(body)
            stop = body.stop if isinstance(body.stop, list) else ()
            flow.config.engine.limits.check_counts(len(stop), len(body.stop_token_ids or ()))
            sp = to_sampling_params(body, flow.config.default_max_tokens, flow.validator, flow.sampling_defaults)
            stream = flow.generate(prompt, ids, sp, tenant=tenant, deadline=deadline, messages=messages,
                                   session=session)
            first = await anext(stream)  # bad input, refusals and early failures become HTTP errors here
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        return await _respond(flow, body, stream, first, chat=chat)

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


async def _respond(flow, body: RequestBody, stream: AsyncIterator[Delta], first: Delta, chat: bool):
    rid = ("chatcmpl-" if chat else "cmpl-") + first.request_id
    created = int(time.time())
    model = flow.config.model_name
    shaper = _Logprobs(flow.tokenizer, chat) if _asks_logprobs(body) else None
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(stream, first, rid, created, model, chat, include_usage, shaper),
                                 media_type="text/event-stream")
    text, last, logprobs = first.text, first, list(first.logprobs or ())
    try:
        async for d in stream:
            text += d.text
            last = d
            logprobs += d.logprobs or ()
    except ServingError as e:
        return serving_error_response(e)
    usage = _usage(last)
    lp = None if shaper is None else shaper.shape(logprobs)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
               "finish_reason": last.finish_reason}
              if chat else {"index": 0, "text": text, "logprobs": lp, "finish_reason": last.finish_reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage}


def _usage(d: Delta) -> dict:
    return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": d.cached_prompt_tokens}}


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

    def shape(self, logprobs) -> dict | None:
        if self.chat:
            return {"content": [{**self._entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
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


async def _sse(stream, first: Delta, rid, created, model, chat: bool, include_usage: bool,
               shaper: "_Logprobs | None" = None):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(d: Delta, role: bool = False) -> str:
        lp = None if shaper is None or not d.logprobs else shaper.shape(d.logprobs)
        if chat:
            delta = {"role": "assistant", "content": d.text} if role else {"content": d.text}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        else:
            choice = {"index": 0, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        payload = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload)}\n\n"

    last = first
    yield chunk(first, role=True)
    try:
        async for d in stream:
            last = d
            yield chunk(d)
    except ServingError as e:
        yield f"data: {json.dumps({'error': {'message': e.message, 'type': 'server_error', 'code': e.code.grpc_name}})}\n\n"
    if include_usage and last.finish_reason is not None:
        payload = {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": _usage(last)}
        yield f"data: {json.dumps(payload)}\n\n"
    yield "data: [DONE]\n\n"
