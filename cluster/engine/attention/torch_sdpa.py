"""Reference backend: torch SDPA over blocks gathered from the paged cache (CPU and CUDA).

Decodes run in a few padded batches of similar length per layer (one gather, one SDPA call
each); prefill chunks run one SDPA call each. A chunk that is its request's whole context attends
to its own fresh K/V, so a cold prefill never gathers from the cache. Gathers use index_select
over whole blocks (a block's [block_size, H_kv, D] slab is contiguous), several times faster on
CPU than advanced indexing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.engine.attention.metadata import AttentionMetadata


def gather_blocks(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return cache.index_select(0, idx)


class TorchSDPABackend:
    name = "torch"

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        idx = (meta.slot_blocks, meta.slot_offsets)
        k_cache.index_put_(idx, k)
        v_cache.index_put_(idx, v)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        out = torch.empty_like(q)  # [T, H, D]
        self.attend_decodes(q, k_cache, v_cache, meta, scale, out)
        self.attend_prefills(q, k, v, k_cache, v_cache, meta, scale, out, self.read_k, self.read_v)
        return out

    # Whole blocks of one layer's cache, in the run dtype: [len(idx), block_size, H_kv, D]. A
    # quantized pool's backend (fp8_kv.py) dequantizes here, only the blocks a step reads.
    read_k = read_v = staticmethod(gather_blocks)

    def attend_decodes(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out) -> None:
        bs, hkv, d = k_cache.shape[1:]
        for g in meta.decode_groups:
            b, nb = g.block_tables.shape
            idx = g.block_tables.reshape(-1)
            kd = self.read_k(k_cache, idx).view(b, nb * bs, hkv, d).transpose(1, 2)  # [B, H_kv, L, D]
            vd = self.read_v(v_cache, idx).view(b, nb * bs, hkv, d).transpose(1, 2)
            qd = q[g.start : g.end].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale, enable_gqa=True)
            out[g.start : g.end] = o.squeeze(2)

    @staticmethod
    def attend_prefills(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out,
                        read_k=gather_blocks, read_v=gather_blocks) -> None:
        """Each multi-token chunk (a prefill chunk, or a decode with drafts) by one SDPA call. A
        chunk whose keys are its own (its whole context, or its whole window) attends to its own
        fresh K/V, never read back from the pool."""
        hkv, d = k_cache.shape[2:]
        for p in meta.prefills:
            qs = slice(p.q_start, p.q_start + p.q_len)
            qp = q[qs].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if p.ctx_len == p.q_len:  # the keys are the chunk's own
                kp, vp = k[qs], v[qs]
            else:
                kp = read_k(k_cache, p.block_ids).view(-1, hkv, d)[: p.ctx_len]
                vp = read_v(v_cache, p.block_ids).view(-1, hkv, d)[: p.ctx_len]
            kp = kp.transpose(0, 1).unsqueeze(0)  # [1, H_kv, ctx, D]
            vp = vp.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
            )
            out[qs] = o.squeeze(0).transpose(0, 1)
