"""The sparse MoE layer (Mixtral, Qwen3-MoE), computed grouped: one GEMM per expert over its rows.

Routing as transformers: softmax over the router logits in float32, top-k, optionally the k weights
renormalised. The (token, choice) rows are then sorted by expert, so each expert that received rows
runs its gate_up and down projections once over a contiguous block, and the weighted outputs are
added back onto their tokens. Experts with no rows are skipped (never indexed).
"""

from __future__ import annotations

import torch
from torch import nn

from cluster.engine.model.layers import Linear
from cluster.engine.model.ops import TORCH_OPS
from cluster.engine.model_config import MoEConfig


class Experts(nn.Module):
    """Every expert's SiLU-gated MLP, stacked (transformers 5's layout and names); under expert
    parallelism a rank's whole experts only (distributed/moe_shard.py)."""

    def __init__(self, num_experts: int, intermediate: int, hidden: int):
        super().__init__()
        e, i = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden))  # [E, 2I, H]: gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i))  # [E, H, I]


class SparseMoE(nn.Module):
    ops = TORCH_OPS  # replaced by DecoderForCausalLM.use_ops

    def __init__(self, moe: MoEConfig, hidden: int):
        super().__init__()
        self.gate = Linear(hidden, moe.num_experts, bias=False)  # the router
        self.experts = Experts(moe.num_experts, moe.intermediate_size, hidden)
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.renormalize, self.float32_weights = moe.renormalize, moe.float32_weights

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, experts [T, k] int64)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] -> [T, H]
        return self.routed(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """Every token's routed experts' weighted outputs, summed: [T, H]."""
        weights, experts = self.route(x)
        return self.grouped(x, weights.flatten(), experts.flatten(), None)

    def grouped(self, x: torch.Tensor, w: torch.Tensor, choices: torch.Tensor,
                rows: torch.Tensor | None) -> torch.Tensor:
        """Run the (token, choice) rows expert by expert and add them onto their tokens. Row i runs
        expert choices[i] (an index into self.experts) weighted by w[i]; it is (token, choice) row
        rows[i] of the T*k (token r // k's (r % k)-th expert), or row i itself when rows is None."""
        order = choices.argsort(stable=True)  # the rows grouped by expert, ascending
        counts = torch.bincount(choices, minlength=self.experts.down_proj.shape[0]).tolist()  # one host read
        tokens = (order if rows is None else rows[order]) // self.top_k
        xs = x[tokens]  # [R, H], expert by expert
        out = torch.empty_like(xs)
        ops, start = self.ops, 0
        for e, n in enumerate(counts):
            if n:
                block = slice(start, start + n)
                gate_up = ops.linear(xs[block], self.experts.gate_up_proj[e], None)  # [n, 2I]
                out[block] = ops.linear(ops.silu_mul(gate_up), self.experts.down_proj[e], None)
                start += n
        w = w[order, None]  # [R, 1]
        # Mixtral scales in float32 (its weights stay float32); Qwen3-MoE casts them to the model dtype.
        out = (out.float() * w).to(x.dtype) if self.float32_weights else out * w.to(x.dtype)
        # Each token's rows are added in expert order, as transformers' per-expert index_add_.
        return torch.zeros_like(x).index_add_(0, tokens, out)
