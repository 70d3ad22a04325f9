"""One request's text as the client sees it: one detokenizer over every leg's tokens (the first
token from prefill, the rest from decode, a migrated leg's after them), so their text joins up
and a stop string spanning two legs is found."""

from __future__ import annotations

from cluster.engine.outputs import FinishReason, TokenLogprob
from cluster.engine.tokenizer import IncrementalDetokenizer
from router.ingress.request import Delta


class ClientStream:
    def __init__(self, label: str, detok: IncrementalDetokenizer, prompt_ids: list[int]):
        self.label = label  # what the client's deltas carry
        self.detok = detok
        self.prompt_ids = prompt_ids
        self.generated: list[int] = []  # every token sent to the client, in order
        self.cached = 0  # prompt tokens found in a prefix cache

    def delta(self, tokens: list[int], final_reason: str | None, logprobs: list[TokenLogprob] | None = None,
              prompt_logprobs: list[TokenLogprob | None] | None = None) -> Delta:
        for t in tokens:
            self.detok.add(t)
        self.generated.extend(tokens)
        reason = FinishReason.STOP if self.detok.stopped else final_reason
        return Delta(self.label, self.detok.take(final=reason is not None), tokens, reason, len(self.prompt_ids),
                     len(self.generated), self.cached, logprobs, prompt_logprobs,
                     None if prompt_logprobs is None else self.prompt_ids)
