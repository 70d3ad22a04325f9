"""A mixture-of-experts layer on a tensor-parallel rank (vLLM's rule: experts sharded by their
intermediate size, not whole experts per rank; that is expert parallelism, not built).

The rank's layer is the plain one (model/moe.py, model/deepseek_moe.py) built with 1/tp of every
expert's rows (rank_config): its router is whole, so on the same (all-reduced, so identical) input
every rank picks the same experts for the same tokens, and runs its rows of each. Each expert's
down projection then gives a partial sum over its rows, scaled by the same routing weight on every
rank; DeepSeek-V3's shared experts add their own partial sum. The layer's output is the sum over
ranks: one all-reduce, as after a dense MLP."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cluster.engine.model.deepseek_moe import DeepSeekMoE
from cluster.engine.model.moe import SparseMoE
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


def parallel_moe(local: ModelConfig) -> SparseMoE:
    """The MoE layer of a rank whose config (distributed/layers.py rank_config) holds its rows."""
    if local.moe_routing is None:
        return ParallelSparseMoE(local.moe, local.hidden_size)
    return ParallelDeepSeekMoE(local.moe, local.moe_routing, local.hidden_size)
