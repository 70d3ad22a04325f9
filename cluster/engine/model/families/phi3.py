"""Phi-3: the Llama layer, its checkpoint already fused (self_attn.qkv_proj, mlp.gate_up_proj, the
same row order as ours), so no name is renamed. longrope (Phi-3 128k) and partial RoPE (Phi-4-mini)
are refused by the shared checks; sliding_window (Phi-3-mini-4k: 2047) is checked at load."""

from __future__ import annotations

from cluster.engine.model.families.base import Family, FamilyFields


def _phi3(cfg: dict) -> FamilyFields:
    return FamilyFields()


# Tensor-parallel: the rank loader cuts each part of the fused tensors (distributed/shard_rules.py).
PHI3 = Family(parse=_phi3, renames=(), tensor_parallel=True)
