"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions (with SSE), and
the probes /health, /version, /metrics. A body becomes a ClientRequest here, the front door
serves it, and openai_responses.py shapes its Reply.

The routes are module-level: Serve ships the ingress class to its replica by value, and the app
with it by reference, so the replica's FrontDoor is bound to this module when the ingress starts
(`bind`)."""

from __future__ import annotations

import hashlib
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import IngressLimits
from cluster.errors import InvalidRequestError
from router.ingress.api import probes
from router.ingress.api.headers import SESSION_HEADER, TIMEOUT_HEADER, parse_deadline, session_key
from router.ingress.api.openai_responses import error_response, respond, serving_error_response, with_version_header
from router.ingress.api.openai_schema import (ChatRequest, CompletionRequest, RequestBody, check_messages,
                                              sampling_spec, tools_spec)
from router.ingress.gateway.front_door import FrontDoor
from router.ingress.request import ClientRequest
from router.ingress.status import Code, ServingError

IDEMPOTENCY_HEADER = "idempotency-key"

_bound: list = []  # this replica's front door and its liveness (bind)
KEYED_PATHS = ("/v1/", "/version")  # what needs a key (when keys are configured); /health and /metrics do not


def bind(front_door: FrontDoor | None, liveness: probes.Liveness | None = None) -> None:
    """The front door the routes serve with (None: unbind, as tests do), and what /health answers
    from (default: the door's own probe, cached)."""
    _bound[:] = [] if front_door is None else [front_door, liveness or probes.door_liveness(front_door)]


def front_door() -> FrontDoor:
    return _bound[0]


def _limits() -> IngressLimits:
    return _bound[0].config.ingress_limits if _bound else IngressLimits()


class KeyFirst:
    """ASGI middleware: with keys configured, a call to a keyed path without a valid key is refused
    (401, counted) from its headers alone, before any of its body is received, so a caller without
    a key makes the ingress read nothing (BodyLimit, inside this, read the whole 4 MiB first)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _bound and scope["path"].startswith(KEYED_PATHS):
            door = front_door()
            header = dict(scope.get("headers") or []).get(b"authorization")
            try:
                door.admission.authenticate(None if header is None else header.decode("latin-1"))
            except ServingError as e:
                door.refused(e)
                return await serving_error_response(e)(scope, receive, send)
        return await self.app(scope, receive, send)


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


app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)  # no schema served: 404
app.add_middleware(BodyLimit)
app.add_middleware(KeyFirst)  # added last: the outermost, so a key is checked before BodyLimit reads


@app.exception_handler(RequestValidationError)
async def _bad_body(request, exc: RequestValidationError):
    err = exc.errors()[0] if exc.errors() else {}
    if err.get("type") == "json_invalid":  # loc is ("body", <byte offset>)
        error = (err.get("ctx") or {}).get("error", "JSON decode error")
        _audit_bad_body(request, "body")
        return error_response(400, f"body: is not valid JSON ({error})", "body")
    field = ".".join(str(p) for p in err.get("loc", ())[1:]) or "body"
    _audit_bad_body(request, field)
    if err.get("type") == "extra_forbidden":
        return error_response(400, f"{field}: is not supported by this server", field)
    return error_response(400, f"{field}: {err.get('msg', 'invalid')}", field)


def _audit_bad_body(request: Request, field: str) -> None:
    """A body the schema refused leaves an audit record too (its caller's key passed KeyFirst)."""
    if not _bound:
        return
    door = front_door()
    try:
        tenant = door.admission.authenticate(request.headers.get("authorization"))
    except ServingError:
        return
    door.audit_refusal(InvalidRequestError(field, "refused by the body's schema"), tenant)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request, exc: StarletteHTTPException):
    """FastAPI's own refusals (an unparsable body, an unknown path or method) in the OpenAI shape."""
    param = "body" if exc.status_code == 400 else None
    message = f"body: {exc.detail}" if param else str(exc.detail)
    return error_response(exc.status_code, message, param, headers=getattr(exc, "headers", None))


def _fail(e: Exception) -> JSONResponse:
    if isinstance(e, InvalidRequestError):
        return error_response(400, str(e), e.field)
    if isinstance(e, ServingError):
        return serving_error_response(e)
    raise e


@app.get("/health")
async def health():
    """200 when a decode replica of every model version answers within a short bound, else 503."""
    door = front_door()
    if await _bound[1].live():
        models = door.model_info()
        return {"status": "serving", "model": models[0]["id"], "models": [m["id"] for m in models]}
    return error_response(503, "no live decode replica", None, Code.UNAVAILABLE.error_type, "unavailable")


@app.get("/version")
async def version(request: Request):
    """The caller's key as for /v1/models (with keys configured: the versions name canaries and
    models a caller without one must not learn), and what /v1/models lists to it."""
    try:
        tenant = front_door().authorize(request.headers.get("authorization"), None)
    except Exception as e:  # noqa: BLE001
        return _fail(e)
    return probes.version_info(front_door(), tenant)


@app.get("/metrics")
async def metrics():
    """This ingress's own gauges in Prometheus text (the pdserve_* catalogue is Ray's endpoint).
    No key, as vLLM's /metrics: a scraper has none; with auth on it names no tenant (threat model)."""
    return PlainTextResponse(probes.metrics_text(front_door()), media_type=probes.METRICS_CONTENT_TYPE)


@app.get("/v1/models")
async def models(request: Request):
    try:
        tenant = front_door().authorize(request.headers.get("authorization"), None)
    except Exception as e:  # noqa: BLE001
        return _fail(e)
    return {"object": "list", "data": [{"id": m["id"], "object": "model", "created": 0, "owned_by": "pdserve",
                                        "max_model_len": m["max_model_len"], "versions": m["versions"]}
                                       for m in front_door().model_info(tenant)]}


@app.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _serve(request, body, chat=False)


@app.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request):
    return await _serve(request, body, chat=True)


async def _serve(request: Request, body: RequestBody, chat: bool):
    """Authorize, serve, respond; a non-streaming request with an Idempotency-Key runs at most once."""
    try:
        door = front_door()
        tenant = door.authorize(request.headers.get("authorization"), body.model)
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is None or body.stream:
            return with_version_header(await _run(door, tenant, request, body, chat))
        fingerprint = hashlib.sha256(
            json.dumps([request.url.path, body.model_dump(mode="json")], sort_keys=True).encode()).hexdigest()
        result = await door.idempotent.run(tenant, key, fingerprint, lambda: _run(door, tenant, request, body, chat),
                                           succeeded=lambda r: isinstance(r, dict))
        return with_version_header(result)
    except Exception as e:  # noqa: BLE001
        return _fail(e)


async def _run(door: FrontDoor, tenant: str, request: Request, body: RequestBody, chat: bool):
    try:
        client = client_request(door.config, tenant, request, body, chat)
    except InvalidRequestError as e:
        door.audit_refusal(e, tenant, body.model)
        return _fail(e)
    try:
        reply = await door.serve(client)
    except Exception as e:  # noqa: BLE001
        return _fail(e)
    echo = None
    if not chat and body.echo:
        echo = client.prompt if client.prompt is not None else reply.tokenizer.decode(list(client.prompt_token_ids))
    return await respond(reply, body, chat=chat, echo=echo)


def client_request(config, tenant: str, request: Request, body: RequestBody, chat: bool) -> ClientRequest:
    """A body and its headers as the front door takes them; messages rendered by the flow, after
    admission, off the event loop."""
    limits = config.ingress_limits
    deadline = parse_deadline(request.headers.get(TIMEOUT_HEADER), limits.max_timeout_header_chars)
    session = session_key(request.headers.get(SESSION_HEADER), body.prompt_cache_key, body.user,
                          limits.max_session_id_chars)
    prompt = ids = messages = tools = None
    if chat:
        if len(body.messages) > limits.max_chat_messages:
            raise InvalidRequestError("messages", f"has {len(body.messages)} messages; at most "
                                                  f"{limits.max_chat_messages} are accepted")
        check_messages(body.messages)
        messages = tuple(_message(m, i) for i, m in enumerate(body.messages))
        tools = tools_spec(body)
    else:
        prompt, ids = _completion_prompt(body)
    return ClientRequest(tenant, sampling_spec(body, config.engine.limits), body.model, prompt, ids, messages, tools,
                         body.n, deadline, session)


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


def _completion_prompt(body: CompletionRequest) -> tuple[str | None, tuple[int, ...] | None]:
    p = body.prompt
    if isinstance(p, str):
        return p, None
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return None, tuple(p)
    if isinstance(p, list) and len(p) == 1:
        return (p[0], None) if isinstance(p[0], str) else (None, tuple(p[0]))
    raise InvalidRequestError("prompt", "give one prompt: a string or a list of token ids (batches are not supported)")


def _message(m, index: int) -> dict:
    """A chat message as the template sees it (tool calls and their results as OpenAI sends them)."""
    out = {"role": m.role, "content": _text(m.content, index)}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out
