"""Request validation and tokenization without model weights (the ingress uses it too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cluster.errors import InvalidRequestError
from cluster.engine.kv_cache.manager import cdiv
from cluster.engine.request import DEFAULT_CONTEXT, Request, RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.config import EngineOptions, kv_block_bytes
from cluster.engine.model_config import ModelConfig
from cluster.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestValidator:
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int  # the KV pool a request must fit in (the smallest of the pools it visits)
    eos_token_ids: tuple[int, ...]

    @classmethod
    def for_model(cls, model_dir: str, pools: "Sequence[EngineOptions]") -> "RequestValidator":
        """The validator of a checkpoint served by engines with these options (no weights read):
        a request must fit the smallest KV pool and context length among them."""
        mc = ModelConfig.from_dir(model_dir)
        tok = Tokenizer(model_dir)
        max_len = min(min(o.max_model_len or mc.max_position_embeddings for o in pools), mc.max_position_embeddings)
        num_blocks = min(o.num_kv_blocks(kv_block_bytes(mc, o)) for o in pools)
        block_sizes = {o.block_size for o in pools}
        if len(block_sizes) != 1:
            raise ValueError(f"pools disagree on block_size: {sorted(block_sizes)}")
        eos = mc.eos_token_ids or tuple(
            t for t in [tok.token_to_id(tok.config.get("eos_token"))] if t is not None)
        return cls(tok, mc.vocab_size, max_len, block_sizes.pop(), num_blocks, eos)

    def make_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        ctx: RequestContext = DEFAULT_CONTEXT,
    ) -> Request:
        sampling = sampling or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or prompt_token_ids")
        vocab = self.vocab_size
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("prompt", "must be a non-empty string")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt_token_ids)
            if not ids:
                raise InvalidRequestError("prompt_token_ids", "must not be empty")
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise InvalidRequestError(
                        "prompt_token_ids", f"token id {t!r} at index {i} is outside the vocabulary [0, {vocab})"
                    )
        for t in sampling.stop_token_ids:
            if t >= vocab:
                raise InvalidRequestError("stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab})")
        self.check_length(len(ids), sampling.max_tokens)
        return Request(request_id, ids, sampling, self.eos_token_ids, ctx=ctx)

    def check_length(self, n_prompt: int, max_tokens: int) -> None:
        limit = self.max_model_len
        if n_prompt >= limit:
            raise InvalidRequestError(
                "prompt", f"has {n_prompt} tokens; the context length is {limit}, so at most {limit - 1} fit"
            )
        if n_prompt + max_tokens > limit:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} "
                f"exceeds the context length {limit}",
            )
        blocks = cdiv(n_prompt + max_tokens, self.block_size)
        if blocks > self.num_blocks:
            raise InvalidRequestError(
                "max_tokens", f"prompt + max_tokens needs {blocks} KV blocks; the pool has {self.num_blocks}"
            )
