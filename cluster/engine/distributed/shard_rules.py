"""Which rows or columns of each parameter a tensor-parallel rank holds (the loader reads those).

A rule is a `Split`: the axis it cuts (counted from the end, so an expert's [I, H] tensor and the
stacked [E, I, H] one cut alike) and the parts of a fused parameter, each cut for itself: q, k, v
of qkv_proj (each of the rank's heads), gate and up of gate_up_proj (each its 1/tp of the rows). A
checkpoint tensor that is one part (q_proj) fills that part; one that is the whole fused
parameter (Phi-3's qkv_proj and gate_up_proj) fills every part from its own offsets. A parameter
with no rule (the norms, q/k norms, the router, MLA's down-projections and latent norm) is whole
on every rank, and so is each routed expert a rank holds under expert parallelism (which experts
it holds: distributed/loader.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.engine.distributed.plan import ShardPlan
from cluster.engine.model_config import ModelConfig


@dataclass(frozen=True)
class Part:
    src: int  # the part's first row (or column) in the whole fused checkpoint tensor
    dst: int  # its first in the rank's parameter
    start: int  # the rank's first within the part
    length: int  # how many the rank holds


@dataclass(frozen=True)
class Split:
    axis: int  # -2: a weight's rows (column-parallel), -1: its columns (row-parallel) or a bias's elements
    parts: tuple[Part, ...]


def _one(axis: int, start: int, length: int) -> Split:
    return Split(axis, (Part(0, 0, start, length),))


def _gate_up(whole: int, local: int, rank: int) -> Split:
    """gate rows, then up rows, `whole` each in the checkpoint, `local` each on the rank."""
    return Split(-2, tuple(Part(p * whole, p * local, rank * local, local) for p in (0, 1)))


def _qkv(mc: ModelConfig, plan: ShardPlan, axis: int) -> Split:
    d, h, hkv = mc.head_dim, mc.num_heads, mc.num_kv_heads
    q, kv = plan.num_heads * d, plan.num_kv_heads * d
    return Split(axis, (Part(0, 0, plan.head_start * d, q),
                        Part(h * d, q, plan.kv_head_start * d, kv),
                        Part((h + hkv) * d, q + kv, plan.kv_head_start * d, kv)))


def _mlp_sizes(target: str, mc: ModelConfig, plan: ShardPlan) -> tuple[int, int]:
    """(the checkpoint's rows, the rank's) of the MLP that `target` belongs to."""
    if ".experts." in target:
        return mc.moe.intermediate_size, plan.expert_intermediate
    if ".shared_experts." in target:
        return mc.moe_routing.shared_intermediate_size, plan.shared_intermediate
    return mc.intermediate_size, plan.intermediate


_MLP = r"\.mlp\.(?:experts\.|shared_experts\.)?"


def rank_split(target: str, mc: ModelConfig, plan: ShardPlan) -> Split | None:
    """The slice of parameter `target` rank `plan.rank` holds; None: the whole parameter."""
    if target.endswith(("embed_tokens.weight", "lm_head.weight")):
        return _one(-2, plan.vocab_start, max(0, min(plan.vocab_shard, mc.vocab_size - plan.vocab_start)))
    m = re.search(r"\.self_attn\.(qkv_proj|o_proj|q_proj|q_b_proj|kv_b_proj)\.(weight|bias)$", target)
    if m:
        return _attention(m.group(1), m.group(2), mc, plan)
    m = re.search(_MLP + r"(gate_up_proj|down_proj)(?:\.weight)?$", target)
    if m:
        whole, local = _mlp_sizes(target, mc, plan)
        if plan.expert_parallel and ".mlp.experts." in target:  # the rank's experts whole: every row
            return _gate_up(whole, whole, 0) if m.group(1) == "gate_up_proj" else None
        if m.group(1) == "gate_up_proj":
            return _gate_up(whole, local, plan.rank)
        return _one(-1, plan.rank * local, local)
    return None


def _attention(proj: str, kind: str, mc: ModelConfig, plan: ShardPlan) -> Split | None:
    if proj == "qkv_proj":
        return _qkv(mc, plan, -2 if kind == "weight" else -1)
    if kind == "bias":  # o_proj's (MLA with attention_bias): added once, after the all-reduce
        return None
    heads, first = plan.num_heads, plan.head_start
    if proj == "o_proj":  # row-parallel: the input columns of the rank's heads
        d = mc.mla.v_head_dim if mc.mla else mc.head_dim
        return _one(-1, first * d, heads * d)
    m = mc.mla  # MLA's per-head up-projections: the rows of the rank's heads
    d = m.qk_nope_head_dim + (m.qk_rope_head_dim if proj != "kv_b_proj" else m.v_head_dim)
    return _one(-2, first * d, heads * d)
