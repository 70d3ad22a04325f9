"""Load one rank's slices of a Hugging Face checkpoint: each rank reads only the rows (or columns)
it holds (distributed/shard_rules.py), through safetensors' lazy slices, never the whole tensor.
Under expert parallelism a rank reads only its own routed experts: a per-expert tensor of another
rank's expert is skipped, a stacked [E, ...] one is sliced to the rank's E/tp. A block-scaled fp8
weight is read whole and dequantized with its scales (as at tp=1) before the rank takes its slice:
a slice's rows need not fall on the scales' block bounds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from cluster.engine.distributed.layers import build_rank_model
from cluster.engine.distributed.plan import ShardPlan
from cluster.engine.distributed.shard_rules import Split, rank_split
from cluster.engine.model.decoder import DecoderForCausalLM
from cluster.engine.model import fp8_weights
from cluster.engine.model.loader import Piece, check_context, check_loaded, checkpoint_entries, keys_of, safetensors_files
from cluster.engine.model_config import ModelConfig


def load_rank_model(model_dir: str | Path, mc: ModelConfig, plan: ShardPlan, max_positions: int,
                    dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    model_dir = Path(model_dir)
    check_context(mc, max_positions)
    model = build_rank_model(mc, plan, max_positions, dtype, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    scales = fp8_weights.read_scales(safetensors_files(model_dir)) if mc.weight_quant else {}
    for f, name, piece, dest in checkpoint_entries(model_dir, mc, params):
        if piece.target.endswith(("embed_tokens.weight", "lm_head.weight")):
            dest.zero_()  # the last vocabulary shard's padding rows
        held = rank_experts(piece, plan)
        if held is None:
            scales.pop(name, None)  # another rank's expert (expert parallelism), and its scale
            continue
        piece, experts = held
        if piece.expert is not None:  # one expert's tensor: its slice of the stacked [E, ...] parameter
            dest = dest[piece.expert]
        lazy = f.get_slice(name)
        if lazy.get_dtype() == "F8_E4M3":  # no quantization_config, or no scale: refused by name
            lazy = Whole(fp8_weights.dequantize(name, f.get_tensor(name), scales, mc.weight_quant, dtype))
        copy_shard(lazy, dest, rank_split(piece.target, mc, plan), piece.part, f"{name}: rank {plan.rank}", experts)
        loaded |= keys_of(piece, params[piece.target])
    check_loaded(model, mc, loaded, model_dir)
    fp8_weights.check_scales_used(scales)
    model.eval()
    return model


def rank_experts(piece: Piece, plan: ShardPlan) -> tuple[Piece, slice | None] | None:
    """Under expert parallelism, where a routed expert's tensor goes on this rank: (the piece, its
    expert index made local; for a stacked [E, ...] tensor the rank's slice of E), or None when
    another rank holds that expert. Otherwise (piece, None)."""
    if not plan.expert_parallel or ".mlp.experts." not in piece.target:
        return piece, None
    first = plan.expert_start
    if piece.expert is None:
        return piece, slice(first, first + plan.local_experts)
    if not plan.holds_expert(piece.expert):
        return None
    return dataclasses.replace(piece, expert=piece.expert - first), None


class Whole:
    """A tensor read whole (an fp8 weight, dequantized), sliced as a safetensors lazy slice is."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def copy_shard(lazy, dest: torch.Tensor, split: Split | None, part: int | None, what: str,
               experts: slice | None = None) -> None:
    """Copy the rank's slice of a checkpoint tensor (a safetensors slice) into `dest`: the whole
    tensor (split None), one part of a fused parameter (part), or every part of a fused one;
    `experts`: the rank's slice of a stacked tensor's first (expert) axis."""
    ndim = len(lazy.get_shape())
    lead = [slice(None) if experts is None else experts] + [slice(None)] * (ndim - 1)
    if split is None:
        _copy(lazy[tuple(lead)], dest, what)
        return
    parts = split.parts if part is None else (dataclasses.replace(split.parts[part], src=0),)
    for p in parts:
        index = list(lead)
        index[ndim + split.axis] = slice(p.src + p.start, p.src + p.start + p.length)
        _copy(lazy[tuple(index)], dest.narrow(dest.dim() + split.axis, p.dst, p.length), what)


def _copy(tensor: torch.Tensor, dest: torch.Tensor, what: str) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"{what}'s slice {tuple(tensor.shape)} != {tuple(dest.shape)}")
    dest.copy_(tensor)
