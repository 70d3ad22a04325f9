"""Token sampling: greedy, temperature, top-k, top-p, with a generator per seeded request.

A seeded request draws from its own torch.Generator, so its tokens do not depend on what else
is in the batch: same seed, same tokens.

One request's numbers never fail another: a row whose logits are not finite, or whose
sampling gives no valid distribution, is reported in `SamplerOutput.failed` and the other rows
are sampled as if it were not there. `sample` raises only for what no row explains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cluster.engine.request import Request
from cluster.errors import ErrorKind


@dataclass(frozen=True)
class RequestFailure:
    """Why one request of a step got no token; the engine ends that request alone."""

    kind: ErrorKind
    reason: str


@dataclass
class SamplerOutput:
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> sampled token
    failed: dict[str, RequestFailure] = field(default_factory=dict)  # request id -> why none


NON_FINITE_LOGITS = RequestFailure(ErrorKind.INTERNAL, "the model's logits are not finite (nan or inf)")


class Sampler:
    def __init__(self, seed: int):
        self._shared = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [S, vocab] float32, one row per request -> a token or a failure each."""
        # amax propagates nan, so one reduction finds rows with nan, +inf, or nothing finite.
        finite = torch.isfinite(logits.amax(dim=-1))
        greedy = torch.where(finite, logits.argmax(dim=-1), -1).tolist()  # -1: not finite (one sync)
        out = SamplerOutput()
        cpu_logits = None  # copied once, and only when a row is sampled
        for i, (req, g_tok) in enumerate(zip(requests, greedy)):
            rid = req.request_id
            if g_tok < 0:
                out.failed[rid] = NON_FINITE_LOGITS
            elif req.sampling.greedy:
                out.tokens[rid] = g_tok
            else:
                if cpu_logits is None:
                    cpu_logits = logits.cpu()
                token = self._draw(cpu_logits[i], req)
                if isinstance(token, RequestFailure):
                    out.failed[rid] = token
                else:
                    out.tokens[rid] = token
        return out

    def _draw(self, row: torch.Tensor, req: Request) -> int | RequestFailure:
        sp = req.sampling
        probs = None
        try:
            probs = _filtered_probs(row, sp.temperature, sp.top_k, sp.top_p)
            return int(torch.multinomial(probs, 1, generator=self._generator(req)).item())
        except Exception as e:  # noqa: BLE001 — this request's failure, never the batch's
            if probs is not None and not _is_distribution(probs):
                # The logits were finite, so the request's own sampling numbers broke them.
                return RequestFailure(
                    ErrorKind.INVALID_INPUT,
                    f"sampling parameters (temperature={sp.temperature!r}, top_k={sp.top_k}, top_p={sp.top_p!r}) "
                    f"give no valid probability distribution",
                )
            return RequestFailure(ErrorKind.INTERNAL, f"sampling failed: {type(e).__name__}: {e}")

    def _generator(self, req: Request) -> torch.Generator:
        if req.sampling.seed is None:
            return self._shared
        g = self._per_request.get(req.request_id)
        if g is None:
            g = self._per_request[req.request_id] = torch.Generator().manual_seed(req.sampling.seed)
        return g


def _is_distribution(probs: torch.Tensor) -> bool:
    return bool(torch.isfinite(probs).all() and (probs >= 0).all() and probs.sum() > 0)


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    # Shift before scaling: (x - max) / t <= 0 and the top token's is 0, so no temperature can
    # overflow the row (x / t could: 30 / 1e-38 is inf). Softmax is shift-invariant.
    logits = (logits - logits.max()) / temperature
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
