"""Verification of draft tokens against the target model's distributions at each position.

Greedy: accept drafts while each equals the target's argmax; then emit the argmax at the first
mismatch (or after the last draft, the bonus token). Exactly the tokens greedy decoding gives.

Sampled, with a point-mass draft x (n-gram drafts are certain): rejection sampling accepts x with
probability p(x) and otherwise samples from p with x removed and renormalised. We realise it as
"draw y ~ p with the request's generator; accept x when y == x, else emit y": P(accept) = p(x),
and given a rejection y ~ p(· | y != x) = p with x removed, renormalised — the same sampler.
Each position takes exactly one draw, and only up to the first rejection, so a request consumes
its generator exactly as non-speculative decoding does: a seeded request gives the same tokens
with or without speculation (up to the float rounding of scoring several positions at once).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def accept_greedy(targets: Sequence[int], draft: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """targets: the argmax at each of the 1 + len(draft) positions -> (accepted drafts, next token)."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return tuple(draft[:a]), targets[a]


def accept_sampled(probs: Callable[[int], torch.Tensor], draft: Sequence[int],
                   generator: torch.Generator) -> tuple[tuple[int, ...], int]:
    """probs(j): the target's (filtered) distribution at position j, j in 0..len(draft); computed
    only for the positions reached. -> (accepted drafts, next token)."""
    for j in range(len(draft) + 1):
        y = int(torch.multinomial(probs(j), 1, generator=generator).item())
        if j == len(draft) or y != draft[j]:
            return tuple(draft[:j]), y
    raise AssertionError("unreachable")


def accept_rejection(probs: torch.Tensor, x: int, generator: torch.Generator) -> tuple[bool, int]:
    """The textbook form for one position, for tests: accept x with probability p(x), else sample
    p with x removed and renormalised. -> (accepted, token)."""
    if float(torch.rand(1, generator=generator)) < float(probs[x]):
        return True, x
    residual = probs.clone()
    residual[x] = 0
    return False, int(torch.multinomial(residual, 1, generator=generator).item())
