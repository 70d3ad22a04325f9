"""The layers that differ on a tensor-parallel rank, and the rank's model built from them.

Column-parallel (qkv, gate/up) needs no new layer: a rank's model is the plain DecoderForCausalLM
built with its own head and intermediate counts (the loader fills those rows). Row-parallel
(o_proj, down_proj) sums the ranks' partial outputs with an all-reduce. The embedding and the LM
head hold a vocabulary shard each; the embedding's rows are all-reduced (one rank holds each
token, the others add zeros: exact), the LM head's logits are gathered on rank 0, the driver,
because the sampler reads the whole row (penalties, top-k/p, logprobs, grammar masks): a
distributed argmax would serve greedy only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cluster.engine.distributed.plan import ShardPlan
from cluster.engine.model.decoder import DecoderForCausalLM
from cluster.engine.model.layers import Linear
from cluster.engine.model.rope import RotaryEmbedding
from cluster.engine.model_config import ModelConfig


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r @ W_r^T: each rank holds the input columns of its heads (o_proj)
    or of its MLP rows (down_proj). Bias-free (Llama's o_proj and down_proj have none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.linear(x, self.weight, None)  # [T, hidden], this rank's partial sum
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, plan: ShardPlan, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(plan.vocab_shard, hidden))
        self.start = plan.vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T] -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0.0)
        dist.all_reduce(x)
        return x


class ParallelLMHead(Linear):
    def __init__(self, plan: ShardPlan, hidden: int, vocab_size: int):
        super().__init__(hidden, plan.vocab_shard, bias=False)
        self.tp, self.rank, self.vocab_size = plan.tp, plan.rank, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> on rank 0 the full logits [S, vocab]; on the others their shard [S, vocab/tp]."""
        local = self.ops.linear(x, self.weight, None)
        if self.rank != 0:
            dist.gather(local, dst=0)
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]  # the last shard's padding rows dropped


def rank_config(mc: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The model as one rank sees it: its query heads, KV heads and MLP rows (hidden and vocab whole)."""
    return dataclasses.replace(mc, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
                               intermediate_size=plan.intermediate)


def build_rank_model(mc: ModelConfig, plan: ShardPlan, max_positions: int, dtype: torch.dtype,
                     device: torch.device) -> DecoderForCausalLM:
    """Rank `plan.rank`'s model, uninitialised (the loader fills it)."""
    local = rank_config(mc, plan)
    hidden = mc.hidden_size
    with torch.device("meta"):
        model = DecoderForCausalLM(local, max_positions, dtype, torch.device("meta"))
        for layer in model.layers:
            layer.self_attn.o_proj = RowParallelLinear(plan.num_heads * mc.head_dim, hidden, bias=False)
            layer.mlp.down_proj = RowParallelLinear(plan.intermediate, hidden, bias=False)
        model.embed_tokens = VocabParallelEmbedding(plan, hidden)
        model.lm_head = ParallelLMHead(plan, hidden, mc.vocab_size)
        model.to(dtype=dtype)
    model.materialize(device)
    model.rotary = RotaryEmbedding(mc.head_dim, max_positions, mc.rope, dtype, device)
    return model
