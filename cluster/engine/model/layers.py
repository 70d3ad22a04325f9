"""The shared blocks every family's layers are built from: RMSNorm, Linear, attention, the dense MLP.

Each runs on a flat batch of tokens [T] from many requests; q/k/v and gate/up are fused at load
(one matmul each). Linears and norms go through `ops` (model/ops.py), chosen once at load.
"""

from __future__ import annotations

import torch
from torch import nn

from cluster.engine.attention import AttentionBackend, AttentionMetadata
from cluster.engine.model.ops import TORCH_OPS
from cluster.engine.model_config import ModelConfig


class RMSNorm(nn.Module):
    ops = TORCH_OPS  # replaced by DecoderForCausalLM.use_ops

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place), then the norm of the sum."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Linear):
    ops = TORCH_OPS  # replaced by DecoderForCausalLM.use_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.scale = self.d**-0.5
        # Qwen3: an RMSNorm over head_dim on every q and k head, before RoPE.
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t = x.shape[0]  # x: [T, hidden]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : (self.h + self.hkv) * self.d].view(t, self.h + self.hkv, self.d)
        if self.q_norm is not None:  # normed in place: qkv is this step's own activation
            qk[:, : self.h] = self.q_norm(qk[:, : self.h])
            qk[:, self.h :] = self.k_norm(qk[:, self.h :])
        qk = self.qkv_proj.ops.rope(qk, cos, sin)
        q, k = qk[:, : self.h], qk[:, self.h :]  # rotated together: one rope for both
        v = qkv[:, (self.h + self.hkv) * self.d :].view(t, self.hkv, self.d)
        backend.write_kv(k_cache, v_cache, k, v, meta)
        o = backend.attend(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(self.gate_up_proj.ops.silu_mul(self.gate_up_proj(x)))
