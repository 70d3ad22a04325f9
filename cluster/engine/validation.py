"""Request validation and tokenization without model weights (the ingress uses it too).

Cheap checks run first: every cap in RequestLimits is checked on sizes alone before any
per-item work (tokenizing, a loop over ids), so a hostile request costs about its refusal.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Sequence

from cluster.engine.grammar import ResponseFormat, response_format, schema_depth
from cluster.engine.kv_cache.manager import cdiv
from cluster.engine.request import DEFAULT_CONTEXT, Request, RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.config import EngineOptions, RequestLimits, kv_block_bytes_per_rank
from cluster.engine.model_config import ModelConfig
from cluster.engine.tokenizer import Tokenizer
from cluster.errors import InvalidRequestError

_REQUEST_ID = re.compile(r"[!-~]+")  # printable ASCII, no whitespace: safe in logs, metrics and headers


@dataclass(frozen=True)
class RequestValidator:
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int  # the KV pool a request must fit in (the smallest of the pools it visits)
    eos_token_ids: tuple[int, ...]
    limits: RequestLimits = field(default_factory=RequestLimits)

    @classmethod
    def for_model(cls, model_dir: str, pools: "Sequence[EngineOptions]") -> "RequestValidator":
        """The validator of a checkpoint served by engines with these options (no weights read):
        a request must fit the smallest KV pool and context length among them."""
        mc = ModelConfig.from_dir(model_dir)
        tok = Tokenizer(model_dir)
        max_len = min(min(o.max_model_len or mc.max_position_embeddings for o in pools), mc.max_position_embeddings)
        num_blocks = min(o.num_kv_blocks(kv_block_bytes_per_rank(mc, o)) for o in pools)  # whole-model blocks
        block_sizes = {o.block_size for o in pools}
        if len(block_sizes) != 1:
            raise ValueError(f"pools disagree on block_size: {sorted(block_sizes)}")
        eos = mc.eos_token_ids or tuple(
            t for t in [tok.token_to_id(tok.config.get("eos_token"))] if t is not None)
        limits = {o.limits for o in pools}
        if len(limits) != 1:  # every engine a request visits checks it: one set of caps, or the ingress lies
            raise ValueError("pools disagree on engine limits: set them once in the app's engine section")
        return cls(tok, mc.vocab_size, max_len, block_sizes.pop(), num_blocks, eos, limits.pop())

    def make_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        ctx: RequestContext = DEFAULT_CONTEXT,
    ) -> Request:
        sampling = sampling or SamplingParams()
        self.check_request_id(request_id)
        self.check_sampling(sampling)
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or prompt_token_ids")
        ids = self.tokenize(prompt) if prompt is not None else self.check_token_ids(prompt_token_ids)
        self.check_length(len(ids), sampling.max_tokens)
        return Request(request_id, ids, sampling, self.eos_token_ids, ctx=ctx)

    def check_request_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        cap = self.limits.max_request_id_len
        if len(request_id) > cap:
            raise InvalidRequestError("request_id", f"has {len(request_id)} characters; at most {cap} are accepted")
        if not _REQUEST_ID.fullmatch(request_id):
            raise InvalidRequestError("request_id", "must be printable ASCII without whitespace")

    def check_sampling(self, sampling: SamplingParams) -> None:
        """The caps on a request's stop conditions, logit_bias and logprobs, and its token ids
        (stop_token_ids, logit_bias keys) against the vocabulary."""
        lim = self.limits
        lim.check_counts(len(sampling.stop), len(sampling.stop_token_ids))
        for s in sampling.stop:
            if len(s) > lim.max_stop_string_len:
                raise InvalidRequestError(
                    "stop", f"a stop string has {len(s)} characters; at most {lim.max_stop_string_len} are accepted")
            _check_utf8("stop", s)
        self.check_logit_bias_size(len(sampling.logit_bias))
        if sampling.logprobs is not None and sampling.logprobs > lim.max_logprobs:
            raise InvalidRequestError(
                "logprobs", f"asks for {sampling.logprobs} top logprobs; at most {lim.max_logprobs} are accepted")
        if sampling.prompt_logprobs is not None and sampling.prompt_logprobs > lim.max_logprobs:
            raise InvalidRequestError(
                "prompt_logprobs",
                f"asks for {sampling.prompt_logprobs} top logprobs; at most {lim.max_logprobs} are accepted")
        if sampling.response_format is not None:
            self.check_response_format(sampling.response_format)
        vocab = self.vocab_size
        for t in sampling.stop_token_ids:
            if t >= vocab:
                raise InvalidRequestError("stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab})")
        for t, _ in sampling.logit_bias:
            if t >= vocab:
                raise InvalidRequestError("logit_bias", f"token id {t} is outside the vocabulary [0, {vocab})")

    def check_response_format(self, fmt: ResponseFormat) -> None:
        """The schema within the caps (again: a ResponseFormat may be built without them) and
        compiling, with the library the engines use (about a millisecond; off the event loop at
        the ingress, which validates in an executor)."""
        lim = self.limits
        if len(fmt.schema.encode()) > lim.max_schema_bytes:
            raise InvalidRequestError("response_format", f"the JSON schema has {len(fmt.schema.encode())} bytes; "
                                      f"at most {lim.max_schema_bytes} are accepted")
        try:
            depth = schema_depth(json.loads(fmt.schema))
        except (ValueError, RecursionError):
            raise InvalidRequestError("response_format", "the JSON schema is not JSON, or nests too deep") from None
        if depth > lim.max_schema_depth:
            raise InvalidRequestError(
                "response_format", f"the JSON schema nests {depth} deep; at most {lim.max_schema_depth} is accepted")
        fmt.grammar()

    def response_format(self, kind: str, schema=None, strict: bool = False) -> ResponseFormat:
        """A client's response_format (the schema parsed from JSON), within this validator's caps."""
        return response_format(kind, schema, strict, max_bytes=self.limits.max_schema_bytes,
                               max_depth=self.limits.max_schema_depth)

    def check_logit_bias_size(self, n: int) -> None:
        """The entry cap, checked before a client's logit_bias is converted entry by entry."""
        self.limits.check_logit_bias(n)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids; its size is checked first, so the tokenizer never sees a huge one."""
        self.tokenize_checks(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def tokenize_checks(self, prompt: str) -> None:
        """What a prompt's text must meet before the tokenizer sees it (400 on `prompt`)."""
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("prompt", "must be a non-empty string")
        cap = self.limits.prompt_chars(self.max_model_len)
        if len(prompt) > cap:
            raise InvalidRequestError("prompt", f"has {len(prompt)} characters; at most {cap} are accepted")
        _check_utf8("prompt", prompt)

    def tokenize_chat(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """A rendered chat's token ids (chat_template.render_chat_pieces): the joined text meets
        `tokenize`'s checks, then only the template's special tokens become special ids."""
        self.tokenize_checks("".join(text for text, _ in pieces))
        return self.tokenizer.encode_chat(pieces)

    def check_token_ids(self, prompt_token_ids: Sequence[int]) -> list[int]:
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
            raise InvalidRequestError("prompt_token_ids", "must be a list of token ids")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        self._check_prompt_len(len(prompt_token_ids))  # before the per-id loop below
        vocab = self.vocab_size
        ids = list(prompt_token_ids)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    "prompt_token_ids", f"token id {t!r} at index {i} is outside the vocabulary [0, {vocab})"
                )
        return ids

    def check_length(self, n_prompt: int, max_tokens: int) -> None:
        limit = self.max_model_len
        self._check_prompt_len(n_prompt)
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

    def _check_prompt_len(self, n_prompt: int) -> None:
        limit = self.max_model_len
        if n_prompt >= limit:
            raise InvalidRequestError(
                "prompt", f"has {n_prompt} tokens; the context length is {limit}, so at most {limit - 1} fit"
            )


def _check_utf8(name: str, text: str) -> None:
    """Python strings may hold lone surrogates (JSON "\\ud800" decodes to one); UTF-8 has no form for
    them, so the tokenizer would fail on them as a server error."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            name, f"is not valid Unicode: a lone surrogate {text[e.start]!r} at index {e.start}") from None
