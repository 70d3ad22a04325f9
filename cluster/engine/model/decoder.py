"""The decoder every served family runs (model/families/), over a paged KV cache.

The model runs a flat batch of tokens [T] from many requests at once; attention metadata says
which tokens belong to which request and where their KV lives. A layer is the shared blocks
(model/layers.py, model/moe.py) as its ModelConfig asks: q/k norm or not, a dense MLP or the MoE.
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import nn

from cluster.engine.attention import AttentionBackend, AttentionMetadata
from cluster.engine.model.deepseek_moe import DeepSeekMoE
from cluster.engine.model.gemma import GemmaDecoderLayer, GemmaRMSNorm
from cluster.engine.model.layers import MLP, Attention, Linear, RMSNorm
from cluster.engine.model.mla import MLAttention
from cluster.engine.model.moe import SparseMoE
from cluster.engine.model.ops import TORCH_OPS
from cluster.engine.model.rope import RotaryEmbedding
from cluster.engine.model_config import ModelConfig


class DecoderLayer(nn.Module):
    window = None  # a sliding-window layer's window (model/gemma.py); None: full attention, the global RoPE

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and index in cfg.moe.sparse_layers
        self.mlp = (MLP(cfg) if not sparse else SparseMoE(cfg.moe, cfg.hidden_size) if cfg.moe_routing is None
                    else DeepSeekMoE(cfg.moe, cfg.moe_routing, cfg.hidden_size))

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta, backend):
        # x: the previous layer's output, residual: the stream before it (None at the first
        # layer, whose x is the embedding). Returns the same pair; the adds ride in the norms.
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, cos, sin, k_cache, v_cache, meta, backend)
        h = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class DecoderForCausalLM(nn.Module):
    ops = TORCH_OPS  # replaced by use_ops
    # A quantized pool's per-layer backends (attention/fp8_kv.py: FP8KV), set by the engine: layer
    # i reads and writes its cache through kv_quant.layer(i, backend). None: the pool is the run dtype.
    kv_quant = None

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        # Given its weight, the embedding skips its random init: the loaders build the model on the meta
        # device, where normal_ (as the rotary tables' ops) imports torch._dynamo, 1-3 s of a replica's
        # start, to fill nothing.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        layer = GemmaDecoderLayer if cfg.gemma else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = (GemmaRMSNorm if cfg.gemma else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)
        # Gemma: the embedding times sqrt(hidden) (rounded to the run dtype, as transformers), the
        # logits capped by tanh.
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, device="cpu").to(dtype)) if cfg.gemma else None
        self.softcap = cfg.gemma.final_logit_softcapping if cfg.gemma else None
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.to(dtype=dtype, device=device)
        # On the meta device (the loaders) the tables are left to the loader, after materialize
        self.rotary = self.rotary_local = None
        if device.type != "meta":
            self.build_rotary(max_positions, dtype, device)
        # The fused decode kernel (ops.decode_layers) knows only the Llama layer: a family says
        # whether its layers are that, and the layers built here must agree.
        self.llama_shaped = cfg.family.llama_shaped
        plain = all(type(layer.mlp) is MLP and type(layer.self_attn) is Attention and layer.self_attn.q_norm is None
                    for layer in self.layers)
        if self.llama_shaped and not plain:
            raise ValueError(f"model_type {cfg.model_type!r} is declared Llama-shaped but has q/k norms or MoE layers")

    def build_rotary(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        """The RoPE tables (not in checkpoints): the global layers', and the sliding layers' where
        their RoPE differs (Gemma 3's local base)."""
        cfg = self.cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, dtype, device)
        if cfg.local_rope is not None:
            self.rotary_local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope, dtype, device)

    def use_ops(self, ops) -> None:
        """Route every linear and norm through `ops` (model/ops.py), chosen once at load, and lay
        the linears' weights out as its kernels read them best (the tied embedding's with the LM head's)."""
        self.ops = ops
        for m in self.modules():
            if isinstance(m, (Linear, RMSNorm, SparseMoE)):
                m.ops = ops
            if isinstance(m, Linear):
                m.weight.data = ops.place_weight(m.weight.data)

    @cached_property
    def layer_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The layers' weights in the order ops.decode_layers takes them (6 a layer), and the qkv
        biases (none, or one a layer). Collected on the first fused step, after loading and use_ops
        (which may replace a parameter's data, never the parameter), not on every step."""
        weights, biases = [], []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += (layer.input_layernorm.weight, attn.qkv_proj.weight, attn.o_proj.weight,
                        layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
            if attn.qkv_proj.bias is not None:
                biases.append(attn.qkv_proj.bias)
        return weights, biases

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def materialize(self, device: torch.device) -> None:
        """Module.to_empty, tied again: a model built on the meta device gets uninitialised tensors on
        `device` (the loaders fill them). Contiguous ones: empty_like keeping a meta tensor's strides
        runs torch's Python reference, whose import of sympy is 1-2 s of a replica's start."""
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        self.tie_weights()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, H_kv, D]; latent attention's [.., L, 1, .., 1, C + R]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # [S] rows whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, vocab] float32
        x, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            x = x * self.embed_scale
        cos, sin = self.rotary(positions)
        local = (cos, sin) if self.rotary_local is None else self.rotary_local(positions)
        if self.llama_shaped and self.kv_quant is None and self.ops.fuses(meta):  # the layer stack in one kernel call
            weights, qkv_bias = self.layer_weights
            attn = self.layers[0].self_attn
            x, residual = self.ops.decode_layers(x, weights, qkv_bias, kv_cache, meta, cos, sin, attn.h, attn.hkv,
                                                 self.norm.eps, attn.scale)
        else:
            quant = self.kv_quant
            for i, layer in enumerate(self.layers):
                layer_backend = backend if quant is None else quant.layer(i, backend)
                c, s = (cos, sin) if layer.window is None else local
                # K and V; under latent attention both are the layer's one part, the latent
                x, residual = layer(x, residual, c, s, kv_cache[:, i, 0], kv_cache[:, i, -1], meta, layer_backend)
        x = self.norm(residual.add_(x)[logits_indices])
        logits = self.lm_head(x)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()
