"""Rotary position embeddings (rotate-half convention, as Hugging Face Llama), incl. linear, llama3 and
YaRN scaling (transformers' _compute_yarn_parameters: the frequencies blended between interpolated and
extrapolated by a linear ramp over the dims, and cos/sin scaled by the attention factor)."""

from __future__ import annotations

import math

import torch

from cluster.engine.model_config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    elif rope.rope_type == "linear":  # positions divided by factor: the same as frequencies divided
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_frequencies(head_dim, rope)
    return inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_scaling(rope: RopeConfig) -> float:
    """The factor on cos and sin: YaRN's attention factor, else 1."""
    y = rope.yarn
    if y is None:
        return 1.0
    if y.attention_factor is not None:
        return y.attention_factor
    if y.mscale and y.mscale_all_dim:
        return float(yarn_mscale(rope.factor, y.mscale) / yarn_mscale(rope.factor, y.mscale_all_dim))
    return yarn_mscale(rope.factor)


def _yarn_frequencies(dim: int, rope: RopeConfig) -> torch.Tensor:
    y, base = rope.yarn, rope.theta

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # 1: keep the dim's own frequency; 0: interpolate it by factor
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position, computed once in float32 and cast to the model dtype."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, dtype, device):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        scaling = attention_scaling(rope)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype=dtype, device=device), persistent=False)
        # sin with its first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin
        sin = emb.sin() * scaling
        sin[:, : head_dim // 2].neg_()
        self.register_buffer("signed_sin", sin.to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # -> cos, signed sin: [T, 1, D], broadcast over heads
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; rotate-half: x * cos + cat(-x2, x1) * sin, with the sign folded into the table
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    return x * cos + swapped * signed_sin
