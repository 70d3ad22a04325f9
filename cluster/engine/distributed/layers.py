"""The layers that differ on a tensor-parallel rank, and the rank's model built from them.

Column-parallel (qkv, gate/up) needs no new layer: a rank's model is the plain DecoderForCausalLM
built with its own head and intermediate counts (the loader fills those rows). Row-parallel
(o_proj, down_proj) sums the ranks' partial outputs with an all-reduce. The embedding and the LM
head hold a vocabulary shard each; the embedding's rows are all-reduced (one rank holds each
token, the others add zeros: exact), the LM head's logits are gathered on rank 0, the driver,
because the sampler reads the whole row (penalties, top-k/p, logprobs, grammar masks): a
distributed argmax would serve greedy only. A mixture-of-experts layer holds 1/tp of every
expert's rows, or with expert parallelism E/tp whole experts, and is all-reduced once
(distributed/moe_shard.py); latent attention splits its
query heads and keeps the latent path whole (its o_proj is row-parallel as any other).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cluster.engine.distributed.moe_shard import parallel_moe
from cluster.engine.distributed.plan import ShardPlan
from cluster.engine.model.decoder import DecoderForCausalLM
from cluster.engine.model.layers import Linear
from cluster.engine.model.moe import SparseMoE
from cluster.engine.model_config import ModelConfig


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r @ W_r^T (+ bias, once): each rank holds the input columns of its
    heads (o_proj) or of its MLP rows (down_proj). A bias (MLA's o_proj with attention_bias) is
    whole on every rank and added after the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.linear(x, self.weight, None)  # [T, hidden], this rank's partial sum
        dist.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)


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
    """The model as one rank sees it: its query heads, KV heads, MLP and expert rows (hidden, vocab,
    the router and the latent whole)."""
    moe = mc.moe and dataclasses.replace(mc.moe, intermediate_size=plan.expert_intermediate)
    routing = mc.moe_routing and dataclasses.replace(mc.moe_routing, shared_intermediate_size=plan.shared_intermediate)
    return dataclasses.replace(mc, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
                               intermediate_size=plan.intermediate, moe=moe, moe_routing=routing)


def shard_layer(layer: nn.Module, mc: ModelConfig, local: ModelConfig, plan: ShardPlan) -> None:
    """Make a layer built from the rank's config (column-parallel already: its rows) sum over the
    ranks: o_proj and a dense MLP's down_proj row-parallel, an MoE layer all-reduced once."""
    attn = layer.self_attn
    attn.o_proj = RowParallelLinear(attn.o_proj.in_features, mc.hidden_size, bias=attn.o_proj.bias is not None)
    if isinstance(layer.mlp, SparseMoE):
        layer.mlp = parallel_moe(local, plan)
    else:
        layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, mc.hidden_size, bias=False)


def build_rank_model(mc: ModelConfig, plan: ShardPlan, max_positions: int, dtype: torch.dtype,
                     device: torch.device) -> DecoderForCausalLM:
    """Rank `plan.rank`'s model, uninitialised (the loader fills it)."""
    local = rank_config(mc, plan)
    hidden = mc.hidden_size
    with torch.device("meta"):
        model = DecoderForCausalLM(local, max_positions, dtype, torch.device("meta"))
        for layer in model.layers:
            shard_layer(layer, mc, local, plan)
        model.embed_tokens = VocabParallelEmbedding(plan, hidden)
        model.lm_head = ParallelLMHead(plan, hidden, mc.vocab_size)
        model.to(dtype=dtype)
    model.materialize(device)
    model.build_rotary(max_positions, dtype, device)  # not in checkpoints; a sliding layer's too (Gemma 3)
    return model
