"""CUDA backend: flash-attn 2 varlen kernel reading K/V straight from the paged cache.

Imported only when chosen (never on CPU). flash-attn 2's paged mode needs block_size % 256 == 0;
the registry checks that before choosing this backend.
"""

from __future__ import annotations

import torch

from cluster.engine.attention.metadata import AttentionMetadata


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self):
        from flash_attn import flash_attn_varlen_func  # noqa: PLC0415 — lazy by design

        self._varlen = flash_attn_varlen_func

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        idx = (meta.slot_blocks, meta.slot_offsets)
        k_cache.index_put_(idx, k)
        v_cache.index_put_(idx, v)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        cu_k = torch.zeros(meta.seq_lens.numel() + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
        return self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_q_len, max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale, causal=True, block_table=meta.block_tables,
        )
