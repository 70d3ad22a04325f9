"""Load one rank's slices of a Hugging Face checkpoint: each rank reads only the rows (or columns)
it holds, through safetensors' lazy slices, never the whole tensor."""

from __future__ import annotations

from pathlib import Path

import torch

from cluster.engine.distributed.layers import build_rank_model
from cluster.engine.distributed.plan import ShardPlan
from cluster.engine.model.decoder import DecoderForCausalLM
from cluster.engine.model.loader import check_context, check_loaded, checkpoint_entries, keys_of
from cluster.engine.model_config import ModelConfig


def load_rank_model(model_dir: str | Path, mc: ModelConfig, plan: ShardPlan, max_positions: int,
                    dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    model_dir = Path(model_dir)
    check_context(mc, max_positions)
    model = build_rank_model(mc, plan, max_positions, dtype, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for f, name, piece, dest in checkpoint_entries(model_dir, mc, params):
        target = piece.target  # never an expert's: no family with experts shards (plan.check_degree)
        dim, start, length, offset = rank_slice(target, piece.part, mc, plan)
        lazy = f.get_slice(name)
        tensor = lazy[start : start + length] if dim == 0 else lazy[:, start : start + length]
        if target.endswith(("embed_tokens.weight", "lm_head.weight")):
            dest[length:].zero_()  # the last vocabulary shard's padding rows
        dest = dest.narrow(0, offset, tensor.shape[0])
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: rank {plan.rank}'s slice {tuple(tensor.shape)} != {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded |= keys_of(piece, params[target])
    check_loaded(model, mc, loaded, model_dir)
    model.eval()
    return model


def rank_slice(target: str, shard: int | None, mc: ModelConfig, plan: ShardPlan) -> tuple[int, int, int, int]:
    """(dim, start, length, dest_row): the checkpoint tensor's slice along `dim` that rank holds,
    and the row of the rank's (possibly fused) parameter it goes to."""
    d = mc.head_dim
    if "qkv_proj" in target:  # column-parallel: q rows of the rank's heads, k and v of its KV heads
        q, kv = plan.num_heads * d, plan.num_kv_heads * d
        if shard == 0:
            return 0, plan.head_start * d, q, 0
        return 0, plan.kv_head_start * d, kv, q + (shard - 1) * kv
    if "gate_up_proj" in target:
        n = plan.intermediate
        return 0, plan.rank * n, n, shard * n
    if "o_proj" in target:  # row-parallel: the input columns of the rank's heads
        return 1, plan.head_start * d, plan.num_heads * d, 0
    if "down_proj" in target:
        return 1, plan.rank * plan.intermediate, plan.intermediate, 0
    if target.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0, plan.vocab_start, max(0, min(plan.vocab_shard, mc.vocab_size - plan.vocab_start)), 0
    return 0, 0, mc.hidden_size, 0  # the norms' [hidden] weights: whole on every rank
