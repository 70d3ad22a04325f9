"""Multi-head latent attention (DeepSeek-V2/V3), over a paged cache of latents.

Per token and layer the cache holds one vector of kv_lora_rank + qk_rope_head_dim elements: the
compressed latent c (kv_a_proj_with_mqa's first kv_lora_rank outputs after kv_a_layernorm) and the
rotated rope key k_r (its last qk_rope_head_dim), shared by every head. A layer's cache view is
[num_blocks, block_size, 1, C + R] (config.kv_block_shape).

Head h's key is [W_UK[h] c, k_r] and its value W_UV[h] c, where kv_b_proj's rows are, per head,
W_UK (qk_nope_head_dim rows) then W_UV (v_head_dim rows). Two forms of one attention:
- Decode (absorbed, DeepSeek's own inference form): q_nope is taken into the latent space once,
  q_c = q_nope W_UK [T, H, C], and every head attends over the cached [c, k_r] rows themselves
  (scores q_c . c + q_r . k_r, values c), one KV "head" for all H; the output W_UV o_c. A decode
  step reads only the latent bytes.
- Prefill (expanded, as transformers): the context's latents go through kv_b_proj to per-head
  keys and values, then ordinary causal attention; cheaper when many queries share the context.
The two differ by float rounding only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.attention import AttentionMetadata
from cluster.engine.model.layers import Linear, RMSNorm
from cluster.engine.model.rope import yarn_mscale
from cluster.engine.model_config import ModelConfig, RopeConfig

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with the default eps


def softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale:
    MLA scales the whole q.k, not only the rotated dims)."""
    scale = qk_head_dim**-0.5
    if rope.yarn is not None and rope.yarn.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.yarn.mscale_all_dim) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m, hidden = cfg.mla, cfg.hidden_size
        self.h, self.c, self.r = cfg.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
        self.nope, self.v = m.qk_nope_head_dim, m.v_head_dim
        self.interleave = m.rope_interleave
        qk = self.nope + self.r
        self.q_lora = m.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = Linear(hidden, self.h * qk, bias=False)
        else:
            self.q_a_proj = Linear(hidden, m.q_lora_rank, bias=m.bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, self.h * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.c + self.r, bias=m.bias)
        self.kv_a_layernorm = RMSNorm(self.c, LORA_NORM_EPS)
        self.kv_b_proj = Linear(self.c, self.h * (self.nope + self.v), bias=False)
        self.o_proj = Linear(self.h * self.v, hidden, bias=m.bias)
        self.scale = softmax_scale(qk, cfg.rope)

    def forward(self, x, cos, sin, cache, _v_cache, meta: AttentionMetadata, _backend=None):
        # x: [T, hidden]; cache: this layer's [num_blocks, block_size, 1, C + R] (an MLA pool has one part)
        t, h = x.shape[0], self.h
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(t, h, self.nope + self.r)
        kv = self.kv_a_proj_with_mqa(x)  # [T, C + R]
        latent = self.kv_a_layernorm(kv[:, : self.c].contiguous())
        rot = torch.cat([q[:, :, self.nope :], kv[:, None, self.c :]], dim=1)  # [T, H + 1, R]: q heads, then k
        if self.interleave:  # pairs (x0, x1), (x2, x3) -> evens then odds: transformers' rotation, its layout
            rot = rot.view(t, h + 1, self.r // 2, 2).transpose(2, 3).reshape(t, h + 1, self.r)
        rot = self.kv_b_proj.ops.rope(rot, cos, sin)
        q_nope, q_rope = q[:, :, : self.nope], rot[:, :h]
        entry = torch.cat([latent, rot[:, h]], dim=-1)  # [T, C + R]: what the cache keeps
        cache.index_put_((meta.slot_blocks, meta.slot_offsets), entry[:, None])
        out = x.new_empty(t, h, self.v)
        if meta.num_decode:
            self._attend_decodes(q_nope[: meta.num_decode], q_rope[: meta.num_decode], cache, meta, out)
        for p in meta.prefills:
            self._attend_prefill(q_nope, q_rope, entry, cache, p, out)
        return self.o_proj(out.view(t, h * self.v))

    def _heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head: W_UK [H, nope, C], W_UV [H, v, C] (views; the weight may be
        laid out with padded rows, model/ops.py place_weight, so split along rows only)."""
        w = self.kv_b_proj.weight.unflatten(0, (self.h, self.nope + self.v))
        return w[:, : self.nope], w[:, self.nope :]

    def _attend_decodes(self, q_nope, q_rope, cache, meta: AttentionMetadata, out) -> None:
        """The absorbed form over the cached latents, in the torch backend's padded decode groups."""
        w_uk, w_uv = self._heads()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [D, H, C]
        q = torch.cat([q_lat, q_rope], dim=-1)  # [D, H, C + R]
        bs, width = cache.shape[1], cache.shape[-1]
        for g in meta.decode_groups:
            b, nb = g.block_tables.shape
            kv = cache.index_select(0, g.block_tables.reshape(-1)).view(b, 1, nb * bs, width)  # [B, 1, L, C + R]
            o = F.scaled_dot_product_attention(q[g.start : g.end, :, None], kv, kv[..., : self.c], attn_mask=g.mask,
                                               scale=self.scale, enable_gqa=True)  # [B, H, 1, C]
            out[g.start : g.end] = torch.bmm(o[:, :, 0].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _attend_prefill(self, q_nope, q_rope, entry, cache, p, out) -> None:
        """One multi-token chunk, expanded: its context's latents (its own fresh entries when the chunk
        is the whole context, else read back from the cache) to per-head keys and values."""
        qs = slice(p.q_start, p.q_start + p.q_len)
        if p.mask is None:
            ctx = entry[qs]
        else:
            ctx = cache.index_select(0, p.block_ids).view(-1, cache.shape[-1])[: p.ctx_len]
        n, h = ctx.shape[0], self.h
        kv = self.kv_b_proj(ctx[:, : self.c].contiguous()).view(n, h, self.nope + self.v)
        k = torch.cat([kv[..., : self.nope], ctx[:, None, self.c :].expand(n, h, self.r)], dim=-1)  # [n, H, qk]
        q = torch.cat([q_nope[qs], q_rope[qs]], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           kv[..., self.nope :].transpose(0, 1)[None], attn_mask=p.mask,
                                           is_causal=p.mask is None, scale=self.scale)  # [1, H, q, v]
        out[qs] = o[0].transpose(0, 1)
