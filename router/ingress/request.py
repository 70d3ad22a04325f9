"""What an edge hands the front door and what comes back, in no wire's shape.

`ClientRequest` is a request as the client sent it, decoded and bounded by its edge (gRPC or
OpenAI HTTP) but not yet interpreted: no model version is chosen, the sampling fields are the
client's own (`SamplingSpec`: unset stays None, the version's defaults fill it in), the tools as
given. The version's flow turns it into engine terms once (router/ingress/flow/sampling.py).

`Delta` is what one choice's stream yields: tokens, their text, counts and logprobs. Nothing a
policy decided travels in it (a guardrail's interventions, a response-cache hit): that is the
gateway's `Outcome` (router/ingress/gateway/stages.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from cluster.engine.outputs import TokenLogprob


@dataclass(frozen=True)
class ResponseFormatSpec:
    type: str  # "text", "json_object" or "json_schema" (the validator refuses any other)
    schema: dict | None = None  # json_schema's schema, parsed by the edge once its size was checked
    strict: bool = False


@dataclass(frozen=True)
class SamplingSpec:
    """The client's sampling fields; None (or empty) where it left them unset."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None  # top logprobs per token (0: the sampled token's only); None: none
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: Mapping | None = None  # token id (int, or its decimal string as JSON keys are) -> bias
    response_format: ResponseFormatSpec | None = None

    OVERRIDABLE = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_p")  # the fields a version's defaults fill when unset


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None

    def template(self) -> dict:
        """As the chat template sees a tool (OpenAI's shape, unset fields left out)."""
        function = {k: v for k, v in (("name", self.name), ("description", self.description),
                                      ("parameters", self.parameters), ("strict", self.strict)) if v is not None}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolsSpec:
    """A chat's tools, tool_choice and parallel_tool_calls, as given (checked by flow/tools.py)."""

    functions: tuple[FunctionTool, ...] = ()
    choice: str | None = None  # "none", "auto", "required", "function" (a named one) or None: unset
    function: str | None = None  # the named function of choice "function"
    parallel: bool | None = None


@dataclass(frozen=True)
class ClientRequest:
    """One request from an edge. Exactly one of `prompt`, `prompt_token_ids` and `messages`."""

    tenant: str  # who is calling (the gateway's authentication said so)
    sampling: SamplingSpec
    model: str | None = None  # a model name, `name@label` (a pinned version) or None: the first one
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None  # chat messages as the template sees them
    tools: ToolsSpec | None = None
    n: int = 1  # choices: each a request of its own
    deadline: float | None = None  # wall-clock time (time.time())
    session: str | None = None  # the session key: a routing preference only (api/headers.py)
    label: str | None = None  # the client's request_id: echoed in replies, never an engine's id

    @property
    def param(self) -> str:
        """The field an error about the prompt names."""
        return "prompt" if self.messages is None else "messages"


@dataclass
class Delta:
    request_id: str  # the client's label, or the request's own id when it gave none
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    # The first delta's, when the request asked for them: one per prompt token (None for the
    # first), and the prompt's token ids they score
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = field(default=None)
