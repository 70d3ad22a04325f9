"""The gRPC edge: converts between protos and the request flow. Generated code is imported here
and in the CLI client only."""

from __future__ import annotations

import json
from dataclasses import replace

import grpc
from pydantic import ValidationError

from cluster.engine.outputs import FinishReason
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.validation import RequestValidator
from cluster.errors import InvalidRequestError
from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.flow import Delta
from router.ingress.choices import tool_result
from router.ingress.openai_schema import MAX_TOOLS, ChatMessage, ChatRequest, ToolUse, check_messages, tool_schema
from router.ingress.tool_parser import ToolCallStream, openai_tool_calls
from router.ingress.status import Code, ServingError, retry_after_seconds

FINISH = {  # the finish reasons a client sees (deadline and rejected become status codes)
    None: pb.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR, FinishReason.CONTENT_FILTER: pb.FINISH_REASON_CONTENT_FILTER,
}


def sampling_from_proto(sp: "pb.SamplingParams", default_max_tokens: int, validator: RequestValidator,
                        defaults: dict | None = None) -> SamplingParams:
    """`defaults`: the model's sampling defaults (RequestFlow.sampling_defaults) for unset fields."""
    kw = {**(defaults or {}), "max_tokens": sp.max_tokens if sp.HasField("max_tokens") else default_max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p", "logprobs", "prompt_logprobs"):
        if sp.HasField(name):
            kw[name] = getattr(sp, name)
    if sp.HasField("max_tokens") and sp.max_tokens == 0:
        raise InvalidRequestError("max_tokens", "must be >= 1, got 0")
    validator.check_logit_bias_size(len(sp.logit_bias))  # before the entries are looked at
    return SamplingParams(
        **kw, stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        logit_bias=dict(sp.logit_bias),
        response_format=_response_format(sp.response_format, validator) if sp.HasField("response_format") else None,
    )


def _response_format(rf: "pb.ResponseFormat", validator: RequestValidator):
    if rf.type in ("", "text"):
        return None
    if rf.type != "json_schema":
        return validator.response_format(rf.type)
    cap = validator.limits.max_schema_bytes
    n = len(rf.json_schema.encode())
    if n > cap:  # before parsing it
        raise InvalidRequestError("response_format", f"the JSON schema has {n} bytes; at most {cap} are accepted")
    try:
        schema = json.loads(rf.json_schema)
    except (ValueError, RecursionError):
        raise InvalidRequestError("response_format", "json_schema is not JSON text, or nests too deep") from None
    return validator.response_format("json_schema", schema, rf.strict)


def prompt_from_proto(req: "pb.GenerateRequest", max_chat_messages: int) -> tuple[
        str | None, list[int] | None, list[dict] | None]:
    """The request's prompt: text, token ids, or chat messages (which the flow renders with the
    model's template after admission, off the event loop, as it does for /v1/chat/completions)."""
    if req.priority:
        raise InvalidRequestError("priority", "is set by the tenant's configuration; leave it 0")
    which = req.WhichOneof("prompt")
    if which == "text":
        return req.text, None, None
    if which == "token_ids":
        return None, list(req.token_ids.ids), None
    if which == "chat":
        n = len(req.chat.messages)
        if n > max_chat_messages:
            raise InvalidRequestError("messages", f"has {n} messages; at most {max_chat_messages} are accepted")
        return None, None, _chat_messages(req.chat.messages)
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


def delta_to_proto(d: Delta, index: int = 0, request_id: str | None = None) -> "pb.GenerateResponse":
    """`request_id`: the reply's label when n > 1 (every choice answers under one id)."""
    resp = pb.GenerateResponse(request_id=request_id or d.request_id, text=d.text, token_ids=d.token_ids,
                               finish_reason=FINISH[d.finish_reason], index=index)
    resp.logprobs.extend(_token_logprob(lp) for lp in d.logprobs or ())
    if d.prompt_logprobs:  # the first prompt token has none
        resp.prompt_logprobs.extend(_token_logprob(lp) for lp in d.prompt_logprobs[1:])
    if d.finish_reason is not None:
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
                                     cached_prompt_tokens=d.cached_prompt_tokens,
                                     response_cache_hit=d.response_cache_hit))
    return resp


class GrpcAbort(Exception):
    """Raised after setting the code on Serve's gRPC context: Serve keeps a code set before a raise.
    `grpc_code` lets the ingress's log filter tell a client's fault from a server error."""

    def __init__(self, details: str, grpc_code: grpc.StatusCode | None = None):
        super().__init__(details)
        self.grpc_code = grpc_code


def fail(grpc_context, error: InvalidRequestError | ServingError) -> GrpcAbort:
    """Set the error's status on Serve's context, for the caller to raise. A retry-after goes in
    the details ("retry after N s", whole seconds like HTTP's Retry-After): Serve's gRPC proxy
    drops trailing metadata on the error path."""
    if isinstance(error, InvalidRequestError):
        code, details, retry = Code.INVALID_ARGUMENT, str(error), None
    else:
        code, details, retry = error.code, error.message, error.retry_after_s
    if retry is not None:
        details = f"{details}; retry after {retry_after_seconds(retry)} s"
    status = getattr(grpc.StatusCode, code.grpc_name)
    grpc_context.set_code(status)
    grpc_context.set_details(details)
    return GrpcAbort(details, status)


def chat_tools_from_proto(chat: "pb.Chat", sampling: "pb.SamplingParams", max_schema_bytes: int) -> ChatRequest | None:
    """Chat.tools, tool_choice and parallel_tool_calls as /v1/chat/completions' fields, so both
    edges check them with one code (openai_schema.tool_use) and the same limits; None: no tool
    field is set. The count and each schema's size are checked before anything is parsed."""
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
        return ChatRequest.model_validate(body)
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


def with_tools(sp: SamplingParams, req: ChatRequest, use: ToolUse, validator: RequestValidator) -> SamplingParams:
    """A forced call's grammar as the request's response_format (as to_sampling_params does)."""
    if use.forced is None:
        return sp
    if sp.ignore_eos:
        raise InvalidRequestError("tool_choice", "a forced tool call cannot be combined with ignore_eos")
    try:
        return replace(sp, response_format=validator.response_format("json_schema", *tool_schema(req, use)))
    except InvalidRequestError as e:
        raise InvalidRequestError("tools", e.message) from e


def shaped(shaper: "ToolOutput | None", resp: "pb.GenerateResponse", d: Delta) -> "pb.GenerateResponse":
    return resp if shaper is None else shaper.shape(resp, d.finish_reason)
