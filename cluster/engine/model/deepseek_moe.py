"""DeepSeek-V3's MoE layer: the grouped experts of model/moe.py behind transformers'
DeepseekV3TopkRouter (sigmoid scores, the score correction bias, group-limited top-k,
routed_scaling_factor), plus the shared experts, one dense MLP every token runs. DeepSeek-V2's is
the same layer behind DeepseekV2TopkRouter (softmax scores, no bias; GroupedRouting.scoring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.model.layers import MLP, Linear
from cluster.engine.model.moe import SparseMoE
from cluster.engine.model_config import GroupedRouting, MoEConfig


class GroupedRouter(nn.Module):
    """The router's float32 parameters (transformers keeps them float32 whatever the run dtype:
    _keep_in_fp32_modules_strict), under transformers' names."""

    def __init__(self, num_experts: int, hidden: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))  # [E, H]
        if bias:  # DeepSeek-V3's; V2 has none
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)  # [E]

    def _apply(self, fn, recurse=True):
        # A dtype cast of the model (DecoderForCausalLM's .to(dtype)) leaves the router float32.
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)


class SharedExperts(MLP):
    """n_shared_experts experts as one SiLU-gated MLP of moe_intermediate_size x n_shared_experts."""

    def __init__(self, hidden: int, intermediate: int):
        nn.Module.__init__(self)
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)


class DeepSeekMoE(SparseMoE):
    def __init__(self, moe: MoEConfig, routing: GroupedRouting, hidden: int):
        super().__init__(moe, hidden)
        self.softmax = routing.scoring == "softmax"
        self.gate = GroupedRouter(moe.num_experts, hidden, bias=not self.softmax)
        self.shared_experts = SharedExperts(hidden, routing.shared_intermediate_size)
        self.num_groups, self.topk_groups, self.scaling = routing.num_groups, routing.topk_groups, routing.scaling

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, experts [T, k] int64), transformers' ops in its order
        (the k choices unsorted, as its topk(sorted=False) leaves them)."""
        if self.softmax:
            return self._route_softmax(x)
        e, g = self.num_experts, self.num_groups
        scores = F.linear(x.float(), self.gate.weight).sigmoid()  # [T, E]
        biased = scores + self.gate.e_score_correction_bias
        group_scores = biased.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]: each group's best two
        groups = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        eligible = group_mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e).bool()
        experts = torch.topk(biased.masked_fill(~eligible, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * self.scaling, experts

    def _route_softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V2's router: softmax scores; with groups (group_limited_greedy) only the experts of
        the topk_groups groups whose best score is highest, the others' scores zeroed."""
        e, g = self.num_experts, self.num_groups
        scores = F.linear(x.float(), self.gate.weight).softmax(dim=-1, dtype=torch.float32)  # [T, E]
        if g > 1:
            group_scores = scores.view(-1, g, e // g).max(dim=-1).values  # [T, G]
            groups = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
            eligible = group_mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e).bool()
            scores = scores.masked_fill(~eligible, 0.0)
        weights, experts = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] -> [T, H]
        return self.routed(x) + self.shared_experts(x)
