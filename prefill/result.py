"""What a prefill replica returns for a request: its own module, free of torch and the engine,
because the ingress unpickles it (a class's module is imported where it is unpickled, and the
front door never imports torch: tests/test_layers.py)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.outputs import TokenLogprob
from cluster.errors import ErrorKind
from kv_transfer.handle import KVHandle


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    handle: KVHandle | None  # None when the request ended here (error, or nothing to decode)
    finish_reason: str | None  # set when no decode is needed (stop on the first token, max_tokens=1)
    error: str | None = None
    first_token: int | None = None
    num_cached_tokens: int = 0  # prompt tokens this prefill engine found in its prefix cache
    finished: bool = True  # one result per request (the async loop's contract)
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs: the first token's
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when it asked for the prompt's
    error_kind: ErrorKind | None = None  # with an error: whose fault (FORWARD: not retried on decode)
