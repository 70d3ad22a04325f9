"""CPU backend: decode attention reads K/V where they lie in the paged cache (no gather).

One compiled op per layer for all decode rows (cluster/engine/kernels/csrc/cpu_kernels.cpp, built once),
and one for the KV write. Multi-token chunks (prefill, or a decode with drafts) take the torch
backend's path unchanged. The torch backend is the reference it is tested against
(tests/engine/test_paged_attention.py). fp32 only; the registry chooses it on CPU for float32.
"""

from __future__ import annotations

import torch

from cluster.engine.kernels import cpu as cpu_kernels
from cluster.engine.attention.metadata import AttentionMetadata
from cluster.engine.attention.torch_sdpa import TorchSDPABackend


class CPUPagedBackend:
    name = "cpu_paged"

    def __init__(self):
        cpu_kernels.load()
        self._decode = torch.ops.pdserve_cpu.paged_decode.default  # the overload: cheaper to call than the packet
        self._write = torch.ops.pdserve_cpu.write_kv.default

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        self._write(k_cache, v_cache, k, v, meta.slot_blocks, meta.slot_offsets)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        nd = meta.num_decode
        if not meta.prefills:  # a decode-only step: the kernel's output is the step's
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.window)
        out = torch.empty_like(q)  # [T, H, D]
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                    meta.window)
        TorchSDPABackend.attend_prefills(q, k, v, k_cache, v_cache, meta, scale, out)
        return out
