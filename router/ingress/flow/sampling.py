"""A client's sampling fields in one version's terms: its defaults for what the client left
unset, its validator's limits, and a forced tool call's grammar (compiled by the validator in the
flow's executor, off the event loop). Both edges reach this through the front door, once per
request, after its version is chosen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.engine.sampling_params import SamplingParams
from cluster.engine.validation import RequestValidator
from cluster.errors import InvalidRequestError
from router.ingress.flow.tools import ToolUse, tool_schema, tool_use
from router.ingress.request import ResponseFormatSpec, SamplingSpec, ToolsSpec


@dataclass(frozen=True)
class Sampling:
    """A request's engine sampling parameters and how it uses its tools."""

    params: SamplingParams
    use: ToolUse


def to_sampling(spec: SamplingSpec, tools: ToolsSpec | None, validator: RequestValidator, default_max_tokens: int,
                defaults: dict, tool_call_parser: str = "none") -> Sampling:
    """`defaults`: the version's sampling defaults (its checkpoint's generation_config, its
    manifest's) for the fields the client left unset."""
    validator.limits.check_counts(len(spec.stop), len(spec.stop_token_ids))
    fmt_type = None if spec.response_format is None else spec.response_format.type
    use = tool_use(tools, fmt_type, tool_call_parser)
    kw: dict[str, Any] = dict(defaults)
    kw.update((k, getattr(spec, k)) for k in SamplingSpec.OVERRIDABLE if getattr(spec, k) is not None)
    try:
        if use.forced is not None:  # the call is enforced like a json_schema response_format (its caps, its compiling)
            if spec.ignore_eos:
                raise InvalidRequestError("tool_choice", "a forced tool call cannot be combined with ignore_eos")
            fmt = validator.response_format("json_schema", *tool_schema(tools, use))
        else:
            fmt = _response_format(spec.response_format, validator)
        params = SamplingParams(
            **kw, max_tokens=default_max_tokens if spec.max_tokens is None else spec.max_tokens, stop=spec.stop,
            stop_token_ids=spec.stop_token_ids, ignore_eos=spec.ignore_eos,
            logit_bias=_logit_bias(spec.logit_bias, validator), logprobs=spec.logprobs,
            prompt_logprobs=spec.prompt_logprobs, response_format=fmt)
    except InvalidRequestError as e:
        if use.forced is not None and e.field == "response_format":  # the tools' grammar: name what the client sent
            raise InvalidRequestError("tools", e.message) from e
        raise
    return Sampling(params, use)


def _response_format(spec: ResponseFormatSpec | None, validator: RequestValidator):
    """None for free text; the schema's caps are checked here, its compiling by the validator."""
    if spec is None or spec.type == "text":
        return None
    if spec.type != "json_schema":
        return validator.response_format(spec.type)
    if spec.schema is None:
        raise InvalidRequestError("response_format", "type json_schema needs json_schema: {name, schema}")
    return validator.response_format("json_schema", spec.schema, spec.strict)


def _logit_bias(raw, validator: RequestValidator) -> dict[int, Any]:
    """Token id -> bias: the entry count is checked before any entry is looked at; SamplingParams
    and the validator check the biases and ids. A string key (JSON's) must be a decimal id."""
    if not raw:
        return {}
    validator.check_logit_bias_size(len(raw))
    out = {}
    for key, bias in raw.items():
        if isinstance(key, str):
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise InvalidRequestError("logit_bias", f"key {key[:32]!r} is not a token id (a non-negative integer)")
            key = int(key)
        out[key] = bias
    return out
