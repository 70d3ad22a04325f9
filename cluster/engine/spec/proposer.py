"""Proposers: where draft tokens come from, behind one small interface.

`NgramProposer` is prompt lookup: find the request's last n tokens (n from ngram_max down to
ngram_min) earlier in its prompt or output, and propose the tokens that followed that earlier
occurrence. It costs no model: an index of every n-gram's first occurrence, kept on the
request and extended by the tokens added since the last call (O(new tokens) per step).

`DraftProposer` (spec/draft.py) runs a smaller model: it proposes for the whole batch at once
(`propose_batch`: one draft forward per draft position, not one per request) and holds KV per
request, which `release` frees when the request leaves the engine.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from cluster.engine.request import Request


class Proposer(Protocol):
    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        """Up to `k` tokens likely to follow `req.all_token_ids` (empty: nothing to propose)."""
        ...

    def propose_batch(self, asks: Sequence[tuple[Request, int]]) -> list[tuple[int, ...]]:
        """`propose` for each (request, k) of one step, in order. The engine calls this one: a
        proposer with a model batches the requests (the default asks one by one)."""
        return [self.propose(req, k) for req, k in asks]

    def rollback(self, req: Request) -> None:
        """The step that took the request's drafts is over (verified and its tokens appended, or
        the drafts dropped by the scheduler) and it has not finished: a proposer holding state
        past the request's tokens rolls it back. Default: nothing held."""

    def release(self, request_id: str) -> None:
        """The request left this engine (finished, aborted, preempted, migrated away): free
        whatever the proposer holds for it. Default: nothing held."""


class NgramProposer(Proposer):
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
    """The proposers without a model (the draft model's needs the engine: spec/draft.py)."""
    if method == "ngram":
        return NgramProposer(ngram_min, ngram_max)
    raise ValueError(f"unknown speculative method {method!r}")
