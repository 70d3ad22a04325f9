"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions (with SSE)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import IngressLimits
from cluster.errors import InvalidRequestError
from router.ingress import probes
from router.ingress.choices import start_choices
from router.ingress.openai_responses import error_response, respond, serving_error_response, with_version_header
from router.ingress.openai_schema import (ChatRequest, CompletionRequest, RequestBody, check_messages,
                                          to_sampling_params, tool_use)
from router.ingress.session import SESSION_HEADER, session_key
from router.ingress.status import Code, ServingError

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


# The replica's model catalog and idempotency runner. Reached through module-level functions (pickled by
# reference), because Serve ships the ingress class, and any closure in it, to the replica by value.
_replica: dict[str, Any] = {}


def bind_replica(catalog, idempotent) -> None:
    _replica["catalog"], _replica["idempotent"] = catalog, idempotent


def get_catalog():
    return _replica["catalog"]


def get_idempotent():
    return _replica["idempotent"]


def _limits() -> IngressLimits:
    catalog = _replica.get("catalog")
    return catalog.config.ingress_limits if catalog is not None else IngressLimits()


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
        """The model catalog and the caller's tenant; refuses an unknown key or model."""
        catalog = get_catalog()  # module-level: see bind_replica
        return catalog, catalog.authorize(request.headers.get("authorization"), model)

    def _fail(e: Exception) -> JSONResponse:
        if isinstance(e, InvalidRequestError):
            return error_response(400, str(e), e.field)
        if isinstance(e, ServingError):
            return serving_error_response(e)
        raise e

    async def _serve(request: Request, body: "RequestBody", chat: bool):
        """Admit, run, respond; a non-streaming request with an Idempotency-Key runs at most once."""
        try:
            catalog, tenant = _check(request, body.model)
            key = request.headers.get(IDEMPOTENCY_HEADER)
            if key is None or body.stream:
                return with_version_header(await _run(catalog, tenant, request, body, chat))
            fingerprint = hashlib.sha256(
                json.dumps([request.url.path, body.model_dump(mode="json")], sort_keys=True).encode()).hexdigest()
            result = await get_idempotent().run(
                tenant, key, fingerprint, lambda: _run(catalog, tenant, request, body, chat),
                succeeded=lambda r: isinstance(r, dict))
            return with_version_header(result)
        except Exception as e:  # noqa: BLE001
            return _fail(e)

    async def _run(catalog, tenant: str, request: Request, body: "RequestBody", chat: bool):
        try:
            limits = catalog.config.ingress_limits
            deadline = parse_deadline(request.headers.get(TIMEOUT_HEADER), limits.max_timeout_header_chars)
            session = session_key(request.headers.get(SESSION_HEADER), body.prompt_cache_key, body.user,
                                  limits.max_session_id_chars)
            routed = catalog.select(body.model, tenant, session)
            flow = routed.flow
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
                choices = await start_choices(routed.for_choices(body.n), body.n, prompt, ids, sp, tenant, deadline, messages, tools,
                                               session)
            except InvalidRequestError as e:
                if use.forced is not None and e.field == "response_format":  # the tools' grammar: name what the client sent
                    raise InvalidRequestError("tools", e.message) from e
                raise
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        echo = None if chat or not body.echo else prompt if prompt is not None else flow.tokenizer.decode(ids)
        return await respond(flow, body, choices, chat=chat, use=use, echo=echo)

    @app.get("/health")
    async def health():
        """200 when a decode replica of every model version answers within a short bound, else 503."""
        catalog = get_catalog()
        if await probes.all_live(catalog):
            return {"status": "serving", "model": catalog.default.config.model_name,
                    "models": [m["id"] for m in catalog.model_info()]}
        return error_response(503, "no live decode replica", None, Code.UNAVAILABLE.error_type, "unavailable")

    @app.get("/version")
    async def version():
        return probes.version_info(get_catalog())

    @app.get("/metrics")
    async def metrics(request: Request):
        """This ingress's own gauges in Prometheus text (the pdserve_* catalogue is Ray's endpoint).
        Needs an API key when auth is on: it names tenants."""
        try:
            catalog, _ = _check(request, None)
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        return PlainTextResponse(probes.metrics_text(catalog), media_type=probes.METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            catalog, _ = _check(request, None)
        except Exception as e:  # noqa: BLE001
            return _fail(e)
        return {"object": "list", "data": [{"id": m["id"], "object": "model", "created": 0, "owned_by": "pdserve",
                                            "max_model_len": m["max_model_len"], "versions": m["versions"]}
                                           for m in catalog.model_info()]}

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


def _message(m, index: int) -> dict:
    """A chat message as the template sees it (tool calls and their results as OpenAI sends them)."""
    out = {"role": m.role, "content": _text(m.content, index)}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out

