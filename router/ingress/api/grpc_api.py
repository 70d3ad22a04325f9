"""The gRPC edge: a GenerateRequest -> ClientRequest, the front door's Reply -> GenerateResponses,
an error -> a status. Generated code is imported here and in the CLI client only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from pydantic import ValidationError

from cluster.config import AppConfig
from cluster.engine.config import RequestLimits
from cluster.engine.outputs import FinishReason
from cluster.errors import InvalidRequestError
from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.api.choices import interleave, tool_result
from router.ingress.api.openai_schema import MAX_TOOLS, ChatMessage, ChatRequest, check_messages, tools_spec
from router.ingress.api.headers import SESSION_HEADER, TIMEOUT_HEADER, parse_deadline, session_key
from router.ingress.flow.tool_parser import ToolCallStream, openai_tool_calls
from router.ingress.flow.tools import ToolUse
from router.ingress.gateway.front_door import Reply
from router.ingress.request import ClientRequest, Delta, ResponseFormatSpec, SamplingSpec, ToolsSpec
from router.ingress.status import ServingError, code_of, retry_after_seconds

FINISH = {  # the finish reasons a client sees (deadline and rejected become status codes)
    None: pb.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR, FinishReason.CONTENT_FILTER: pb.FINISH_REASON_CONTENT_FILTER,
}


def request_from_proto(req: "pb.GenerateRequest", metadata: dict, tenant: str, config: AppConfig) -> ClientRequest:
    """A GenerateRequest as the front door takes it, its wire-level bounds checked here: the
    message's size, the counts and sizes that must be known before anything is parsed (the app's
    limits; the version's flow checks its own again)."""
    limits, engine_limits = config.ingress_limits, config.engine.limits
    size = req.ByteSize()  # the transport reads up to 4x this (grpc_server.py TRANSPORT_CAP_FACTOR)
    if size > limits.grpc_max_receive_bytes:
        raise InvalidRequestError("request", f"message of {size} bytes exceeds grpc_max_receive_bytes "
                                             f"{limits.grpc_max_receive_bytes}")
    deadline = parse_deadline(metadata.get(TIMEOUT_HEADER), limits.max_timeout_header_chars)
    session = session_key(metadata.get(SESSION_HEADER), None, None, limits.max_session_id_chars)
    prompt, ids, messages = prompt_from_proto(req, limits.max_chat_messages)
    engine_limits.check_counts(len(req.sampling.stop), len(req.sampling.stop_token_ids))
    sampling = sampling_from_proto(req.sampling, engine_limits)
    tools = None if messages is None else tools_from_proto(req.chat, req.sampling, engine_limits.max_schema_bytes)
    return ClientRequest(tenant, sampling, req.model or None, prompt, ids, messages, tools,
                         req.n if req.HasField("n") else 1, deadline, session, req.request_id or None)


def sampling_from_proto(sp: "pb.SamplingParams", limits: RequestLimits) -> SamplingSpec:
    kw = {name: getattr(sp, name) for name in SAMPLING_FIELDS if sp.HasField(name)}
    if sp.HasField("max_tokens") and sp.max_tokens == 0:
        raise InvalidRequestError("max_tokens", "must be >= 1, got 0")
    limits.check_logit_bias(len(sp.logit_bias))  # before the entries are looked at
    return SamplingSpec(
        **kw, stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        logit_bias=dict(sp.logit_bias) or None,
        response_format=_response_format(sp.response_format, limits) if sp.HasField("response_format") else None)


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_p", "logprobs", "prompt_logprobs")


def _response_format(rf: "pb.ResponseFormat", limits: RequestLimits) -> ResponseFormatSpec | None:
    if rf.type in ("", "text"):
        return None
    if rf.type != "json_schema":
        return ResponseFormatSpec(rf.type)
    cap = limits.max_schema_bytes
    n = len(rf.json_schema.encode())
    if n > cap:  # before parsing it
        raise InvalidRequestError("response_format", f"the JSON schema has {n} bytes; at most {cap} are accepted")
    try:
        schema = json.loads(rf.json_schema)
    except (ValueError, RecursionError):
        raise InvalidRequestError("response_format", "json_schema is not JSON text, or nests too deep") from None
    return ResponseFormatSpec("json_schema", schema, rf.strict)


def prompt_from_proto(req: "pb.GenerateRequest", max_chat_messages: int) -> tuple[
        str | None, tuple[int, ...] | None, tuple[dict, ...] | None]:
    """The request's prompt: text, token ids, or chat messages (which the flow renders with the
    model's template after admission, off the event loop, as it does for /v1/chat/completions)."""
    if req.priority:
        raise InvalidRequestError("priority", "is set by the tenant's configuration; leave it 0")
    which = req.WhichOneof("prompt")
    if which == "text":
        return req.text, None, None
    if which == "token_ids":
        return None, tuple(req.token_ids.ids), None
    if which == "chat":
        n = len(req.chat.messages)
        if n > max_chat_messages:
            raise InvalidRequestError("messages", f"has {n} messages; at most {max_chat_messages} are accepted")
        return None, None, tuple(_chat_messages(req.chat.messages))
    raise InvalidRequestError("prompt", "set text, token_ids or chat")


def _chat_messages(messages) -> list[dict]:
    """Chat messages as the template sees them, a call and its result in the history included,
    checked as /v1/chat/completions checks its messages (openai_schema.ChatMessage and
    check_messages: the same caps, errors naming messages.<i>.<field>)."""
    out, parsed = [], []
    for i, m in enumerate(messages):
        d = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        try:
            parsed.append(ChatMessage.model_validate(d))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"] if p != "function")
            raise InvalidRequestError(f"messages.{i}.{loc}", err["msg"]) from None
        out.append(d)
    check_messages(parsed)
    return out


def _token_logprob(lp) -> "pb.TokenLogprob":
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def delta_to_proto(d: Delta, index: int = 0, request_id: str | None = None,
                   cache_hit: bool = False) -> "pb.GenerateResponse":
    """`request_id`: the reply's label when n > 1 (every choice answers under one id)."""
    resp = pb.GenerateResponse(request_id=request_id or d.request_id, text=d.text, token_ids=d.token_ids,
                               finish_reason=FINISH[d.finish_reason], index=index)
    resp.logprobs.extend(_token_logprob(lp) for lp in d.logprobs or ())
    if d.prompt_logprobs:  # the first prompt token has none
        resp.prompt_logprobs.extend(_token_logprob(lp) for lp in d.prompt_logprobs[1:])
    if d.finish_reason is not None:
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
                                     cached_prompt_tokens=d.cached_prompt_tokens, response_cache_hit=cache_hit))
    return resp


async def responses(reply: Reply) -> AsyncIterator["pb.GenerateResponse"]:
    """Every choice's deltas as they come, each response naming its choice's index and the
    request's label; a choice's first response names the version that serves it."""
    label = reply.choices[0].first.request_id
    shapers = [ToolOutput(reply.use) if reply.use.active else None for _ in reply.choices]
    first: set[int] = set()
    async for i, d in interleave(reply.choices):
        resp = delta_to_proto(d, i, label, reply.choices[i].outcome.cache_hit)
        if shapers[i] is not None:
            resp = shapers[i].shape(resp, d.finish_reason)
        if i not in first:
            first.add(i)
            resp.model_version = reply.version
        yield resp


@dataclass(frozen=True)
class Status:
    """How a call ends: its gRPC code, the details, and the retry-after in whole seconds (or None)."""

    code: grpc.StatusCode
    details: str
    retry_after: int | None = None


def status_of(error: InvalidRequestError | ServingError) -> Status:
    """The status a refusal or failure ends its call with. A retry-after is also named in the
    details ("retry after N s", whole seconds like HTTP's Retry-After), for clients that read no
    trailing metadata."""
    details = str(error) if isinstance(error, InvalidRequestError) else error.message
    retry = getattr(error, "retry_after_s", None)
    seconds = None if retry is None else retry_after_seconds(retry)
    if seconds is not None:
        details = f"{details}; retry after {seconds} s"
    return Status(getattr(grpc.StatusCode, code_of(error).grpc_name), details, seconds)


def tools_from_proto(chat: "pb.Chat", sampling: "pb.SamplingParams", max_schema_bytes: int) -> ToolsSpec | None:
    """Chat.tools, tool_choice and parallel_tool_calls, checked as /v1/chat/completions' fields are
    (openai_schema.ChatRequest: the same caps and messages); None: no tool field is set. The count
    and each schema's size are checked before anything is parsed."""
    if not chat.tools and not chat.tool_choice and not chat.function_name and not chat.HasField("parallel_tool_calls"):
        return None
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"has {len(chat.tools)} tools; at most {MAX_TOOLS} are accepted")
    tools = []
    for i, t in enumerate(chat.tools):
        function = {"name": t.name, "strict": t.strict} | ({"description": t.description} if t.description else {})
        if t.parameters:
            if (size := len(t.parameters.encode())) > max_schema_bytes:
                raise InvalidRequestError(f"tools.{i}.parameters", f"has {size} bytes; at most {max_schema_bytes} "
                                                                   "are accepted")
            try:
                function["parameters"] = json.loads(t.parameters)
            except (ValueError, RecursionError):
                raise InvalidRequestError(f"tools.{i}.parameters", "is not JSON text, or nests too deep") from None
        tools.append({"type": "function", "function": function})
    if chat.tool_choice == "function":
        choice = {"type": "function", "function": {"name": chat.function_name}}
    elif chat.function_name:
        raise InvalidRequestError("function_name", 'goes with tool_choice "function" only')
    else:
        choice = chat.tool_choice or None
    body = {"messages": [{"role": "user"}], "tools": tools or None, "tool_choice": choice,
            "parallel_tool_calls": chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None,
            "response_format": ({"type": sampling.response_format.type or "text"}
                                if sampling.HasField("response_format") else None)}
    try:
        return tools_spec(ChatRequest.model_validate(body))
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"] if p != "function"]  # tools.0.function.name -> tools.0.name
        field = "tool_choice" if loc[:1] == ["tool_choice"] else ".".join(loc) or "chat"
        raise InvalidRequestError(field, err["msg"]) from None


class ToolOutput:
    """One choice's responses when it uses tools: text passes (auto: until a call may begin), a
    call is held and sent whole on the last response, whose finish reason is then TOOL_CALLS
    (as OpenAI's; a named function's call ends STOP). The same shaping as the OpenAI stream."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.auto = ToolCallStream(use.parser, use.names, use.parallel) if use.parser is not None else None
        self.held = ""

    def shape(self, resp: "pb.GenerateResponse", finish: FinishReason | None) -> "pb.GenerateResponse":
        if self.auto is not None:
            resp.text = self.auto.feed(resp.text)
            if finish is not None:
                rest, calls = self.auto.finish(stopped=finish == FinishReason.STOP)
                resp.text += rest
                self._calls(resp, openai_tool_calls(calls))
            return resp
        self.held += resp.text
        resp.text = ""
        if finish is not None:
            calls, content, reason = tool_result(self.use, self.held, finish.value)
            resp.text = content or ""
            self._calls(resp, calls or [], reason)
        return resp

    @staticmethod
    def _calls(resp, calls: list[dict], reason: str = "tool_calls") -> None:
        for c in calls:
            resp.tool_calls.add(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        if calls:
            resp.finish_reason = pb.FINISH_REASON_TOOL_CALLS if reason == "tool_calls" else pb.FINISH_REASON_STOP
