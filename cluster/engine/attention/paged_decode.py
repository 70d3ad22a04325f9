"""Decode attention over the paged cache with fixed shapes: the static decode path's kernels.

Every input is a device tensor of a shape fixed by the step's bucket (batch rows B, table width W
blocks), and nothing is read back to the host, so the step can be captured as a CUDA graph:

- `paged_decode_triton` (CUDA): one Triton program per (row, KV head) walks the row's block table
  and reads K/V in place from the pool, TILE keys at a time, online softmax in float32. The KV
  head's query heads (GQA) are one tile padded to 16 rows, so both products run on tensor cores
  (float32 in IEEE precision). No gather, no padded copy; a row reads only its own keys.
- `paged_decode_torch` (CPU, and CUDA where Triton is missing): the reference. It gathers the W
  blocks of every row (index_select of whole blocks) and masks keys past each row's length on the
  device; the gather is what the Triton kernel removes.

Both take q [B, H, D], one layer's k/v cache [num_blocks, block_size, H_kv, D] (a strided view of
the pool is fine), block tables [B, W] int32 and context lengths [B] int32, and give [B, H, D].
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale: float, window: int = 0) -> torch.Tensor:
    """window > 0: a row of length L sees only positions L - window .. L - 1 (a sliding layer), and
    gathers only the ceil(window / block_size) + 1 columns from the block holding L - window (a
    fixed width: no host read)."""
    b, w = block_tables.shape
    bs, hkv, d = k_cache.shape[1:]
    first = torch.zeros(b, 1, dtype=torch.long, device=q.device)
    if window:
        first = ((seq_lens.long() - window).clamp(min=0) // bs)[:, None]
        w = min(w, -(-window // bs) + 1)
        cols = (first + torch.arange(w, device=q.device)[None, :]).clamp(max=block_tables.shape[1] - 1)
        block_tables = block_tables.gather(1, cols.to(block_tables.dtype).long())
    idx = block_tables.reshape(-1).long()
    k = k_cache.index_select(0, idx).view(b, w * bs, hkv, d).transpose(1, 2)  # [B, H_kv, W * bs, D]
    v = v_cache.index_select(0, idx).view(b, w * bs, hkv, d).transpose(1, 2)
    key_pos = first * bs + torch.arange(w * bs, device=q.device)[None, :]
    mask = key_pos < seq_lens[:, None]  # [B, W * bs]
    if window:
        mask &= key_pos >= seq_lens[:, None] - window
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 — only on CUDA, only when chosen
    import triton.language as tl  # noqa: PLC0415

    @triton.jit
    def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
        stride_qb, stride_qh,
        stride_kn, stride_ks, stride_kh,
        stride_vn, stride_vs, stride_vh,
        stride_ob, stride_oh,
        stride_tb,
        scale,
        window,  # > 0: a row sees only its last `window` positions (a sliding layer)
        PAGE: tl.constexpr,  # tokens per KV block
        GROUP: tl.constexpr,  # query heads per KV head
        BLOCK_H: tl.constexpr,  # GROUP padded to a tensor-core tile (>= 16)
        D: tl.constexpr,
        TILE: tl.constexpr,  # keys per iteration
        PRECISION: tl.constexpr,  # "ieee" for float32 (exact to float32), else "tf32" (unused for bf16/fp16)
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        seq_len = tl.load(lens_ptr + b)
        g = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        gmask = g < GROUP
        heads = kvh * GROUP + g
        # the head group's queries as one [BLOCK_H, D] tile (padding heads are zeros, never stored)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
        for start in range(lo // TILE * TILE, seq_len, TILE):  # tiles before the window are never read
            t = start + tl.arange(0, TILE)
            tmask = (t < seq_len) & (t >= lo)
            block = tl.load(tables_ptr + b * stride_tb + t // PAGE, mask=tmask, other=0).to(tl.int64)
            slot = t % PAGE
            kt = tl.load(k_ptr + block[None, :] * stride_kn + slot[None, :] * stride_ks + kvh * stride_kh + d[:, None],
                         mask=tmask[None, :], other=0.0)  # [D, TILE]: K transposed
            s = tl.dot(q, kt, input_precision=PRECISION) * scale  # [BLOCK_H, TILE] float32
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + block[:, None] * stride_vn + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=tmask[:, None], other=0.0)  # [TILE, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])

    return triton, paged_decode_kernel


def paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale: float, window: int = 0,
                        tile: int = 64) -> torch.Tensor:
    triton, kernel = _kernel()
    b, h, d = q.shape
    bs, hkv = k_cache.shape[1:3]
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode_triton needs the head dimension contiguous")
    if d < 16 or d & (d - 1):
        raise ValueError(f"paged_decode_triton needs a power-of-two head_dim >= 16, not {d}")
    group = h // hkv
    out = torch.empty_like(q)
    kernel[(b, hkv)](
        q, k_cache, v_cache, out, block_tables, seq_lens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        scale,
        window,
        PAGE=bs, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=d, TILE=tile,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
    )
    return out
