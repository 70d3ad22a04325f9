"""Synthetic workloads: what each request asks (prompt, max tokens) and which requests form a
conversation.

Every dataset is a `sample(n, rng)` over a seeded numpy Generator, so one seed gives the same
requests on every run and machine. Prompts are token ids drawn uniformly from the model's
vocabulary, which makes prompt lengths exact (text would be re-tokenized by the server);
`to_text` turns them into text with a tokenizer where a text prompt is wanted.

A `Session` is a sequence of turns run one after another: turn k's prompt is turn k-1's prompt,
then its answer (what the server generated), then turn k's new user message. A single-turn
session is one plain request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import numpy as np


@dataclass(frozen=True)
class Prompt:
    """Token ids or text (exactly one)."""

    token_ids: tuple[int, ...] | None = None
    text: str | None = None

    def __post_init__(self):
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("a prompt is token ids or text, exactly one")

    @property
    def num_tokens(self) -> int | None:
        """Known only for token-id prompts (the server counts text prompts)."""
        return None if self.token_ids is None else len(self.token_ids)

    def __add__(self, other: "Prompt") -> "Prompt":
        if self.token_ids is not None and other.token_ids is not None:
            return Prompt(token_ids=self.token_ids + other.token_ids)
        if self.text is not None and other.text is not None:
            return Prompt(text=self.text + other.text)
        raise ValueError("cannot join a token-id prompt and a text prompt")


@dataclass(frozen=True)
class Turn:
    prompt: Prompt  # for turns after the first: only the new user message
    max_tokens: int


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]
    arrival_s: float | None = None  # trace replay: the trace's own start time (s from the first)

    @property
    def num_requests(self) -> int:
        return len(self.turns)


class Dataset(Protocol):
    name: str

    def sample(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        """Sessions holding `num_requests` requests in all (or fewer where the data runs out)."""
        ...


def random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, vocab_size, size=n))


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [mean·(1-r), mean·(1+r)], at least 1 (vLLM's `--random-range-ratio`)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    return max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))


@dataclass(frozen=True)
class RandomDataset:
    """Independent requests with uniform random prompt and output lengths around the means."""

    input_len: int
    output_len: int
    range_ratio: float
    vocab_size: int
    name: str = "random"

    def sample(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        lo_in, hi_in = length_range(self.input_len, self.range_ratio)
        lo_out, hi_out = length_range(self.output_len, self.range_ratio)
        in_lens = rng.integers(lo_in, hi_in + 1, size=num_requests)
        out_lens = rng.integers(lo_out, hi_out + 1, size=num_requests)
        return [Session((Turn(Prompt(random_ids(rng, int(i), self.vocab_size)), int(o)),))
                for i, o in zip(in_lens, out_lens)]

    def max_context(self) -> int:
        return length_range(self.input_len, self.range_ratio)[1] + length_range(self.output_len, self.range_ratio)[1]


@dataclass(frozen=True)
class SharedPrefixDataset:
    """N prefixes × M suffixes: every prefix is shared by M requests (a system prompt and its
    questions), in shuffled order so requests of one prefix interleave with the others'."""

    num_prefixes: int
    suffixes_per_prefix: int
    prefix_len: int
    suffix_len: int
    output_len: int
    vocab_size: int
    name: str = "shared-prefix"

    @property
    def size(self) -> int:
        return self.num_prefixes * self.suffixes_per_prefix

    def sample(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        if num_requests > self.size:
            raise ValueError(f"the shared-prefix dataset has {self.num_prefixes} x {self.suffixes_per_prefix} = "
                             f"{self.size} prompts; asked for {num_requests}")
        prefixes = [random_ids(rng, self.prefix_len, self.vocab_size) for _ in range(self.num_prefixes)]
        prompts = [Prompt(prefix + random_ids(rng, self.suffix_len, self.vocab_size))
                   for prefix in prefixes for _ in range(self.suffixes_per_prefix)]
        order = rng.permutation(len(prompts))[:num_requests]
        return [Session((Turn(prompts[int(i)], self.output_len),)) for i in order]

    def max_context(self) -> int:
        return self.prefix_len + self.suffix_len + self.output_len


@dataclass(frozen=True)
class MultiTurnDataset:
    """Conversations of `turns` turns; each turn adds a user message of `user_len` tokens to the
    whole conversation so far, so turn k's prompt is k·(user_len + output_len) + user_len tokens
    long when every answer has its full length."""

    turns: int
    user_len: int
    output_len: int
    vocab_size: int
    name: str = "multi-turn"

    def sample(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        if num_requests < self.turns:
            raise ValueError(f"multi-turn sessions have {self.turns} turns; asked for only {num_requests} requests")
        return [Session(tuple(Turn(Prompt(random_ids(rng, self.user_len, self.vocab_size)), self.output_len)
                              for _ in range(self.turns)))
                for _ in range(num_requests // self.turns)]

    def max_context(self) -> int:
        return self.turns * (self.user_len + self.output_len)


def check_fits(sessions: Sequence[Session], max_model_len: int) -> None:
    """Raise before sending anything if a session's token-id prompts cannot fit the context."""
    for i, s in enumerate(sessions):
        lens = [t.prompt.num_tokens for t in s.turns]
        if any(n is None for n in lens):
            continue
        need = sum(lens) + sum(t.max_tokens for t in s.turns)
        if need > max_model_len:
            raise ValueError(f"session {i} needs {need} tokens of context (prompts + outputs); the model's "
                             f"context length is {max_model_len}")


def to_text(sessions: Sequence[Session], tokenizer) -> list[Session]:
    """Token-id prompts as text (the server re-tokenizes, so lengths are approximate)."""
    def text(p: Prompt) -> Prompt:
        return p if p.text is not None else Prompt(text=tokenizer.decode(p.token_ids))

    return [replace(s, turns=tuple(replace(t, prompt=text(t.prompt)) for t in s.turns)) for s in sessions]


def to_ids(sessions: Sequence[Session], tokenizer) -> list[Session]:
    """Text prompts as token ids, encoded as the server encodes text (special tokens added), so the
    server sees the same ids and prompt lengths are known here."""
    def ids(p: Prompt) -> Prompt:
        return p if p.token_ids is not None else Prompt(tuple(tokenizer.encode(p.text)))

    return [replace(s, turns=tuple(replace(t, prompt=ids(t.prompt)) for t in s.turns)) for s in sessions]
