"""Gemma 3's layer (model/families/gemma3.py), from the shared blocks: RMSNorms that scale by
(1 + weight), norms after attention and around the MLP, a gelu_pytorch_tanh-gated MLP, attention
scaled by query_pre_attn_scalar ** -0.5, and a sliding-window view of the step's attention
metadata on the sliding layers (attention/window.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.attention.window import windowed
from cluster.engine.model.layers import MLP, Attention, RMSNorm
from cluster.engine.model_config import ModelConfig


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's weight w scales by (1 + w), in float32 (transformers
    normalises and scales in float32 and casts the product back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return self.ops.rms_norm(x, self.weight + 1.0, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float() + 1.0, self.eps).to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self(residual.add_(x))


class GeluMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused as the shared MLP's."""

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg)
        self.self_attn.scale = cfg.gemma.query_pre_attn_scalar ** -0.5
        self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, eps)
        self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GeluMLP(cfg)
        # A sliding layer attends within the window and rotates with the local RoPE (decoder.py).
        self.window = cfg.sliding_window if index in cfg.sliding_layers else None

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta, backend):
        # The decoder's (x, residual) protocol: residual += x rides in the first norm, as its layers'.
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add(x, residual)
        if self.window is not None:
            meta = windowed(meta, self.window)
        h = self.self_attn(h, cos, sin, k_cache, v_cache, meta, backend)
        h = self.pre_feedforward_layernorm.add(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual
