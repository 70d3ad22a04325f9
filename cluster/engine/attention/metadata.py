"""Per-step attention metadata, built once per step and shared by every layer.

Token layout of a step: the decode tokens first (one per decoding request, longest context
first), then each prefill chunk's tokens contiguously.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSpan:
    q_start: int  # offset of this chunk's first token in the step's flat token array
    q_len: int
    ctx_len: int  # tokens of context after this chunk (cached + earlier chunks + this one)
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] long
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when the chunk is the whole context


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar context length, attended as one padded batch."""

    start: int  # first decode token of the group in the step's flat token array
    end: int
    block_tables: torch.Tensor  # [n, max_blocks] long, padded with 0
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool: key position < context length


@dataclass(frozen=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id each new token's K/V is written to
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decode: int
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillSpan, ...]
    # Inputs for kernels that take a batch as cumulative lengths (flash-attn varlen).
    cu_seqlens_q: torch.Tensor  # [B + 1] int32 over (decodes, then prefills)
    seq_lens: torch.Tensor  # [B] int32 context lengths
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_q_len: int
    max_seq_len: int
