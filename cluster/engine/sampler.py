"""Token sampling: greedy, temperature, top-k, top-p, with a generator per seeded request.

A seeded request draws from its own torch.Generator, so its tokens do not depend on what else
is in the batch: same seed, same tokens.
"""

from __future__ import annotations

import torch

from cluster.engine.request import Request


class Sampler:
    def __init__(self, seed: int):
        self._shared = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits: [S, vocab] float32, one row per request -> one token id each."""
        greedy = logits.argmax(dim=-1).tolist()
        if all(r.sampling.greedy for r in requests):
            return greedy
        logits = logits.cpu()
        out = []
        for row, req, g_tok in zip(logits, requests, greedy):
            sp = req.sampling
            if sp.greedy:
                out.append(g_tok)
                continue
            probs = _filtered_probs(row, sp.temperature, sp.top_k, sp.top_p)
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(req)).item()))
        return out

    def _generator(self, req: Request) -> torch.Generator:
        if req.sampling.seed is None:
            return self._shared
        g = self._per_request.get(req.request_id)
        if g is None:
            g = self._per_request[req.request_id] = torch.Generator().manual_seed(req.sampling.seed)
        return g


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        # Keep the smallest head whose mass reaches top_p (the top token always stays).
        drop = (sorted_p.cumsum(0) - sorted_p) > top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return probs
