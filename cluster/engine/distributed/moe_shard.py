"""A mixture-of-experts layer on a tensor-parallel rank, two ways.

By default (vLLM's rule) every expert is sharded by its intermediate size: the rank's layer is the
plain one (model/moe.py, model/deepseek_moe.py) built with 1/tp of every expert's rows
(rank_config). Its router is whole, so on the same (all-reduced, so identical) input every rank
picks the same experts for the same tokens and runs its rows of each. Each expert's down
projection then gives a partial sum over its rows, scaled by the same routing weight on every
rank; DeepSeek-V3's shared experts add their own partial sum. The layer's output is the sum over
ranks: one all-reduce, as after a dense MLP.

With expert parallelism (engine.expert_parallel) the routed experts are partitioned whole: rank r
holds experts [r E/tp, (r+1) E/tp) with all their rows. The router is whole on every rank as
before, so every rank sees every token's choices; each runs only the (token, choice) rows routed
to its own experts, weighted as at tp=1, and the same one all-reduce sums the ranks' outputs.
DeepSeek-V3's shared experts stay split by their rows (their partial sum joins the same
all-reduce). Every rank holds every token (the input is whole on each after the attention's
all-reduce), so no token moves between ranks: the all-to-all of a data-parallel attention is not
needed here."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cluster.engine.distributed.plan import ShardPlan
from cluster.engine.model.deepseek_moe import DeepSeekMoE
from cluster.engine.model.moe import Experts, SparseMoE
from cluster.engine.model_config import ModelConfig


class ParallelSparseMoE(SparseMoE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H], whole on every rank -> [T, H]
        y = super().forward(x)
        dist.all_reduce(y)
        return y


class ParallelDeepSeekMoE(DeepSeekMoE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # routed + shared experts' partial sums, then one sum
        y = super().forward(x)
        dist.all_reduce(y)
        return y


class LocalExperts:
    """The routed part of an expert-parallel layer: only the rows routed to this rank's experts
    (self.experts holds experts first_expert .. first_expert + local_count - 1 of the router's E)."""

    first_expert: int
    local_count: int

    def routed(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] -> this rank's experts' share [T, H]
        weights, experts = self.route(x)
        local = experts.flatten() - self.first_expert  # [T*k]: the rank's index of each choice's expert
        rows = ((local >= 0) & (local < self.local_count)).nonzero().squeeze(1)  # the choices it runs
        return self.grouped(x, weights.flatten()[rows], local[rows], rows)


class ExpertParallelSparseMoE(LocalExperts, ParallelSparseMoE):
    pass


class ExpertParallelDeepSeekMoE(LocalExperts, ParallelDeepSeekMoE):
    pass


def parallel_moe(local: ModelConfig, plan: ShardPlan) -> SparseMoE:
    """The MoE layer of a rank whose config (distributed/layers.py rank_config) holds its rows; with
    expert parallelism, its whole experts (plan.local_experts from plan.expert_start)."""
    if not plan.expert_parallel:
        if local.moe_routing is None:
            return ParallelSparseMoE(local.moe, local.hidden_size)
        return ParallelDeepSeekMoE(local.moe, local.moe_routing, local.hidden_size)
    if local.moe_routing is None:
        layer = ExpertParallelSparseMoE(local.moe, local.hidden_size)
    else:
        layer = ExpertParallelDeepSeekMoE(local.moe, local.moe_routing, local.hidden_size)
    layer.experts = Experts(plan.local_experts, plan.expert_intermediate, local.hidden_size)
    layer.first_expert, layer.local_count = plan.expert_start, plan.local_experts
    return layer
