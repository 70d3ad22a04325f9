"""The OpenAI request bodies (/v1/completions, /v1/chat/completions) as pydantic models, and what a
body's fields become for the front door: a SamplingSpec and a ToolsSpec (router/ingress/request.py).
Every field is implemented or refused with 400 naming it; neutral values of unsupported fields
are accepted (they never change the output)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from cluster.engine.config import RequestLimits
from cluster.errors import InvalidRequestError
from router.ingress.request import FunctionTool, SamplingSpec, ToolsSpec
from router.ingress.request import ResponseFormatSpec as RawResponseFormat


def _not_bool(value):
    if isinstance(value, bool):  # pydantic would take true as 1
        raise ValueError("a boolean is not a number")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


def _neutral(*allowed):
    """A field we do not implement, accepted only at the value that changes nothing."""
    def check(value):
        if value not in allowed:
            raise ValueError(f"is not supported (only {' or '.join(map(json.dumps, allowed))} is accepted)")
        return value
    return AfterValidator(check)


# Fields outside these models are refused (400 naming the field: `extra="forbid"`). Tools: see
# flow/tools.py (forced calls by grammar; "auto" by the model's tool_call_parser, refused without one). Accepted but
# not implemented, at a value that changes nothing: best_of 1. Accepted and ignored (they
# never change the output): metadata. n: 1..IngressLimits.max_choices (checked in openai_api).
# prompt_cache_key (else user) is the request's session key for routing (router/ingress/api/headers.py).
# README: "OpenAI fields".
COMPLETIONS_MAX_LOGPROBS = 5  # OpenAI's bound on /v1/completions `logprobs` (chat: RequestLimits.max_logprobs)
class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    user: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = None  # its cap (IngressLimits.max_session_id_chars) is checked by the edge
    metadata: dict[str, str] | None = Field(None, max_length=16)
    n: Int = 1
    best_of: Annotated[Int | None, _neutral(None, 1)] = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None  # vLLM's extension
    min_p: Float | None = None  # vLLM's extension
    # Token id (a decimal string, as JSON keys are) -> bias; checked by _logit_bias, count first.
    logit_bias: dict | None = None
    response_format: "ResponseFormatSpec | None" = None


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = Field(None, max_length=4096)
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatSpec(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema ({name, schema, strict})."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(RequestBody):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's logprobs too)
    logprobs: Int | None = None  # top logprobs per token, 0..5 (and the sampled token's)


MAX_TOOLS = 128  # tools per request (their schemas together also meet engine.limits.max_schema_bytes)
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = Field(None, max_length=4096)
    parameters: dict | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=TOOL_NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=TOOL_NAME)
    arguments: str


class ToolCall(BaseModel):
    """A call in the history (an assistant message's tool_calls)."""
    model_config = ConfigDict(extra="forbid")
    id: str = Field(max_length=64)
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant messages only
    tool_call_id: str | None = Field(None, max_length=64)  # tool messages only (and required there)


class ChatRequest(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: Int | None = None  # 0..max_logprobs, with logprobs true
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


def check_messages(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise InvalidRequestError(f"messages.{i}.tool_calls", "only an assistant message has tool_calls")
        if m.role == "tool" and m.tool_call_id is None:
            raise InvalidRequestError(f"messages.{i}.tool_call_id", "a tool message needs the id of the call it answers")
        if m.tool_call_id is not None and m.role != "tool":
            raise InvalidRequestError(f"messages.{i}.tool_call_id", "only a tool message has a tool_call_id")


ResponseFormatSpec.model_rebuild()
RequestBody.model_rebuild()
CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()


def tools_spec(req: ChatRequest) -> ToolsSpec | None:
    """A chat body's tool fields as the front door takes them (None: none is set)."""
    if req.tools is None and req.tool_choice is None and req.parallel_tool_calls is None:
        return None
    functions = tuple(FunctionTool(t.function.name, t.function.description, t.function.parameters, t.function.strict)
                      for t in req.tools or ())
    named = isinstance(req.tool_choice, NamedToolChoice)
    return ToolsSpec(functions, "function" if named else req.tool_choice,
                     req.tool_choice.function.name if named else None, req.parallel_tool_calls)


def sampling_spec(req: RequestBody, limits: RequestLimits) -> SamplingSpec:
    """A body's sampling fields, unset ones left None (the version's defaults fill them)."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    limits.check_counts(len(stop), len(req.stop_token_ids or ()))
    if req.logit_bias:
        limits.check_logit_bias(len(req.logit_bias))
    k = _logprobs_k(req, limits.max_logprobs)
    return SamplingSpec(
        max_tokens=max_tokens, **{name: getattr(req, name) for name in SamplingSpec.OVERRIDABLE},
        logprobs=k, prompt_logprobs=k if isinstance(req, CompletionRequest) and req.echo else None, stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, logit_bias=req.logit_bias or None,
        response_format=_response_format(req.response_format))


def _response_format(spec: "ResponseFormatSpec | None") -> RawResponseFormat | None:
    if spec is None or spec.type == "text":
        return None
    schema = None if spec.json_schema is None else spec.json_schema.schema_
    return RawResponseFormat(spec.type, schema, bool(spec.json_schema and spec.json_schema.strict))


def _logprobs_k(req: RequestBody, max_logprobs: int) -> int | None:
    """How many top logprobs per token the request asks for; None when it asks for none."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise InvalidRequestError("top_logprobs", "needs logprobs: true")
            if not 0 <= req.top_logprobs <= max_logprobs:
                raise InvalidRequestError("top_logprobs", f"must be in [0, {max_logprobs}], got {req.top_logprobs}")
        return (req.top_logprobs or 0) if req.logprobs else None
    k = req.logprobs
    cap = min(COMPLETIONS_MAX_LOGPROBS, max_logprobs)
    if k is not None and not 0 <= k <= cap:
        raise InvalidRequestError("logprobs", f"must be in [0, {cap}], got {k}")
    return k
