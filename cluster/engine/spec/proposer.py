"""Proposers: where draft tokens come from. One small interface, so a draft model can join later.

`NgramProposer` is prompt lookup: find the request's last n tokens (n from ngram_max down to
ngram_min) earlier in its prompt or output, and propose the tokens that followed that earlier
occurrence. It costs no model: an index of every n-gram's first occurrence, kept on the
request and extended by the tokens added since the last call (O(new tokens) per step).
"""

from __future__ import annotations

from typing import Protocol

from cluster.engine.request import Request


class Proposer(Protocol):
    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        """Up to `k` tokens likely to follow `req.all_token_ids` (empty: nothing to propose)."""
        ...


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int):
        self.ns = tuple(range(ngram_max, ngram_min - 1, -1))  # longest match first

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        tokens = req.all_token_ids
        n_tokens = len(tokens)
        index = req.spec.proposer
        # index[n]: n-gram -> the end (exclusive) of its first occurrence, over ends < n_tokens, so
        # the suffix itself is never its own match
        start = index.get("ends", 0)
        for n in self.ns:
            grams = index.setdefault(n, {})
            for end in range(max(start, n), n_tokens):
                grams.setdefault(tuple(tokens[end - n:end]), end)
        index["ends"] = n_tokens
        for n in self.ns:
            if n_tokens < n:
                continue
            end = index[n].get(tuple(tokens[n_tokens - n:]))
            if end is not None:
                return tuple(tokens[end:end + k])
        return ()


def make_proposer(method: str, ngram_min: int, ngram_max: int) -> Proposer:
    if method == "ngram":
        return NgramProposer(ngram_min, ngram_max)
    raise ValueError(f"unknown speculative method {method!r}")
