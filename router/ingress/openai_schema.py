"""The OpenAI request bodies (/v1/completions, /v1/chat/completions) as pydantic models, and what
a body becomes: its SamplingParams. Every field is implemented or refused with 400 naming it;
neutral values of unsupported fields are accepted (they never change the output)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError
from router.ingress.tool_parser import HermesToolParser, parser_for


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
# tool_use (forced calls by grammar; "auto" by the model's tool_call_parser, refused without one). Accepted but
# not implemented, at a value that changes nothing: best_of 1. Accepted and ignored (they
# never change the output): metadata. n: 1..IngressLimits.max_choices (checked in openai_api).
# prompt_cache_key (else user) is the request's session key for routing (router/ingress/session.py).
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


@dataclass(frozen=True)
class ToolUse:
    """How a chat request uses its tools. `forced`: the output is a tool call, enforced by a
    grammar (tool_choice "required": a JSON array of {name, parameters}; a named function: its
    arguments object). `parser`: tool_choice "auto", calls found in the free text by the model's
    parser (router/ingress/tool_parser.py). Neither: tools play no part (none given, or "none")."""

    forced: Literal["required", "named"] | None = None
    name: str | None = None  # the named function
    parser: HermesToolParser | None = None
    names: frozenset[str] = frozenset()  # the functions an "auto" call may name
    parallel: bool = True  # parallel_tool_calls: more than one call in one reply

    @property
    def active(self) -> bool:
        return self.forced is not None or self.parser is not None


def tool_use(req: RequestBody, parser: str = "none") -> ToolUse:
    """Checks tools, tool_choice and parallel_tool_calls together (400 naming the field).
    tool_choice "auto" (OpenAI's default when tools are given) needs a parser that finds tool
    calls in free text, in the model's own format (`parser`, the config's tool_call_parser):
    without one it is refused rather than answered as if the tools were not there."""
    if not isinstance(req, ChatRequest):
        return ToolUse()
    tools, choice = req.tools or [], req.tool_choice
    if choice is not None and not tools and choice != "none":
        raise InvalidRequestError("tool_choice", "needs tools")
    if req.parallel_tool_calls is not None and not tools:
        raise InvalidRequestError("parallel_tool_calls", "needs tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools", "two tools have the same function name")
    if not tools or choice == "none":
        return ToolUse()
    if choice is None or choice == "auto":
        if parser == "none":
            raise InvalidRequestError("tool_choice", "'auto' (the default with tools) needs a tool-call parser for "
                                                     "this model, and none is configured (tool_call_parser): give "
                                                     "'required', 'none' or "
                                                     '{"type": "function", "function": {"name": ...}}')
        return ToolUse(parser=parser_for(parser), names=frozenset(names), parallel=req.parallel_tool_calls is not False)
    if req.response_format is not None and req.response_format.type != "text":
        raise InvalidRequestError("tool_choice", "a forced tool call cannot be combined with response_format")
    if choice == "required":
        return ToolUse("required")
    if choice.function.name not in names:
        raise InvalidRequestError("tool_choice", f"names function {choice.function.name!r}, which is not in tools")
    return ToolUse("named", choice.function.name)


def tool_schema(req: "ChatRequest", use: ToolUse) -> tuple[dict, bool]:
    """The JSON schema a forced tool call's output must match, and whether it is strict."""
    by_name = {t.function.name: t.function for t in req.tools or []}
    if use.forced == "named":
        f = by_name[use.name]
        return (f.parameters if f.parameters is not None else {"type": "object"}), bool(f.strict)
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"enum": [name]},
                             "parameters": f.parameters if f.parameters is not None else {"type": "object"}}}
             for name, f in by_name.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema, any(bool(f.strict) for f in by_name.values())


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


def to_sampling_params(req: RequestBody, default_max_tokens: int, validator,
                       defaults: dict | None = None, use: ToolUse | None = None) -> SamplingParams:
    """`defaults`: the model's sampling defaults (RequestFlow.sampling_defaults) for unset fields;
    `use`: the request's tool_use (default: checked here, with no tool-call parser)."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    kw: dict[str, Any] = {**(defaults or {}), "max_tokens": default_max_tokens if max_tokens is None else max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    use = tool_use(req) if use is None else use
    if use.forced is not None:  # the call is enforced like a json_schema response_format (its caps, its compiling)
        if req.ignore_eos:
            raise InvalidRequestError("tool_choice", "a forced tool call cannot be combined with ignore_eos")
        schema, strict = tool_schema(req, use)
        fmt = validator.response_format("json_schema", schema, strict)
    else:
        fmt = _response_format(req.response_format, validator)
    return SamplingParams(**kw, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                          ignore_eos=req.ignore_eos, logit_bias=_logit_bias(req.logit_bias, validator),
                          logprobs=(k := _logprobs_k(req, validator.limits.max_logprobs)), response_format=fmt,
                          prompt_logprobs=k if isinstance(req, CompletionRequest) and req.echo else None)


def _response_format(spec: "ResponseFormatSpec | None", validator):
    """None for free text; the schema's caps are checked here, its compiling by the validator
    (in the flow's executor, off the event loop)."""
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return validator.response_format("json_object")
    if spec.json_schema is None or spec.json_schema.schema_ is None:
        raise InvalidRequestError("response_format", "type json_schema needs json_schema: {name, schema}")
    return validator.response_format("json_schema", spec.json_schema.schema_, bool(spec.json_schema.strict))


def _logit_bias(raw: dict | None, validator) -> dict[int, Any]:
    """OpenAI's logit_bias (keys are token ids as strings): the entry count is checked before
    any entry is looked at; SamplingParams and the validator check the biases and ids."""
    if not raw:
        return {}
    validator.check_logit_bias_size(len(raw))
    out = {}
    for key, bias in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise InvalidRequestError("logit_bias", f"key {key[:32]!r} is not a token id (a non-negative integer)")
        out[int(key)] = bias
    return out


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
