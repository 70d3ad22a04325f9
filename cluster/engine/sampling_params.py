"""Per-request sampling parameters, validated on construction.

Logits processing (vLLM's order): logit_bias is added, then repetition_penalty (over prompt and
output tokens: positive logits divided, negative multiplied), then frequency and presence
penalties (OpenAI: over output tokens only, `count * frequency + (count > 0) * presence`
subtracted); then temperature, min_p (tokens below min_p * the top token's probability dropped),
top_k, top_p. Logprobs are the model's raw log-softmax, before any of it (vLLM's default).
Sizes (logit_bias entries, top logprobs) are capped by RequestLimits, checked by the validator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.engine.grammar import ResponseFormat
from cluster.errors import InvalidRequestError

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by less is numerically
# meaningless, and by a tiny enough positive number it overflows to inf.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below SAMPLING_EPS (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # (0, 2]; 1 = off
    # (token id, bias in [-100, 100]) sorted by id; a dict is accepted and converted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0  # [0, 1]; 0 = off
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    # None: none; k >= 0: each prompt token's logprob (given the tokens before it) and the top k,
    # on the engine that computes the prompt (which then skips its prefix cache: every position is computed)
    prompt_logprobs: int | None = None
    # Constrained output (cluster/engine/grammar.py): the sampler masks every token the grammar
    # refuses; EOS is allowed only once the JSON is complete.
    response_format: ResponseFormat | None = None
    # Derived once here, read per row per step by the sampler: "no logits processing and no
    # logprobs" (the sampler's fast path) and "needs token counts" (penalties).
    penalized: bool = field(init=False, repr=False, compare=False, default=False)
    plain: bool = field(init=False, repr=False, compare=False, default=True)

    def __post_init__(self):
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_float("temperature", self.temperature, lo=0.0, hi=100.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=2.0, lo_open=True)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        penalized = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        object.__setattr__(self, "penalized", penalized)
        if self.response_format is not None:
            if not isinstance(self.response_format, ResponseFormat):
                raise InvalidRequestError("response_format", f"must be a ResponseFormat, got {self.response_format!r}")
            if self.ignore_eos or self.min_tokens:
                # The grammar ends the output with EOS; ignoring it (or before min_tokens) leaves nothing to sample.
                raise InvalidRequestError("response_format", "cannot be combined with ignore_eos or min_tokens")
        object.__setattr__(self, "plain", not penalized and not self.logit_bias and self.logprobs is None
                           and self.response_format is None)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs; ids are checked against the vocabulary and the
    entry count against RequestLimits by the validator (the edges check the count before this loop)."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else _as_tuple("logit_bias", value)
    pairs = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidRequestError("logit_bias", f"must map token ids to biases, got {item!r}")
        token, bias = item
        _check_int("logit_bias", token, lo=0)
        _check_float("logit_bias", bias, lo=-100.0, hi=100.0)
        pairs.append((token, float(bias)))
    pairs.sort()
    for (a, _), (b, _) in zip(pairs, pairs[1:]):
        if a == b:
            raise InvalidRequestError("logit_bias", f"token id {a} appears twice")
    return tuple(pairs)


def _as_tuple(name: str, value) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(name, f"must be a list, got {type(value).__name__}")
    return tuple(value)


def _check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise InvalidRequestError(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidRequestError(name, f"must be <= {hi}, got {value}")


def _check_float(name: str, value, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(name, f"must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value}")
    if (value <= lo if lo_open else value < lo) or value > hi:
        bracket = "(" if lo_open else "["
        raise InvalidRequestError(name, f"must be in {bracket}{lo}, {hi}], got {value}")
