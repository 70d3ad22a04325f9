"""One rank's share of a replica: its slice of the model, its heads of every KV block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.engine.attention import AttentionBackend, resolve_backend
from cluster.engine.config import kv_block_shape, run_dtype
from cluster.engine.distributed.loader import load_rank_model
from cluster.engine.distributed.plan import ShardPlan
from cluster.engine.distributed.step import RankReport, WorkerSpec
from cluster.engine.model.decoder import DecoderForCausalLM
from cluster.engine.model.ops import resolve_ops
from cluster.engine.model_config import ModelConfig


@dataclass
class RankModel:
    plan: ShardPlan
    model: DecoderForCausalLM
    kv_cache: torch.Tensor  # [num_blocks, L, 2, bs, H_kv / tp (or 1, replicated), D]; MLA [.., L, 1, bs, 1, C+R]
    ops: object
    steps: int = 0

    @classmethod
    def build(cls, spec: WorkerSpec, rank: int, device: torch.device) -> "RankModel":
        config = spec.config
        mc = ModelConfig.from_dir(config.model)
        plan = ShardPlan.for_model(mc, config.tensor_parallel_size, rank, config.expert_parallel)
        dtype = getattr(torch, run_dtype(mc, config))
        model = load_rank_model(config.model, mc, plan, spec.max_model_len, dtype, device)
        # Layer by layer: the fused decode kernel runs every layer in one call, with no point
        # between a layer's ops for the two all-reduces a tensor-parallel layer needs.
        ops = resolve_ops(config.model_ops, device, dtype, fused_decode_rows=0)
        model.use_ops(ops)
        kv_cache = torch.zeros(spec.num_blocks, *rank_block_shape(mc, plan, config.block_size), dtype=dtype,
                               device=device)
        return cls(plan, model, kv_cache, ops)

    def forward(self, input_ids, positions, meta, backend: AttentionBackend, logits_indices) -> torch.Tensor:
        self.steps += 1
        return self.model(input_ids, positions, self.kv_cache, meta, backend, logits_indices)

    def backend(self, spec: WorkerSpec, device: torch.device) -> AttentionBackend:
        return resolve_backend(spec.config.attention_backend, device, spec.config.block_size, self.kv_cache.dtype)

    def report(self, with_kv: bool) -> RankReport:
        return RankReport(self.plan.rank, tuple(self.kv_cache.shape),
                          (self.plan.kv_head_start, self.plan.num_kv_heads), self.steps,
                          self.kv_cache.clone() if with_kv else None)


def rank_block_shape(mc: ModelConfig, plan: ShardPlan, block_size: int) -> tuple[int, ...]:
    """One block on a rank: its KV heads of every layer, or the whole latent (every rank holds it)."""
    if mc.mla is not None:
        return kv_block_shape(mc, block_size)
    return (mc.num_layers, 2, block_size, plan.num_kv_heads, mc.head_dim)
