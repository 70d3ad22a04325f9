"""The gRPC edge: converts between protos and the request flow. Generated code is imported here
and in the CLI client only."""

from __future__ import annotations

import json

import grpc

from cluster.engine.outputs import FinishReason
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.validation import RequestValidator
from cluster.errors import InvalidRequestError
from protos.pdserve.v1 import generation_pb2 as pb
from router.ingress.flow import Delta
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
                 "repetition_penalty", "min_p", "logprobs"):
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
        return None, None, [{"role": m.role, "content": m.content} for m in req.chat.messages]
    raise InvalidRequestError("prompt", "set text, token_ids or chat")


def delta_to_proto(d: Delta) -> "pb.GenerateResponse":
    resp = pb.GenerateResponse(request_id=d.request_id, text=d.text, token_ids=d.token_ids,
                               finish_reason=FINISH[d.finish_reason])
    for lp in d.logprobs or ():
        resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                          top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
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
