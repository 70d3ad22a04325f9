"""The OpenAI request bodies (/v1/completions, /v1/chat/completions) as pydantic models, and what
a body becomes: its SamplingParams. Every field is implemented or refused with 400 naming it;
neutral values of unsupported fields are accepted (they never change the output)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError


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


# Fields outside these models are refused (400 naming the field: `extra="forbid"`). Accepted but
# not implemented, at a value that changes nothing: n 1, best_of 1, echo false. Accepted and ignored (they never change the output):
# metadata. prompt_cache_key (else user) is the request's session key for routing (router/ingress/session.py).
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
    n: Annotated[Int, _neutral(1)] = 1
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
    echo: Annotated[bool, _neutral(False)] = False
    logprobs: Int | None = None  # top logprobs per token, 0..5 (and the sampled token's)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict] | None = None


class ChatRequest(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: Int | None = None  # 0..max_logprobs, with logprobs true


ResponseFormatSpec.model_rebuild()
RequestBody.model_rebuild()
CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()


def to_sampling_params(req: RequestBody, default_max_tokens: int, validator,
                       defaults: dict | None = None) -> SamplingParams:
    """`defaults`: the model's sampling defaults (RequestFlow.sampling_defaults) for unset fields."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    kw: dict[str, Any] = {**(defaults or {}), "max_tokens": default_max_tokens if max_tokens is None else max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(**kw, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                          ignore_eos=req.ignore_eos, logit_bias=_logit_bias(req.logit_bias, validator),
                          logprobs=_logprobs_k(req, validator.limits.max_logprobs),
                          response_format=_response_format(req.response_format, validator))


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
