"""OpenAI's response shapes: a completion or chat completion from a request's choices, whole or
as server-sent events, its usage and logprobs, and the error body."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi.responses import JSONResponse, StreamingResponse

from router.ingress.api.choices import collect, interleave, tool_result
from router.ingress.api.openai_schema import ChatRequest, RequestBody
from router.ingress.flow.tool_parser import ToolCallStream, openai_tool_calls
from router.ingress.flow.tools import ToolUse
from router.ingress.gateway.front_door import Choice, Reply, close_streams
from router.ingress.request import Delta
from router.ingress.status import Code, ServingError, retry_after_seconds


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


async def respond(reply: Reply, body: RequestBody, chat: bool, echo: str | None = None):
    """`echo` (completions): the prompt's text, put before each choice's completion (and, with
    logprobs, the prompt's logprobs before the completion's, the first token's null, as OpenAI)."""
    choices, use = reply.choices, reply.use
    rid = ("chatcmpl-" if chat else "cmpl-") + choices[0].first.request_id
    created = int(time.time())
    # the model, and the version that served (OpenAI's system_fingerprint: the backend configuration)
    model = {"model": reply.model} | ({"system_fingerprint": reply.version} if reply.version else {})
    shapers = [Logprobs(reply.tokenizer, chat) if asks_logprobs(body) else None for _ in choices]
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(sse(choices, rid, created, model, chat, include_usage, shapers, use, echo),
                                 media_type="text/event-stream", headers=version_header(reply.version))
    tasks = [asyncio.ensure_future(collect(c.stream, c.first)) for c in choices]
    try:
        results = await asyncio.gather(*tasks)
    except ServingError as e:
        return serving_error_response(e)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_streams([c.stream for c in choices])
    out = []
    for i, ((text, last, logprobs), shaper, c) in enumerate(zip(results, shapers, choices)):
        if not chat:
            lp = None if shaper is None else shaper.shape(logprobs, c.first if echo is not None else None)
            out.append({"index": i, "text": (echo or "") + text, "logprobs": lp, "finish_reason": last.finish_reason})
            continue
        lp = None if shaper is None else shaper.shape(logprobs)
        calls, content, finish = tool_result(use, text, last.finish_reason) if use.active else (
            None, text, last.finish_reason)
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            **model, "choices": out, "usage": usage([last for _, last, _ in results], choices)}


VERSION_HEADER = "x-pdserve-model-version"


def version_header(version: str) -> dict[str, str]:
    return {VERSION_HEADER: version} if version else {}


def with_version_header(result):
    """A whole response (a dict) as JSON, with the version header when it names one."""
    if isinstance(result, dict) and "system_fingerprint" in result:
        return JSONResponse(result, headers={VERSION_HEADER: result["system_fingerprint"]})
    return result


def usage(lasts: list[Delta], choices: list[Choice]) -> dict:
    """The prompt once (every choice has the same), the completions summed, as OpenAI bills n > 1."""
    prompt, completion = lasts[0].prompt_tokens, sum(d.completion_tokens for d in lasts)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": lasts[0].cached_prompt_tokens}}
    if all(c.outcome.cache_hit for c in choices):  # pdserve's field: every choice replayed from the response cache
        usage["pdserve_response_cache_hit"] = True
    return usage


def asks_logprobs(body: RequestBody) -> bool:
    return bool(body.logprobs) if isinstance(body, ChatRequest) else body.logprobs is not None


class Logprobs:
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


class _Chunks:
    """One streamed reply's server-sent events, choice by choice. A forced tool call is held back
    and sent whole (its tool_calls delta, with the finish reason) once the grammar completed it.
    tool_choice "auto": text streams until a call opener may begin; from there it is held, and sent
    at the end as the calls or, if none parse, as content."""

    def __init__(self, n: int, rid: str, created: int, model: dict, chat: bool, include_usage: bool,
                 shapers: list["Logprobs | None"], use: ToolUse, echo: str | None):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.include_usage, self.shapers, self.use, self.echo = include_usage, shapers, use, echo
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.held_text, self.held_lps = [""] * n, [[] for _ in range(n)]
        self.autos = [ToolCallStream(use.parser, use.names, use.parallel) if chat and use.parser else None
                      for _ in range(n)]

    def payload(self, i: int, body: dict, finish: str | None, logprobs, echoed: Delta | None = None) -> str:
        shaper = self.shapers[i]
        lp = None if shaper is None or not (logprobs or echoed) else shaper.shape(logprobs or [], echoed)
        choice = ({"index": i, "delta": body, "logprobs": lp, "finish_reason": finish} if self.chat
                  else {"index": i, "text": body["content"], "logprobs": lp, "finish_reason": finish})
        out = {"id": self.rid, "object": self.obj, "created": self.created, **self.model, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return f"data: {json.dumps(out)}\n\n"

    def chunk(self, i: int, d: Delta, role: bool = False) -> str | None:
        head = {"role": "assistant"} if role else {}
        if not (self.chat and self.use.active):
            if role and self.echo is not None:  # the first chunk: the prompt, then the first token's text
                return self.payload(i, {"content": self.echo + d.text}, d.finish_reason, d.logprobs, d)
            return self.payload(i, head | {"content": d.text}, d.finish_reason, d.logprobs)
        if self.autos[i] is not None:
            return self.auto_chunk(i, d, head)
        self.held_text[i] += d.text
        self.held_lps[i] += d.logprobs or ()
        if d.finish_reason is None:
            return self.payload(i, head | {"content": None}, None, None) if role else None
        calls, content, finish = tool_result(self.use, self.held_text[i], d.finish_reason)
        body = head | ({"content": None, "tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                       if calls else {"content": content})
        return self.payload(i, body, finish, self.held_lps[i])

    def auto_chunk(self, i: int, d: Delta, head: dict) -> str | None:
        s = self.autos[i]
        text, lps = s.feed(d.text), d.logprobs
        if s.opened:  # a held token's logprobs go with what it becomes
            self.held_lps[i] += lps or ()
            lps = None
        if d.finish_reason is None:
            return self.payload(i, head | {"content": text}, None, lps) if text or head or lps else None
        rest, calls = s.finish(stopped=d.finish_reason == "stop")
        lps = self.held_lps[i] + list(lps or ())
        if calls:
            tool_calls = [{"index": k, **c} for k, c in enumerate(openai_tool_calls(calls))]
            return self.payload(i, head | {"content": text or None, "tool_calls": tool_calls}, "tool_calls", lps)
        return self.payload(i, head | {"content": text + rest}, d.finish_reason, lps)

    def usage(self, lasts: list[Delta], choices: list[Choice]) -> str:
        last = {"id": self.rid, "object": self.obj, "created": self.created, **self.model, "choices": [],
                "usage": usage(lasts, choices)}
        return f"data: {json.dumps(last)}\n\n"


async def sse(choices: list[Choice], rid, created, model: dict, chat: bool, include_usage: bool,
              shapers: list["Logprobs | None"], use: ToolUse = ToolUse(), echo: str | None = None):
    """Server-sent events: every choice's deltas as they come (each chunk names its choice's
    index; a choice's first chunk carries the role), then usage (if asked) and [DONE]. A failure
    of any choice ends the stream with an error event and stops the other choices."""
    chunks = _Chunks(len(choices), rid, created, model, chat, include_usage, shapers, use, echo)
    lasts = [c.first for c in choices]
    failed = False
    try:  # closing this generator (the client went away) stops every choice at its source
        async for i, d in interleave(choices):
            lasts[i] = d
            if (c := chunks.chunk(i, d, role=d is choices[i].first)) is not None:
                yield c
    except ServingError as e:
        failed = True
        yield f"data: {json.dumps({'error': {'message': e.message, 'type': 'server_error', 'code': e.code.grpc_name}})}\n\n"
    if include_usage and not failed and all(d.finish_reason is not None for d in lasts):
        yield chunks.usage(lasts, choices)
    yield "data: [DONE]\n\n"
